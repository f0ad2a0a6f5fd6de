"""The fused gather of tokens and loss masks (:mod:`statefulset.streams.label_masks`, issue 28).

One compiled pass copies a batch's token ranges and the same ranges of the loss-mask shard; the
numpy version (``STATEFULSET_KERNELS=0``, remote shards) must give the same arrays, bit for bit:
for random ranges over real shards of every token dtype, rows with and without padding, sources
with and without a mask shard; and end to end for every packing, with document boundaries,
through worker processes, after a restore. Masks hold values other than 0 and 1 here: any
nonzero byte is a label with loss.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_loss_masks import PACKINGS, expected_mask, random_segments, spec_for, write_masked, write_plain

from statefulset import IndexedDatasetWriter, StatefulsetError, WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.index import compiled
from statefulset.shards.loss_masks import open_mask
from statefulset.shards.reader import IndexedDataset
from statefulset.streams.label_masks import gather_ranges

TOKEN_DTYPES = [numpy.uint8, numpy.int8, numpy.int16, numpy.uint16, numpy.int32, numpy.int64]
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def shard(folder, dtype, masked: bool, seed: int) -> IndexedDataset:
    """A token shard of ``dtype`` (values over its whole range) and, when ``masked``, its mask shard
    (values 0..3), opened as the loader opens them."""
    rng = numpy.random.default_rng(seed)
    lengths = rng.integers(1, 300, size=40)
    info = numpy.iinfo(dtype)
    tokens = rng.integers(info.min, info.max, size=int(lengths.sum()), endpoint=True, dtype=dtype)
    prefix = str(folder / f"tokens_{numpy.dtype(dtype).name}_{int(masked)}")
    with IndexedDatasetWriter(prefix, dtype) as w:
        w.add_documents(tokens, lengths)
    if masked:
        with IndexedDatasetWriter(prefix + "_loss_mask", numpy.uint8) as m:
            m.add_documents(rng.integers(0, 4, size=tokens.size, dtype=numpy.uint8), lengths)
    dataset = IndexedDataset(prefix)
    dataset.loss_mask = open_mask(dataset)
    return dataset


def plan(rng, total: int, rows: int, width: int, padded: bool) -> tuple[list[int], list[int], list[int] | None]:
    """Random ranges filling each row's used tokens in random pieces (some empty)."""
    used = [int(rng.integers(1, width + 1)) if padded else width for _ in range(rows)]
    starts, lengths = [], []
    for u in used:
        cuts = numpy.sort(rng.integers(0, u + 1, size=int(rng.integers(0, 4))))
        for n in numpy.diff(numpy.concatenate([[0], cuts, [u]])).tolist():
            starts.append(int(rng.integers(0, total - n + 1)))
            lengths.append(n)
    return starts, lengths, used if padded else None


def reference(dataset, starts, lengths, rows, width, used, pad_id, out_dtype):
    """Token by token from ``read_range``: what every row must hold."""
    tokens = numpy.full((rows, width), pad_id, dtype=out_dtype)
    labels = numpy.zeros((rows, width - 1), dtype=numpy.float32)
    flat_tokens = numpy.concatenate([dataset.read_range(s, n) for s, n in zip(starts, lengths, strict=True)])
    mask = dataset.loss_mask
    flat_masks = (
        numpy.concatenate([mask.read_range(s, n) for s, n in zip(starts, lengths, strict=True)])
        if mask is not None
        else numpy.ones(flat_tokens.size, numpy.uint8)
    )
    at = 0
    for r, u in enumerate(used or [width] * rows):
        tokens[r, :u] = flat_tokens[at : at + u]
        labels[r, : u - 1] = flat_masks[at + 1 : at + u] != 0
        at += u
    return tokens, labels


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fused")
    return {(d, m): shard(folder, d, m, seed=i) for i, d in enumerate(TOKEN_DTYPES) for m in (True, False)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(TOKEN_DTYPES),
    masked=st.booleans(),
    padded=st.booleans(),
    widen=st.booleans(),
    arrays=st.booleans(),
)
def test_the_compiled_pass_equals_numpy_and_the_tokens_own_masks(shards, seed, dtype, masked, padded, widen, arrays):
    assert compiled.available(), compiled.reason()  # the compiled pass is what is checked here
    dataset = shards[(dtype, masked)]
    rng = numpy.random.default_rng(seed)
    rows, width = int(rng.integers(1, 6)), int(rng.integers(2, 70))
    starts, lengths, used = plan(rng, dataset.num_tokens, rows, width, padded)
    out_dtype = numpy.dtype(numpy.int64 if widen else dtype)
    pad_id = -1 if widen else int(numpy.iinfo(out_dtype).max)
    want = reference(dataset, starts, lengths, rows, width, used, pad_id, out_dtype)
    if arrays:  # the packings plan on Python ints or on int64 arrays
        starts, lengths = numpy.array(starts, dtype=numpy.int64), numpy.array(lengths, dtype=numpy.int64)
    for native in (True, False):
        out = numpy.full((rows, width), 7, dtype=out_dtype)
        labels = numpy.full((rows, width - 1), 7, dtype=numpy.float32)
        gather_ranges(dataset, starts, lengths, out, labels, used, pad_id, native=native)
        numpy.testing.assert_array_equal(out, want[0], err_msg=f"tokens, native={native}")
        numpy.testing.assert_array_equal(labels, want[1], err_msg=f"labels, native={native}")


def test_threads_gathering_at_once_each_get_their_own_rows(shards):
    """The kernel's arguments are written into a block of each thread's own (compiled.scratch) and the
    kernel runs without the GIL: threads gathering at once, with plans of different sizes (so the
    blocks grow), must each get exactly their own ranges' tokens and masks."""
    assert compiled.available(), compiled.reason()
    dataset = shards[(numpy.uint16, True)]
    barrier = threading.Barrier(4)

    def work(seed: int) -> list[str]:
        rng, wrong = numpy.random.default_rng(seed), []
        barrier.wait(timeout=60)
        for step in range(150):
            rows, width = int(rng.integers(1, 9)), int(rng.integers(2, 300))
            starts, lengths, used = plan(rng, dataset.num_tokens, rows, width, bool(step % 2))
            want = reference(dataset, starts, lengths, rows, width, used, 0, numpy.int64)
            out, labels = numpy.empty((rows, width), numpy.int64), numpy.empty((rows, width - 1), numpy.float32)
            gather_ranges(dataset, numpy.array(starts), numpy.array(lengths), out, labels, used, native=True)
            if not (numpy.array_equal(out, want[0]) and numpy.array_equal(labels, want[1])):
                wrong.append(f"thread {seed}, step {step}")
        return wrong

    with ThreadPoolExecutor(4) as pool:
        found = [w for f in [pool.submit(work, seed) for seed in range(4)] for w in f.result(timeout=600)]
    assert not found, found


def test_ranges_and_lengths_that_do_not_pair_are_refused_naming_the_bin(shards):
    dataset = shards[(numpy.uint16, True)]
    out, labels = numpy.empty((1, 5), numpy.int64), numpy.empty((1, 4), numpy.float32)
    for native in (True, False):
        with pytest.raises(StatefulsetError, match=r"tokens_uint16_1: 2 range starts but 1 lengths"):
            gather_ranges(dataset, [0, 10], [5], out, labels, native=native)


def test_a_range_past_the_end_is_refused_naming_the_bin(shards):
    dataset = shards[(numpy.uint16, True)]
    out, labels = numpy.empty((1, 5), numpy.int64), numpy.empty((1, 4), numpy.float32)
    for native in (True, False):
        with pytest.raises(StatefulsetError, match=r"tokens_uint16_1\.bin"):
            gather_ranges(dataset, [dataset.num_tokens - 2], [5], out, labels, native=native)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused_loader")
    masks = write_masked(str(root / "chat"), random_segments(numpy.random.default_rng(11), 300))
    rng = numpy.random.default_rng(12)
    write_plain(str(root / "web"), [int(rng.geometric(1 / 20)) for _ in range(200)])
    return root, masks


@pytest.fixture
def kernels_off(monkeypatch):
    """Turns the compiled kernels off (as ``STATEFULSET_KERNELS=0`` does) until the test ends."""

    def turn_off():
        monkeypatch.setenv("STATEFULSET_KERNELS", "0")
        compiled._reset()
        assert not compiled.available()

    yield turn_off
    monkeypatch.undo()
    compiled._reset()


@pytest.mark.parametrize("packing", PACKINGS)
def test_batches_through_workers_after_a_restore_equal_the_numpy_path(mixed, kernels_off, packing):
    root, masks = mixed
    spec = spec_for(root, packing, {str(root / "chat"): 0.6, str(root / "web"): 0.4})

    def batches(workers: int) -> list[dict]:
        wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
        first = get_savable_loader(get_train_dataset(spec, batch_size=3, worker_config=wc, document_boundaries=True))
        it = iter(first)
        for _ in range(2):
            next(it)
        state = first.save_state_rank()
        again = get_savable_loader(get_train_dataset(spec, batch_size=3, worker_config=wc, document_boundaries=True))
        again.restore_state_rank(state)
        return [{k: numpy.asarray(v) for k, v in b.items()} for _, b in zip(range(5), again, strict=False)]

    assert compiled.available(), compiled.reason()
    fused = batches(2)
    kernels_off()
    for want, got in zip(batches(0), fused, strict=True):
        assert set(want) == set(got) >= {"text", "loss_mask", "cu_seqlens", "max_seqlen", "position_ids"}
        for name in want:
            numpy.testing.assert_array_equal(got[name], want[name], err_msg=name)
        for row in range(got["text"].shape[0]):
            numpy.testing.assert_array_equal(got["loss_mask"][row], expected_mask(got["text"][row], masks))
