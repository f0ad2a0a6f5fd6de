"""A plain ``data_path`` is the one-stage schedule (CONTRACT §12), and refusals say in words what differs.

A run started without ``stages:`` must be annealable later: the same stream as
``stages: [{start: 0, data_path: <the same>}]``, and its states restore into a schedule that begins
with that stage. A state that does not fit names the stage, the source and both values.
"""

from __future__ import annotations

import logging

import numpy
import pytest

from statefulset import IndexedDatasetWriter, WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.errors import StatefulsetError
from statefulset.streams.opening import open_stream

SEQ = 16


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    rng = numpy.random.default_rng(11)
    out = {}
    for s, name in enumerate(("web", "code", "math")):
        prefix = str(root / name)
        with IndexedDatasetWriter(prefix, numpy.int32) as w:
            for d in range(120 + 50 * s):
                w.add_document(s * 10**8 + d * 1000 + numpy.arange(int(rng.integers(4, 70))))
        out[name] = prefix
    return out


def _plain(shards, data_path, packing="native"):
    return {"seq_length": SEQ, "split": "1", "packing": packing, "seed": 9, "data_path": data_path}


def _staged(shards, stages, packing="native"):
    return {"seq_length": SEQ, "split": "1", "packing": packing, "seed": 9,
            "stages": [{"start": start, "data_path": dp} for start, dp in stages]}  # fmt: skip


def _loader(spec, workers=0):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    return get_savable_loader(get_train_dataset(spec, batch_size=4, worker_config=wc))


def _take(loader, n):
    return [(b["sample_id"].clone(), b["text"].clone()) for _, b in zip(range(n), loader, strict=False)]


def _data_paths(shards):
    return {
        "one prefix": shards["web"],
        "weights": {shards["web"]: 0.7, shards["code"]: 0.3},
        "by size": [shards["web"], shards["code"], shards["math"]],
    }


@pytest.mark.parametrize("packing", ["native", "bestfit"])
@pytest.mark.parametrize("form", ["one prefix", "weights", "by size"])
def test_a_plain_data_path_is_the_one_stage_schedule(shards, packing, form):
    """Fails on main: a plain spec and its one-stage schedule gave different streams."""
    data_path = _data_paths(shards)[form]
    plain = open_stream(_plain(shards, data_path, packing))
    staged = open_stream(_staged(shards, [(0, data_path)], packing))
    positions = numpy.arange(0, 2000, 3)
    assert (plain.gather(positions) == staged.gather(positions)).all()
    assert plain.identity == staged.identity and plain.fingerprint == staged.fingerprint


@pytest.mark.parametrize("packing", ["native", "bestfit"])
def test_a_plain_run_is_annealed_by_appending_a_stage(shards, packing):
    data_path = _data_paths(shards)["weights"]
    loader = _loader(_plain(shards, data_path, packing))
    _take(loader, 25)  # position 100
    state = loader.save_state_rank()
    anneal = _staged(shards, [(0, data_path), (140, {shards["math"]: 0.5, shards["web"]: 0.5})], packing)
    resumed = _loader(anneal, workers=2)
    resumed.restore_state_rank(state)
    stream = open_stream(anneal)
    for t, (ids, text) in enumerate(_take(resumed, 20)):  # crosses the new stage at 140
        expected = list(range(100 + 4 * t, 104 + 4 * t))
        assert ids.tolist() == expected
        assert (text.numpy() == stream.gather(numpy.array(expected))).all()


def test_a_changed_weight_in_a_begun_stage_is_named_with_both_values(shards):
    loader = _loader(_plain(shards, {shards["web"]: 0.7, shards["code"]: 0.3}))
    _take(loader, 5)
    state = loader.save_state_rank()
    other = _loader(_staged(shards, [(0, {shards["web"]: 0.5, shards["code"]: 0.5})]))
    with pytest.raises(StatefulsetError) as caught:
        other.restore_state_rank(state)
    message = str(caught.value)
    assert "stage 0 (start 0) reads other sources or weights" in message
    assert f"{shards['web']} has weight 0.5 in this spec, 0.7 in the state" in message
    assert f"{shards['code']} has weight 0.5 in this spec, 0.3 in the state" in message


def test_megatron_refusals_name_the_source_that_differs(shards):
    """packing megatron keeps its 'data' digest; the refusal now says which source and what."""
    spec = {**_plain(shards, {shards["web"]: 0.7, shards["code"]: 0.3}, "megatron"), "num_samples": 400}
    loader = _loader(spec)
    _take(loader, 2)
    state = loader.save_state_rank()
    cases = {
        f"{shards['web']} has weight 0.6 in this spec, 0.7 in the state": {shards["web"]: 0.6, shards["code"]: 0.3},
        f"{shards['math']} is read by this spec, not by the state": {
            shards["web"]: 0.7, shards["code"]: 0.3, shards["math"]: 0.1},
        "was read by the state, not by this spec": {shards["web"]: 0.7},
    }  # fmt: skip
    for words, data_path in cases.items():
        with pytest.raises(StatefulsetError, match="data: .*" + words.replace(".", r"\.")):
            _loader({**spec, "data_path": data_path}).restore_state_rank(state)


def test_restoring_no_state_warns_with_the_rank(shards, caplog):
    loader = _loader(_plain(shards, shards["web"]))
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        loader.restore_state_rank(None)
    assert any("restore_state_rank(None) on DP rank 0" in r.getMessage() for r in caplog.records)
    assert next(iter(loader))["sample_id"].tolist() == [0, 1, 2, 3]


def test_bestfit_warns_when_samples_are_mostly_padding(shards, caplog):
    """A split of ~4,500 tokens in samples of 4,097: most of the last bin is pad_id (silent on main)."""
    spec = {**_plain(shards, shards["web"], "bestfit"), "seq_length": 4096}
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        stream = open_stream(spec)
    every = stream.gather(numpy.arange(stream.samples_per_epoch))
    padding = float((every == stream.pad_id).mean())
    assert padding > 0.25
    warned = [r.getMessage() for r in caplog.records if "% padding" in r.getMessage()]
    assert len(warned) == 1 and shards["web"] in warned[0]
    assert f"is {100 * padding:.1f}% padding" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        open_stream(_plain(shards, shards["web"], "bestfit"))  # seq_length 16: little padding, no word
    assert not [r for r in caplog.records if "% padding" in r.getMessage()]


def test_a_state_of_a_long_schedule_still_fits_the_exchange_slot(shards):
    """Members are descriptive: a 100-stage schedule drops them rather than outgrow the 4 KiB slot."""
    from statefulset.loading.state import encode
    from statefulset.parallel.exchange import PAYLOAD

    names = list(shards.values())
    stages = [(k * 10, {names[k % 3]: 0.5, names[(k + 1) % 3]: 0.25 + k / 1000}) for k in range(100)]
    loader = _loader(_staged(shards, stages))
    _take(loader, 1)
    state = loader.save_state_rank()
    assert "stage_members" not in state["identity"]
    assert len(encode(state)) <= PAYLOAD
    small = _loader(_staged(shards, stages[:2]))
    _take(small, 1)
    assert "stage_members" in small.save_state_rank()["identity"]


@pytest.mark.parametrize("packing", ["native", "bestfit"])
def test_a_plain_data_path_with_a_zero_weight_opens(shards, packing):
    """Failed on main (KeyError naming the prefix): a weight-0 source is not opened, but the one stage
    of a plain ``data_path`` still looked it up. Found by benchmarks/bench_schedules.py's flat row."""
    with_zero = {shards["web"]: 0.7, shards["code"]: 0.3, shards["math"]: 0}
    without = {shards["web"]: 0.7, shards["code"]: 0.3}
    plain = open_stream(_plain(shards, with_zero, packing))
    positions = numpy.arange(0, 2000, 3)
    assert (plain.gather(positions) == open_stream(_plain(shards, without, packing)).gather(positions)).all()
    assert (plain.gather(positions) == open_stream(_staged(shards, [(0, with_zero)], packing)).gather(positions)).all()
