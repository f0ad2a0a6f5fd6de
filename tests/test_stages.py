"""Data schedules (``stages:``): shares per stage, each source keeping its place, restores across schedule edits.

The shards' tokens say which source and sequence they come from, so "no repeat" is checked on the
samples themselves as well as on the local positions the schedule hands each source.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import numpy
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from statefulset import IndexedDatasetWriter, WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.errors import StatefulsetError
from statefulset.spec.model import load_spec
from statefulset.streams.opening import open_stream

SEQ = 16
NAMES = ("web", "code", "math", "books")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    rng = numpy.random.default_rng(8)
    out = {}
    for s, name in enumerate(NAMES):
        prefix = str(root / name)
        with IndexedDatasetWriter(prefix, numpy.int32) as w:
            for d in range(150 + 40 * s):
                w.add_document(s * 10**8 + d * 1000 + numpy.arange(int(rng.integers(4, 80))))
        out[name] = prefix
    return out


def staged(shards, stages, packing="native", **extra):
    return {
        "seq_length": SEQ, "split": "1", "packing": packing, "seed": 5,
        "stages": [{"start": start, "data_path": {shards[n]: w for n, w in mix.items()}} for start, mix in stages],
        **extra,
    }  # fmt: skip


ANNEAL = [(0, {"web": 0.9, "code": 0.1}), (300, {"web": 0.5, "code": 0.2, "math": 0.3}), (700, {"math": 1.0})]


@pytest.mark.parametrize(
    ("stages", "packing", "match"),
    [
        ([{"start": 3, "data_path": "W"}], "native", r"stages\[0\].start': the first stage must start at 0"),
        ([{"start": 0, "data_path": "W"}, {"start": 0, "data_path": "W"}], "native", r"stages\[1\].start': starts"),
        ([{"start": 0, "data_path": []}], "native", r"stages\[0\].data_path': the stage reads nothing"),
        ([{"start": 0, "data_path": {"W": 0}}], "native", r"stages\[0\].data_path': all weights are zero"),
        ([{"start": 0, "data_path": "W"}], "megatron", r"key 'stages': data schedules need packing native or bestfit"),
        ([{"start": 0, "data_path": "nope/x"}], "native", r"stages\[0\].data_path': shard .*nope/x.bin does not exist"),
        ([{"start": 0, "data_path": "W", "weight": 1}], "native", r"stages\[0\].weight': unknown key"),
        ([{"start": -1, "data_path": "W"}], "native", r"stages\[0\].start': must be a non-negative"),
    ],
)
def test_bad_schedules_name_the_stage_and_key(shards, stages, packing, match):
    for stage in stages:
        if stage["data_path"] == "W":
            stage["data_path"] = shards["web"]
        elif isinstance(stage["data_path"], dict) and "W" in stage["data_path"]:
            stage["data_path"] = {shards["web"]: stage["data_path"]["W"]}
    with pytest.raises(StatefulsetError, match=match):
        load_spec({"seq_length": SEQ, "packing": packing, "stages": stages})


def test_stages_replace_data_path(shards):
    stage = {"start": 0, "data_path": shards["web"]}
    with pytest.raises(StatefulsetError, match="key 'stages': give stages instead of data_path"):
        load_spec({"seq_length": SEQ, "packing": "native", "data_path": shards["web"], "stages": [stage]})


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 400), st.lists(st.integers(0, 20), min_size=4, max_size=4)), min_size=1, max_size=4
    )
)
def test_each_stage_keeps_its_shares_and_every_source_its_place(shards, plan):
    """Hypothesis over weights and stage lengths: shares within a stage are as tight as one blend's, and every
    source's local samples are 0, 1, 2, ... with no repeat or gap, across any number of stage changes."""
    stages, start = [], 0
    for length, weights in plan:
        if sum(weights) == 0:
            weights = [1, 0, 0, 0]
        stages.append((start, {n: w for n, w in zip(NAMES, weights, strict=True) if w}))
        start += length
    stream = open_stream(staged(shards, stages))
    end = start + 50
    which, local = stream.locate(numpy.arange(end))
    prefixes = stream.prefixes
    for s in range(len(prefixes)):
        drawn = numpy.sort(local[which == s])
        assert (drawn == numpy.arange(drawn.size)).all()  # its own order, continued: no repeat, no skip
    bound = math.ceil(math.log2(len(NAMES))) + 1
    for k, (first, mix) in enumerate(stages):
        last = stages[k + 1][0] if k + 1 < len(stages) else end
        total = sum(mix.values())
        for name, weight in mix.items():
            s = prefixes.index(shards[name])
            got = int((which[first:last] == s).sum())
            assert abs(got - weight / total * (last - first)) <= bound, (k, name, got)
    for p in (0, stages[-1][0], end - 1, end):
        counts = stream.source_positions(p)
        assert counts == {prefix: int((which[:p] == s).sum()) for s, prefix in enumerate(prefixes)}


@pytest.mark.parametrize("packing", ["native", "bestfit"])
def test_a_source_never_repeats_a_sample_within_its_epoch(shards, packing):
    spec = staged(shards, ANNEAL, packing)
    stream = open_stream(spec)
    text = stream.gather(numpy.arange(1400))
    first = text[:, 0]
    for s, name in enumerate(NAMES[:3]):
        rows = text[(first // 10**8 == s) & (first >= 0)]
        per_epoch = stream.sources[stream.prefixes.index(shards[name])].windows
        seen = [bytes(r) for r in rows[:per_epoch]]
        assert len(set(seen)) == len(seen), name  # within one epoch of the source, every sample once


def _loader(spec, rank=0, world=1, workers=0, batch=4):
    wc = WorkerConfig(rank=rank, world_size=world, num_workers=workers)
    return get_savable_loader(get_train_dataset(spec, batch_size=batch, worker_config=wc))


def _take(loader, n):
    return [(b["sample_id"].clone(), b["text"].clone()) for _, b in zip(range(n), loader, strict=False)]


@pytest.mark.parametrize("packing", ["native", "bestfit"])
def test_appending_a_stage_to_a_saved_run_continues_like_the_new_spec(shards, packing):
    """Two DP ranks save at position 240 under a two-stage schedule; a third (annealing) stage is appended and
    the run resumes on three DP ranks with workers: exactly the batches of the new spec from position 240."""
    old = staged(shards, ANNEAL[:2], packing)
    new = staged(shards, ANNEAL, packing)
    states = []
    for rank in range(2):
        loader = _loader(old, rank, 2)
        _take(loader, 30)
        states.append(loader.save_state_rank())
    for rank in range(3):
        resumed = _loader(new, rank, 3, workers=2)
        resumed.restore_state_global(states)
        got = _take(resumed, 40)  # crosses the appended stage's start (700)
        stream = open_stream(new)
        for t, (ids, text) in enumerate(got):
            expected = [240 + (t * 3 + rank) * 4 + j for j in range(4)]
            assert ids.tolist() == expected
            assert (text.numpy() == stream.gather(numpy.array(expected))).all()


def test_a_change_to_a_stage_that_began_is_refused_naming_it(shards):
    old = staged(shards, ANNEAL)
    loader = _loader(old)
    _take(loader, 100)  # position 400: stage 1 began at 300
    state = loader.save_state_rank()
    edits = {
        "stage 1 (start 300) reads other sources or weights": [
            ANNEAL[0],
            (300, {"web": 0.4, "code": 0.3, "math": 0.3}),
        ],
        "stage 1 starts at 250, the state's at 300": [ANNEAL[0], (250, ANNEAL[1][1])],
        "stage 1 starts at 350, the state's at 300": [ANNEAL[0], (350, {"books": 1.0})],
        "stage 2 (start 350) is new but begins before that position": [*ANNEAL[:2], (350, {"books": 1.0})],
        "stage 1 (start 300) is gone": [ANNEAL[0], (500, ANNEAL[1][1])],
    }
    for what, stages in edits.items():
        with pytest.raises(StatefulsetError, match=r"saved at position 400.*" + re.escape(what)):
            _loader(staged(shards, stages)).restore_state_rank(state)
    # Later stages may change freely; so may one that begins at the saved position itself.
    for stages in ([*ANNEAL[:2], (900, {"books": 1.0})], ANNEAL[:2], [*ANNEAL[:2], (400, {"books": 1.0})]):
        _loader(staged(shards, stages)).restore_state_rank(state)


def test_inspect_at_a_position_shows_the_stage_and_each_sources_standing(shards, tmp_path):
    spec = tmp_path / "anneal.yaml"
    spec.write_text(yaml.safe_dump(staged(shards, ANNEAL), sort_keys=False))  # mapping order is blend order
    run = subprocess.run([sys.executable, "-m", "statefulset", "inspect", str(spec), "--at", "500"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "stage 1 (from 300 until 700)" in run.stdout
    counts = open_stream(staged(shards, ANNEAL)).source_positions(500)
    for prefix, count in counts.items():
        if count:
            assert f"{count:,} samples" in run.stdout and prefix in run.stdout


def test_valid_split_blends_every_source_by_size(shards):
    spec = {**staged(shards, ANNEAL), "split": "90,10,0"}
    valid = open_stream(spec, "valid")
    assert len(valid.sources) == 3 and len(open_stream(spec).prefixes) == 3


def test_megatron_and_nanotron_take_a_staged_spec(shards):
    from statefulset import ParallelLayout
    from statefulset.integrations.megatron import build_megatron_iterators
    from statefulset.integrations.nanotron import build_nanotron_dataloader

    spec = staged(shards, ANNEAL)
    stream = open_stream(spec)
    data = build_megatron_iterators(spec, ParallelLayout(1), rank=0, micro_batch_size=4, num_workers=0,
                                    consumed_train_samples=696, valid=False, test=False)  # fmt: skip
    for t in range(3):  # across the start of the annealing stage (700)
        batch = data.get_batch()
        assert (batch.tokens.numpy() == stream.gather(numpy.arange(696 + 4 * t, 700 + 4 * t))[:, :-1]).all()
    # Nanotron: each data stage of a Nanotron config is a stage of one schedule; the run resumes from
    # its consumed_train_samples whatever stage it is in.
    loader = build_nanotron_dataloader(spec, ParallelLayout(1), micro_batch_size=4, consumed_train_samples=692)
    micro_batch = next(loader)
    assert (micro_batch["input_ids"].numpy() == stream.gather(numpy.arange(692, 696))[:, :-1]).all()


@pytest.mark.parametrize("packing", ["native", "bestfit"])
def test_source_counts_at_many_positions_equal_one_at_a_time(shards, packing):
    """``source_counts_many`` (the vectorised walk ``metrics()`` reads ahead with) equals ``source_counts``
    at every position, across stage changes, far out, and for a plain blend and one validation pass."""
    streams = [open_stream(staged(shards, ANNEAL, packing))]
    plain = {"seq_length": SEQ, "split": "90,10,0", "packing": packing, "seed": 5,
             "data_path": {shards["web"]: 0.6, shards["code"]: 0.3, shards["math"]: 0.1}}  # fmt: skip
    streams += [open_stream(plain), open_stream(plain, "valid"), open_stream({**plain, "data_path": [shards["web"]]})]
    rng = numpy.random.default_rng(3)
    for stream in streams:
        total = 10**15 if stream.unbounded else len(stream)
        positions = numpy.concatenate([
            numpy.arange(0, 1000, 7), [299, 300, 301, 699, 700, 701], rng.integers(0, total, 50),
        ]).astype(numpy.int64)  # fmt: skip
        positions = positions[positions <= total]
        counts, stages = stream.source_counts_many(positions)
        for p, row, stage in zip(positions.tolist(), counts.tolist(), stages.tolist(), strict=True):
            assert row == stream.source_counts(p), (stream, p)
            assert stage == (stream.stage_of(p) if hasattr(stream, "stage_of") else 0)


def test_a_stream_locates_the_same_positions_again_as_copies(shards):
    stream = open_stream(staged(shards, ANNEAL))
    positions = numpy.array([0, 299, 300, 701, 5, 10**9])
    which, local = stream.locate(positions)
    want = (which.copy(), local.copy())
    which[...], local[...] = -1, -1
    for got, expected in zip(stream.locate(positions), want, strict=True):
        assert numpy.array_equal(got, expected)
    assert numpy.array_equal(stream.locate(positions[:3])[0], want[0][:3])


@pytest.mark.parametrize("packing", ["native", "bestfit"])
def test_a_blended_stream_locates_the_same_positions_again_as_copies(shards, packing):
    """The memo of the last positions is the stream's (SampleStream.locate) for blends as for schedules."""
    spec = {"seq_length": SEQ, "split": "80,20,0", "packing": packing, "seed": 5,
            "data_path": {shards["web"]: 0.6, shards["code"]: 0.3, shards["math"]: 0.1}}  # fmt: skip
    stream = open_stream(spec, "valid")
    assert "stages" not in type(stream).__module__ and stream.schedule is not None
    positions = numpy.array([[3, 0, 7], [1, 2, 5]])
    which, local = stream.locate(positions)
    fresh = open_stream(spec, "valid").schedule.locate(positions)
    want = (which.copy(), local.copy())
    which[...], local[...] = -1, -1
    for got, expected, unlocated in zip(stream.locate(positions.copy()), want, fresh, strict=True):
        assert got.shape == positions.shape and numpy.array_equal(got, expected)
        assert numpy.array_equal(got, unlocated)
    assert stream.locate(positions.reshape(-1))[0].shape == (6,)  # the same bytes, another shape: located again
