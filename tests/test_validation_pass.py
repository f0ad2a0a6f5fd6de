"""Validation and test splits of packing native and bestfit: one pass, every sample of every source once.

CONTRACT §4: whatever the training weights, a validation pass serves each source's validation
samples exactly once, sources interleaved by size, and no position exists past the pass. The
shards' tokens say which source and sequence they come from, so repeats and skips are checked on
the samples themselves.
"""

from __future__ import annotations

import numpy
import pytest

from statefulset import IndexedDatasetWriter, WorkerConfig, get_loader, get_val_dataset
from statefulset.errors import SequenceIndexError
from statefulset.index.native.one_pass import OnePassBlend
from statefulset.streams.opening import open_stream

SEQ = 16


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("valid")
    rng = numpy.random.default_rng(3)
    out = []
    for s, documents in enumerate((400, 90, 160)):
        prefix = str(root / f"s{s}")
        with IndexedDatasetWriter(prefix, numpy.int32) as w:
            for d in range(documents):
                w.add_document(s * 10**8 + d * 1000 + numpy.arange(int(rng.integers(4, 80))))
        out.append(prefix)
    return out


def _spec(shards, packing, weights=(0.05, 0.9, 0.05)):
    return {"seq_length": SEQ, "split": "80,20,0", "packing": packing, "seed": 4,
            "data_path": dict(zip(shards, weights, strict=True))}  # fmt: skip


@pytest.mark.parametrize("packing", ["native", "bestfit"])
@pytest.mark.parametrize("weights", [(0.05, 0.9, 0.05), (1.0, 1.0, 1.0), (0.6, 0.1, 0.3)])
def test_a_validation_pass_serves_every_sample_of_every_source_once(shards, packing, weights):
    """Fails before the one-pass blend: the training weights drew the valid split (repeats and skips)."""
    valid = open_stream(_spec(shards, packing, weights), "valid")
    every = valid.gather(numpy.arange(len(valid)))
    source = every[:, 0] // 10**8
    sizes = [s.windows for s in valid.sources]
    assert numpy.bincount(source, minlength=3).tolist() == sizes  # by size, whatever the weights
    which, local = valid.schedule.locate(numpy.arange(len(valid)))
    for s, size in enumerate(sizes):
        assert sorted(local[which == s].tolist()) == list(range(size))  # each window once
    first = [tuple(row) for row in every[:, :4].tolist()]
    if packing == "native":  # distinct windows: distinct first tokens
        assert len(set(first)) == len(first)
    with pytest.raises(SequenceIndexError, match="outside"):
        valid.gather(numpy.array([len(valid)]))


def test_the_interleave_is_even_by_size(shards):
    valid = open_stream(_spec(shards, "native"), "valid")
    which, _ = valid.schedule.locate(numpy.arange(len(valid)))
    sizes = numpy.array([s.windows for s in valid.sources], dtype=float)
    for n in range(1, len(valid), 7):  # every prefix within a couple of samples of its share
        drawn = numpy.bincount(which[:n], minlength=3)
        assert numpy.abs(drawn - n * sizes / sizes.sum()).max() <= 2


def test_the_val_loader_serves_whole_batches_of_one_pass(shards):
    ds = get_val_dataset(
        _spec(shards, "native"), batch_size=4, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=1)
    )
    ids = numpy.concatenate([b["sample_id"].numpy() for b in get_loader(ds)])
    assert ids.tolist() == list(range(len(ds.stream) // 4 * 4))


@pytest.mark.parametrize("sizes", [[5], [3, 0, 9], [1, 1, 1, 1, 1], [1000, 7, 333, 2]])
def test_one_pass_blend_is_exact(sizes):
    blend = OnePassBlend(sizes)
    which, local = blend.locate(numpy.arange(sum(sizes)))
    for s, size in enumerate(sizes):
        assert local[which == s].tolist() == list(range(size))
    assert blend.counts(sum(sizes)) == sizes
    assert blend.counts(10**9) == sizes
