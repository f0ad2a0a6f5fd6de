"""ds.explain(p): the pieces it names, read back from the shards, are exactly ds[p]["text"]."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import tracemalloc

import numpy
import pytest
import yaml
from conftest import write_printable_shards

from statefulset import (
    IndexedDataset,
    IndexedDatasetWriter,
    WorkerConfig,
    get_savable_loader,
    get_train_dataset,
    get_val_dataset,
)
from statefulset.errors import SequenceIndexError, StatefulsetError
from statefulset.shards.tokenizers import ByteTokenizer


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_printable_shards(tmp_path_factory.mktemp("provenance"))


def rebuilt(found) -> numpy.ndarray:
    """The sample as its pieces say: each run read from its shard, twice (by .bin offset and by sequence)."""
    parts = []
    for piece in found.pieces:
        shard = IndexedDataset(piece.prefix)
        run = piece.read(shard)
        numpy.testing.assert_array_equal(run, shard.get(piece.sequence, piece.offset, piece.tokens))
        first, last = shard.document_indices[piece.document], shard.document_indices[piece.document + 1]
        assert first <= piece.sequence < last
        assert piece.tokens > 0 and piece.offset + piece.tokens <= piece.sequence_tokens
        assert piece.sequence_tokens == shard.sequence_lengths[piece.sequence]
        parts.append(run)
    return numpy.concatenate(parts).astype(numpy.int64)


def check(ds, positions) -> list:
    found = []
    for p in positions:
        explained = ds.explain(p)
        numpy.testing.assert_array_equal(rebuilt(explained), ds[p]["text"])
        assert explained.position == p and explained.tokens == ds.stream.seq_length + 1
        assert explained.split == ds.split and all(pc.prefix == explained.source for pc in explained.pieces)
        found.append(explained)
    return found


def specs(shards):
    one, blend = shards[0], {shards[0]: 0.5, shards[1]: 0.2, shards[2]: 0.3}
    return {
        "megatron": {"data_path": one, "seq_length": 24, "split": "90,10,0"},
        "megatron_epochs": {"data_path": one, "seq_length": 24, "split": "90,10,0", "num_samples": 400},
        "megatron_blend": {"data_path": blend, "seq_length": 16, "split": "90,10,0", "num_samples": 300},
        "megatron_by_size": {"data_path": shards, "seq_length": 16, "split": "90,10,0"},
        "native": {"data_path": one, "seq_length": 24, "split": "90,10,0", "packing": "native"},
        "native_blend": {"data_path": blend, "seq_length": 16, "split": "90,10,0", "packing": "native"},
    }


@pytest.mark.parametrize("name", ["megatron", "megatron_epochs", "megatron_blend", "megatron_by_size"])
def test_megatron_pieces_rebuild_every_sample_and_the_wrap(shards, name):
    ds = get_train_dataset(specs(shards)[name], batch_size=2)
    n = len(ds.stream)
    found = check(ds, range(n))
    check(ds, [n, n + 7, 3 * n + 5])  # the repeating loader reads p % len(stream)
    wrapped = ds.explain(3 * n + 5)
    assert (wrapped.read_position, wrapped.wrap) == (5, 3)
    assert wrapped.pieces == found[5].pieces and wrapped.source == found[5].source
    assert ds.explain(5).wrap == 0 and ds.explain(5).read_position == 5
    if name == "megatron_epochs":  # num_samples beyond one epoch: the index holds several
        assert {f.epoch for f in found} == set(range(max(f.epoch for f in found) + 1)) and found[0].epoch >= 0
        assert max(f.epoch for f in found) >= 2
    if name == "megatron_blend":
        sources = [f.source_index for f in found]
        assert sources == ds.stream.blend["dataset_index"].tolist()
        assert [f.local_sample for f in found] == ds.stream.blend["dataset_sample_index"].tolist()
        assert {f.source for f in found} == set(shards)


@pytest.mark.parametrize("name", ["native", "native_blend"])
def test_native_pieces_rebuild_samples_in_any_epoch(shards, name):
    ds = get_train_dataset(specs(shards)[name], batch_size=2)
    rng = numpy.random.default_rng(0)
    positions = [*range(200), *rng.integers(0, 10**6, 100).tolist(), 10**12 + 3]
    found = check(ds, positions)
    for f in found:
        windows = ds.stream.sources[f.source_index].windows
        assert f.epoch == f.local_sample // windows and f.wrap == 0 and f.read_position == f.position
    assert max(f.epoch for f in found) > 10
    if name == "native_blend":
        which, local = ds.stream.schedule.locate(numpy.array(positions))
        assert [f.source_index for f in found] == which.tolist()
        assert [f.local_sample for f in found] == local.tolist()


@pytest.mark.parametrize("packing", ["megatron", "native"])
def test_valid_split_is_explained_and_bounded(shards, packing):
    spec = {**specs(shards)["megatron_blend" if packing == "megatron" else "native_blend"], "packing": packing}
    ds = get_val_dataset(spec, batch_size=1)
    found = check(ds, range(min(len(ds.stream), 120)))
    assert {f.split for f in found} == {"valid"}
    for f in found:  # every piece lies in the valid range of its shard (after 90% of the sequences)
        shard = IndexedDataset(f.source)
        assert all(pc.sequence >= round(0.9 * len(shard)) for pc in f.pieces)
    if packing == "megatron":
        with pytest.raises(SequenceIndexError, match="outside"):
            ds.explain(len(ds.stream))  # no repeat on the valid split: past the end is an error


def test_decoded_text_of_the_pieces(shards):
    ds = get_train_dataset(specs(shards)["native_blend"], batch_size=1)
    tok = ByteTokenizer()
    for p in (0, 1, 77, 5000):
        plain, decoded = ds.explain(p), ds.explain(p, tokenizer="bytes")
        assert all(pc.text is None for pc in plain.pieces)
        assert [pc.text for pc in decoded.pieces] == [
            tok.decode(pc.read(IndexedDataset(pc.prefix))) for pc in plain.pieces
        ]
        assert "".join(pc.text for pc in decoded.pieces) == tok.decode(ds[p]["text"])
        block = decoded.text()
        assert block.startswith(f"sample {p} (train, packing native, 17 tokens)")
        assert repr(decoded.pieces[0].text) in block and plain.source in block
    assert ds.explain(3, tokenizer=tok) == ds.explain(3, tokenizer="bytes")


def test_plain_data_and_errors(shards):
    ds = get_train_dataset(specs(shards)["megatron_blend"], batch_size=1)
    found = ds.explain(4).as_dict()
    keys = {"split", "packing", "seq_length", "position", "read_position", "wrap", "source", "source_index"}
    assert keys | {"local_sample", "epoch", "pieces"} == set(found)
    piece_keys = {"prefix", "sequence", "document", "offset", "tokens", "bin_offset", "sequence_tokens", "text"}
    assert set(found["pieces"][0]) == piece_keys
    with pytest.raises(SequenceIndexError):
        ds.explain(-1)
    with pytest.raises(TypeError):
        ds.explain(1.5)
    with pytest.raises(StatefulsetError, match="tokenizer"):
        ds.explain(1, tokenizer=3)
    with pytest.raises(StatefulsetError, match="no such tokenizer"):
        ds.explain(1, tokenizer="/nonexistent/tokenizer.json")


# -- statefulset explain ------------------------------------------------------------------------------
def run_cli(capsys, *args) -> tuple[int, str, str]:
    from statefulset.tools.cli import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def spec_files(shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("specs")
    files = {}
    for name, spec in specs(shards).items():
        files[name] = root / f"{name}.yaml"
        files[name].write_text(yaml.safe_dump({**spec, "path_to_cache": str(root / "cache")}))
    return files


def test_cli_positions_match_the_api(capsys, spec_files):
    ds = get_train_dataset(str(spec_files["megatron_blend"]), batch_size=1)
    code, out, _ = run_cli(capsys, "explain", spec_files["megatron_blend"], "--position", 0, 5, 10**4, "--json")
    assert code == 0
    assert json.loads(out) == [ds.explain(p).as_dict() for p in (0, 5, 10**4)]
    code, out, _ = run_cli(capsys, "explain", spec_files["megatron_blend"], "--position", 3, "--split", "valid")
    assert code == 0 and out.startswith("sample 3 (valid, packing megatron, 17 tokens)\n")


@pytest.mark.parametrize("name", ["native_blend", "megatron"])
def test_cli_step_is_what_the_loader_gave_that_rank(capsys, spec_files, name):
    """Step 2 with G=12, 2 DP ranks, micro-batches of 3: rank 1's loader batches 4 and 5."""
    wc = WorkerConfig(rank=1, world_size=2, num_workers=0)
    loader = get_savable_loader(get_train_dataset(str(spec_files[name]), batch_size=3, worker_config=wc))
    batches = list(itertools.islice(loader, 6))
    trained = [*batches[4]["sample_id"].tolist(), *batches[5]["sample_id"].tolist()]
    layout = ["--dp-size", 2, "--micro-batch-size", 3, "--global-batch-size", 12]
    code, out, _ = run_cli(capsys, "explain", spec_files[name], "--step", 2, *layout, "--rank", 1, "--json")
    assert code == 0
    found = json.loads(out)
    assert [f["position"] for f in found] == trained
    assert [(f["step"], f["micro_batch"], f["rank"], f["row"]) for f in found] == [
        (2, m, 1, j) for m in (0, 1) for j in range(3)
    ]
    texts = [*batches[4]["text"], *batches[5]["text"]]
    for f, text in zip(found, texts, strict=True):  # the pieces are exactly the rows that were trained on
        runs = [IndexedDataset(pc["prefix"]).read_range(pc["bin_offset"], pc["tokens"]) for pc in f["pieces"]]
        numpy.testing.assert_array_equal(numpy.concatenate(runs), text.numpy())
    code, out, _ = run_cli(capsys, "explain", spec_files[name], "--step", 2, *layout, "--rank", 1, "--row", 2)
    assert code == 0 and out.startswith(f"step 2, micro-batch 0, rank 1, row 2:\nsample {trained[2]} ")
    assert out.count("\nsample ") == 2 and f"row 2:\nsample {trained[5]} " in out  # one per micro-batch
    code, out, _ = run_cli(capsys, "explain", spec_files[name], "--step", 1, "--global-batch-size", 4, "--json")
    assert [f["position"] for f in json.loads(out)] == [4, 5, 6, 7] and json.loads(out)[0]["step"] == 1
    # Without gradient accumulation (G = W x B) a step is one micro-batch of each rank.
    code, out, _ = run_cli(
        capsys, "explain", spec_files[name], "--step", 4, "--dp-size", 2, "--micro-batch-size", 3, "--rank", 1, "--json"
    )
    assert [f["position"] for f in json.loads(out)] == batches[4]["sample_id"].tolist()


def test_cli_decodes_with_a_hugging_face_tokenizer(capsys, spec_files, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["a provenance test corpus"] * 3, trainers.BpeTrainer(vocab_size=300))
    tok.save(str(tmp_path / "tokenizer.json"))
    code, out, _ = run_cli(capsys, "explain", spec_files["native"], "--position", 9, "--tokenizer", tmp_path, "--json")
    assert code == 0
    (found,) = json.loads(out)
    for piece in found["pieces"]:
        run = IndexedDataset(piece["prefix"]).read_range(piece["bin_offset"], piece["tokens"])
        assert piece["text"] == tok.decode([int(t) for t in run])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--step", 0, "--rank", 0, "--global-batch-size", 4], "--rank needs --dp-size and --micro-batch-size"),
        (["--step", 0, "--dp-size", 2], "give --dp-size and --micro-batch-size together"),
        (["--step", 0], "--step needs --global-batch-size"),
        (["--step", 0, "--dp-size", 2, "--micro-batch-size", 2, "--global-batch-size", 6], "not a multiple"),
        (["--step", 0, "--dp-size", 2, "--micro-batch-size", 2, "--rank", 2], "--rank 2 is outside [0, --dp-size 2)"),
        (["--step", 0, "--dp-size", 2, "--micro-batch-size", 2, "--row", 1], "give --rank too"),
        (["--position", 1, "--rank", 0], "go with --step"),
        (["--position", -1], "position -1 is outside"),
        (["--position", 1, "--tokenizer", "/nowhere/tokenizer.json"], "no such tokenizer file"),
    ],
)
def test_cli_errors(capsys, spec_files, args, message):
    code, out, err = run_cli(capsys, "explain", spec_files["megatron"], *args)
    assert code == 2 and out == "" and message in err and "Traceback" not in err


def test_cli_explain_in_a_subprocess(spec_files):
    run = subprocess.run(
        [sys.executable, "-m", "statefulset", "explain", str(spec_files["native"]), "--position", "1"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("sample 1 (train, packing native, 25 tokens)")


def test_explain_and_the_open_log_hold_no_copy_of_the_index(tmp_path, caplog):
    """Two million sequences (a 40 MB .idx): explaining a sample and describing the split allocate
    kilobytes, so they read the mapped index, never a copy of it (the O(1) promise)."""
    from statefulset.streams.opening import open_stream
    from statefulset.streams.overview import describe

    count = 2_000_000
    prefix = str(tmp_path / "big")
    with IndexedDatasetWriter(prefix, numpy.uint16) as writer:
        writer.add_documents(numpy.arange(count * 3) % 250, numpy.full(count, 3), sequences_per_document=None)
    for spec in (
        {"data_path": prefix, "seq_length": 16, "packing": "native", "split": "1"},
        {"data_path": prefix, "seq_length": 16, "split": "1", "path_to_cache": str(tmp_path / "cache")},
    ):
        stream = open_stream(spec)
        stream.explain(0)  # first use: lazily built permutations, compiled kernels
        tracemalloc.start()
        found = [stream.explain(p) for p in (5, len(stream) - 1, len(stream) // 2)]
        overview = describe(stream)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 200_000, (spec.get("packing", "megatron"), peak)
        assert all(6 <= len(f.pieces) <= 7 for f in found)  # 17 tokens over sequences of 3
        assert overview.sources[0].tokens == 3 * count and overview.sources[0].documents == count
