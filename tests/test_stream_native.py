"""packing: native through open_stream: windows of the split's tokens, keyed per epoch, any position."""

from __future__ import annotations

import tracemalloc

import numpy
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from statefulset import IndexedDataset, IndexedDatasetWriter
from statefulset.spec.splits import parse_split, split_matrix, split_range
from statefulset.streams.opening import open_stream


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    rng = numpy.random.default_rng(5)
    prefixes = []
    for k, docs in enumerate((120, 40, 300)):
        prefix = str(root / f"p{k}")
        with IndexedDatasetWriter(prefix, numpy.uint16) as w:
            for _ in range(docs):
                w.add_document(rng.integers(0, 60000, int(rng.geometric(1 / 50))))
        prefixes.append(prefix)
    return prefixes


def split_tokens(prefix, split, name):
    ds = IndexedDataset(prefix)
    lo, hi = split_range(split_matrix(parse_split(split))[("train", "valid", "test").index(name)], len(ds))
    return numpy.concatenate([ds[i] for i in range(lo, hi)]).astype(numpy.int64)


@pytest.mark.parametrize("seq_length", [7, 64])
def test_each_epoch_is_every_window_once_in_a_new_order(shards, seq_length):
    spec = {"data_path": shards[0], "seq_length": seq_length, "packing": "native", "split": "90,10,0"}
    stream = open_stream(spec)
    tokens = split_tokens(shards[0], "90,10,0", "train")
    windows = (tokens.size - 1) // seq_length
    assert len(stream) == windows
    expected = numpy.stack([tokens[w * seq_length : (w + 1) * seq_length + 1] for w in range(windows)])
    orders = []
    for epoch in range(3):
        got = stream.gather(numpy.arange(epoch * windows, (epoch + 1) * windows))
        # Which window each row is: rows are unique token strings here (random 16-bit tokens).
        lookup = {row.tobytes(): w for w, row in enumerate(expected)}
        order = [lookup[row.tobytes()] for row in got]
        assert sorted(order) == list(range(windows))
        orders.append(order)
    assert orders[0] != orders[1] != orders[2]


def test_samples_are_pure_functions_of_spec_and_position(shards):
    spec = {"data_path": {shards[0]: 0.5, shards[1]: 0.2, shards[2]: 0.3}, "seq_length": 32, "packing": "native"}
    a, b = open_stream(spec), open_stream(spec)
    positions = numpy.array([0, 5, 10**9, 3, 10**12 + 7, 5])
    numpy.testing.assert_array_equal(a.gather(positions), b.gather(positions))
    for p, row in zip(positions, a.gather(positions), strict=True):
        item = a[int(p)]
        assert item["sample_id"] == p
        numpy.testing.assert_array_equal(item["text"], row)
        assert item["text"].dtype == numpy.int64 and item["text"].shape == (33,)
    other_seed = open_stream({**spec, "seed": 99})
    assert not numpy.array_equal(a.gather(numpy.arange(50)), other_seed.gather(numpy.arange(50)))
    assert a.fingerprint == b.fingerprint != other_seed.fingerprint


def test_blend_rows_come_from_their_source_in_share(shards):
    weights = {shards[0]: 0.6, shards[1]: 0.1, shards[2]: 0.3}
    stream = open_stream({"data_path": weights, "seq_length": 16, "packing": "native", "split": "1"})
    n = 3000
    which, local = stream.schedule.locate(numpy.arange(n))
    rows = stream.gather(numpy.arange(n))
    for d, (prefix, w) in enumerate(weights.items()):
        tokens = split_tokens(prefix, "1", "train")
        mine = rows[which == d]
        starts = stream.sources[d].window_starts(local[which == d]) - stream.sources[d].first_token
        for row, s in zip(mine[:50], starts[:50], strict=True):
            numpy.testing.assert_array_equal(row, tokens[s : s + 17])
        counts = numpy.cumsum(which == d)
        assert numpy.abs(counts - w * numpy.arange(1, n + 1)).max() <= 2  # ceil(log2 3) samples


def test_valid_split_reads_the_tail_and_never_the_train_tokens(shards):
    spec = {"data_path": shards[2], "seq_length": 16, "packing": "native", "split": "80,20,0"}
    train, valid = open_stream(spec, "train"), open_stream(spec, "valid")
    t = train.sources[0]
    v = valid.sources[0]
    assert t.first_token + t.num_tokens <= v.first_token


@settings(max_examples=25, deadline=None)
@given(positions=st.lists(st.integers(0, 2**50), min_size=1, max_size=40))
def test_gather_equals_items_at_any_positions(shards, positions):
    stream = open_stream({"data_path": [1, shards[0], 2, shards[1]], "seq_length": 24, "packing": "native"})
    rows = stream.gather(positions)
    for p, row in zip(positions, rows, strict=True):
        numpy.testing.assert_array_equal(stream[p]["text"], row)


def test_open_is_constant_memory_and_needs_no_cache(shards, tmp_path):
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(
        yaml.safe_dump({"data_path": {s: 1 for s in shards}, "seq_length": 2048 // 64, "packing": "native"})
    )
    tracemalloc.start()
    stream = open_stream(str(spec_path))
    stream.gather(numpy.arange(10**12, 10**12 + 64))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 5_000_000
    assert not list(tmp_path.glob("*cache*"))
