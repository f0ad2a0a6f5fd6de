"""What opening a spec logs, and `statefulset inspect SPEC.yaml`: figures checked against the shards."""

from __future__ import annotations

import json
import logging
import pickle

import numpy
import pytest
import yaml
from conftest import write_printable_shards

from statefulset import IndexedDataset
from statefulset.index.megatron.gpt import plan_epochs
from statefulset.streams.opening import open_stream
from statefulset.streams.overview import describe
from statefulset.tools.cli import main
from statefulset.tools.preview import preview_spec


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    # part_1 holds under 50 sequences, so a 1% test split of it rounds to none.
    return write_printable_shards(tmp_path_factory.mktemp("overview"), documents=(80, 15, 120), seed=3)


def write_spec(folder, name, **spec):
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def truth(prefix, lo, hi, seq_length):
    """Sequences, documents and tokens of a range, counted the slow way."""
    shard = IndexedDataset(prefix)
    tokens = int(shard.sequence_lengths[lo:hi].sum())
    documents = sum(1 for d in shard.document_indices[:-1] if lo <= d < hi)
    return {
        "sequences": hi - lo,
        "documents": documents,
        "tokens": tokens,
        "samples_per_epoch": (tokens - 1) // seq_length,
    }


def test_megatron_blend_open_logs_per_dataset_figures(shards, tmp_path, caplog):
    weights = {shards[0]: 0.5, shards[1]: 0.2, shards[2]: 0.3}
    spec = write_spec(
        tmp_path,
        "blend",
        data_path=weights,
        seq_length=16,
        split="90,10,0",
        num_samples=900,
        path_to_cache=str(tmp_path / "cache"),
    )
    with caplog.at_level(logging.INFO, logger="statefulset"):
        stream = open_stream(spec)
    text = caplog.text
    assert text.count("built GPTDataset indices into") == 3 and "built BlendedDataset indices into" in text
    assert f"{spec}: train: 900 samples" in text and "built 1 BlendedDataset, 3 GPTDataset indices" in text
    overview = describe(stream)
    counts = numpy.bincount(stream.blend["dataset_index"], minlength=3)
    for i, (source, item) in enumerate(zip(stream.sources, overview.sources, strict=True)):
        lo, hi = item.sequence_range
        assert {k: getattr(item, k) for k in ("sequences", "documents", "tokens", "samples_per_epoch")} == truth(
            item.prefix, lo, hi, 16
        )
        assert item.samples == len(source) and item.built_for == source.num_samples
        assert item.epochs == source.document_index.shape[0] // (hi - lo) and item.epochs >= 2
        assert item.separate_final_epoch == plan_epochs(item.tokens, 16, source.num_samples).separate_final_epoch
        assert item.weight == pytest.approx(list(weights.values())[i])
        assert item.blend_samples == counts[i] and item.share == pytest.approx(counts[i] / 900)
        assert f"sequences [{lo:,}, {hi:,}) = {hi - lo:,}, documents {item.documents:,}, tokens {item.tokens:,}" in text
        assert f"{item.samples:,} samples over {item.epochs} epoch(s)" in text
        assert f"weight {item.weight:.4f}, realised share {item.share:.4f} ({counts[i]:,} samples)" in text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="statefulset"):
        again = open_stream(spec)
    assert "indices into" not in caplog.text and "indices loaded from the cache" in caplog.text
    assert again.open_built == {} and stream.open_built == {"GPTDataset": 3, "BlendedDataset": 1}
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="statefulset"):
        pickle.loads(pickle.dumps(stream))  # a loader worker reopening the stream: silent at INFO
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    assert caplog.text.count("loaded GPTDataset indices from") == 3  # at DEBUG, with the time


def test_open_logs_nothing_when_info_is_off(shards, caplog):
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        open_stream({"data_path": shards[0], "seq_length": 16})
    assert caplog.text == ""


def test_native_overview_shares_are_the_weights(shards):
    spec = {"data_path": {shards[0]: 3, shards[1]: 1}, "seq_length": 8, "packing": "native", "num_samples": 1000}
    overview = describe(open_stream(spec))
    assert [s.share for s in overview.sources] == [0.75, 0.25] == [s.weight for s in overview.sources]
    windows = [s.windows for s in open_stream(spec).sources]
    assert [s.samples_per_epoch for s in overview.sources] == windows and overview.samples is None
    assert [s.epochs_at_num_samples for s in overview.sources] == pytest.approx([750 / windows[0], 250 / windows[1]])
    assert overview.samples_per_epoch == sum(windows)
    valid = describe(open_stream({**spec, "split": "80,20,0"}, "valid"))
    assert valid.samples == valid.samples_per_epoch  # valid is served once


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_spec_yaml(shards, tmp_path, capsys):
    spec = write_spec(
        tmp_path,
        "single",
        data_path=shards[2],
        seq_length=16,
        split="900,90,10",
        num_samples=500,
        path_to_cache=str(tmp_path / "cache"),
    )
    code, out, err = run(capsys, "inspect", spec, "--json")
    assert code == 0, err
    found = json.loads(out)
    assert found["valid"] and found["cache"] == str(tmp_path / "cache") and found["split"] == "900,90,10"
    for split in ("train", "valid", "test"):
        expected = describe(open_stream(spec, split)).as_dict()
        assert found["splits"][split]["built"] == {"GPTDataset": 1}  # the preview built; the reopen loaded
        assert {k: v for k, v in found["splits"][split].items() if k not in ("seconds", "built")} == {
            k: v for k, v in expected.items() if k not in ("seconds", "built")
        }
    train = found["splits"]["train"]
    (source,) = train["sources"]
    assert train["samples"] >= 500 and train["num_samples"] == 500 and source["epochs"] >= 2
    assert source["share"] == 1.0 and source["weight"] is None
    code, out, _ = run(capsys, "inspect", spec)
    assert code == 0
    assert out.startswith(f"{spec}: packing megatron, seq_length 16, seed 1234, split 900,90,10\n")
    assert f"  cache: {tmp_path / 'cache'}\n" in out and "  train: " in out and "  test: " in out
    assert f"index built for num_samples 500: {source['samples']:,} samples over {source['epochs']} epoch(s)" in out


def test_inspect_spec_reports_empty_and_broken_splits(shards, tmp_path, capsys):
    spec = write_spec(tmp_path, "tiny_test", data_path=shards[1], seq_length=16, split="98,2,0")
    code, out, _ = run(capsys, "inspect", spec)
    assert code == 0 and "  test: empty" in out
    # Under 50 sequences: a 1% test split rounds to no sequence at all.
    broken = write_spec(tmp_path, "broken", data_path=shards[1], seq_length=16, split="97,2,1")
    code, out, _ = run(capsys, "inspect", broken)
    assert code == 1 and "  test: CANNOT OPEN: " in out and "holds no sequences" in out and "  train: " in out
    preview = preview_spec(broken)
    assert not preview.valid and preview.as_dict()["splits"]["test"]["problem"]


def test_inspect_keeps_prefixes_and_mixes_them_with_specs(shards, tmp_path, capsys):
    spec = write_spec(tmp_path, "native", data_path=shards[:2], seq_length=16, packing="native", split="1")
    code, out, _ = run(capsys, "inspect", shards[0], spec)
    assert code == 0
    assert out.startswith(f"{shards[0]}\n") and "valid: yes" in out  # the shard report, unchanged
    assert (
        f"{spec}: packing native" in out
        and "(facts about shard versions only: packing native builds no index)" in out
        and "no weight (blended by size)" in out
    )
    code, out, err = run(capsys, "inspect", tmp_path / "missing.yaml")
    assert code == 2 and "no such spec file" in err
