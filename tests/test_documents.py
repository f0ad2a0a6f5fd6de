"""Document boundaries (cu_seqlens, max_seqlen, position_ids) for every packing.

Packing megatron is compared with megatron-core 0.19.2's ``GPTDataset(inter_document_masking=True)``
(and its BlendedDataset) at every position of whole streams; native and bestfit against a
brute-force reading of the tokens themselves (a corpus whose tokens say which document and
offset they are); the vectorised rule against a per-row transcription of megatron-core's loop.
"""

from __future__ import annotations

import itertools
import logging
import random

import numpy
import oracle
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from statefulset import IndexedDatasetWriter, WorkerConfig, get_savable_loader, get_train_dataset, get_val_dataset
from statefulset.errors import StatefulsetError
from statefulset.index import compiled
from statefulset.spec.splits import SPLITS
from statefulset.streams.documents import Pieces, document_fields, fields_from_wire, gather_fields, to_wire
from statefulset.streams.opening import open_stream

builder_module = oracle.module("megatron.core.datasets.blended_megatron_dataset_builder")
gpt_module = oracle.module("megatron.core.datasets.gpt_dataset")

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.usefixtures("single_process_group"),  # conftest: megatron-core's BlendedDataset needs it
]
STRIDE = 1000  # token = document * STRIDE + offset: a token says where it comes from


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three shards: empty sequences, multi-sequence documents, lengths from 1 to past a sample."""
    root = tmp_path_factory.mktemp("documents")
    rng = numpy.random.default_rng(3)
    prefixes = []
    for k, (mean, count) in enumerate([(12, 700), (40, 400), (150, 200)]):
        prefix = str(root / f"part_{k}")
        with IndexedDatasetWriter(prefix, numpy.int32) as w:
            sequence = 0
            for _ in range(count):
                lengths = [
                    min(STRIDE - 2, int(rng.geometric(1 / mean))) if rng.random() > 0.04 else 0
                    for _ in range(1 + (k == 1))
                ]
                tokens = [sequence + i for i in range(len(lengths))]
                w.add_document(
                    numpy.concatenate(
                        [t * STRIDE + numpy.arange(n) for t, n in zip(tokens, lengths, strict=True)] + [[]]
                    ).astype(numpy.int32),
                    lengths=lengths,
                )
                sequence += len(lengths)
        prefixes.append(prefix)
    return prefixes


def megatron_build(prefixes, weights, seed, seq_length, split, sizes):
    logging.disable(logging.WARNING)
    config = gpt_module.GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, tokenizer=oracle.null_tokenizer(50256), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, path_to_cache=None, create_attention_mask=False,
        blend=(prefixes, weights), split=split, inter_document_masking=True,
    )  # fmt: skip
    return builder_module.BlendedMegatronDatasetBuilder(gpt_module.GPTDataset, sizes, lambda: True, config).build()


def assert_fields_equal(ours: dict, theirs: list[dict]) -> None:
    expected_cu = numpy.stack([t["cu_seqlens"].numpy() for t in theirs])
    numpy.testing.assert_array_equal(ours["cu_seqlens"], expected_cu)
    numpy.testing.assert_array_equal(ours["max_seqlen"], numpy.array([int(t["max_seqlen"]) for t in theirs]))
    numpy.testing.assert_array_equal(ours["position_ids"], numpy.stack([t["position_ids"].numpy() for t in theirs]))
    assert ours["cu_seqlens"].dtype == numpy.int32 and ours["max_seqlen"].dtype == numpy.int32
    assert ours["position_ids"].dtype == numpy.int64


@pytest.mark.oracle
@pytest.mark.parametrize("case", range(10))
def test_megatron_packing_equals_megatron_core_inter_document_masking(corpus, case):
    r = random.Random(case)
    count = r.choice([1, 1, 2, 3])
    prefixes = r.sample(corpus, count)
    weights = [round(r.uniform(0.2, 2), 2) for _ in prefixes] if count > 1 and r.random() < 0.6 else None
    seq_length = r.choice([8, 33, 64, 200] if count == 1 else [8, 33, 64])
    seed = r.randint(0, 2**31 - 1)
    split = r.choice(["1", "90,8,2", "80,20,0"] if count == 1 else ["1", "85,15,0"])
    num_samples = r.choice([None, 3000]) if weights is None else 2000
    theirs = megatron_build(
        prefixes, weights, seed, seq_length, split, [num_samples, 1 if weights else None, 1 if weights else None]
    )
    data_path = [x for pair in zip(weights, prefixes, strict=True) for x in pair] if weights else list(prefixes)
    spec = {"data_path": data_path, "seq_length": seq_length, "split": split, "seed": seed, "num_samples": num_samples}
    for index, name in enumerate(SPLITS):
        if theirs[index] is None or (index and weights):
            continue
        get = get_train_dataset if name == "train" else get_val_dataset
        ds = get(spec, split_part=name, batch_size=1, document_boundaries=True)
        n = len(ds.stream)
        assert n == len(theirs[index])
        expected = [theirs[index][i] for i in range(n)]
        # The whole stream at once (the vectorised plan) and sample by sample (the small-batch plan).
        assert_fields_equal(gather_fields(ds.stream, numpy.arange(n), True), expected)
        for p in random.Random(case).sample(range(n), min(n, 25)):
            one = ds[p]
            assert_fields_equal({k: one[k][None] for k in ("cu_seqlens", "max_seqlen", "position_ids")}, [expected[p]])
            numpy.testing.assert_array_equal(one["text"][:-1], expected[p]["tokens"].numpy())


def brute_force_fields(text: numpy.ndarray, pad_id: int | None = None) -> dict:
    """Segments read off the tokens: a document continues where a token is its predecessor + 1."""
    rows = []
    for row in text:
        segments, length = [], 1
        for a, b in itertools.pairwise(row):
            same = (b == a + 1) if a != pad_id else (b == pad_id)
            if same:
                length += 1
            else:
                segments.append(length)
                length = 1
        segments.append(length)
        rows.append(_megatron_rule(segments, len(row) - 1))
    return {k: numpy.stack([r[k] for r in rows]) for k in rows[0]}


def _megatron_rule(document_lengths: list[int], seq_length: int) -> dict:
    """megatron-core 0.19's GPTDataset.__getitem__ (inter_document_masking), one sample, transcribed."""
    lengths = list(document_lengths)
    lengths[-1] -= 1
    if lengths[-1] == 0:
        lengths.pop()
    shortfall = seq_length - sum(lengths)
    if shortfall > 0:
        if lengths:
            lengths[-1] += shortfall
        else:
            lengths.append(shortfall)
    cu = numpy.cumsum([0, *lengths])
    position_ids = numpy.arange(seq_length, dtype=numpy.int64)
    for i in range(1, len(cu)):
        position_ids[cu[i - 1] : cu[i]] = numpy.arange(cu[i] - cu[i - 1])
    padded = numpy.full(seq_length + 1, seq_length, dtype=numpy.int32)
    padded[: len(cu)] = cu
    return {"cu_seqlens": padded, "max_seqlen": numpy.int32(numpy.diff(cu).max()), "position_ids": position_ids}


@pytest.mark.parametrize("packing", ["native", "bestfit"])
@pytest.mark.parametrize("seq_length", [7, 64, 300])
def test_native_and_bestfit_boundaries_are_where_the_documents_are(corpus, packing, seq_length):
    spec = {"data_path": {corpus[0]: 0.3, corpus[1]: 0.3, corpus[2]: 0.4}, "seq_length": seq_length}
    stream = open_stream({**spec, "packing": packing, "split": "1"})
    positions = numpy.arange(600)
    fields = gather_fields(stream, positions, True)
    expected = brute_force_fields(fields["text"], -1 if packing == "bestfit" else None)
    for name in ("cu_seqlens", "max_seqlen", "position_ids"):
        numpy.testing.assert_array_equal(fields[name], expected[name], err_msg=name)
    if packing == "native":  # the compiled window pieces equal the numpy ones
        for filler in stream._fillers:
            starts = filler.source.window_starts(numpy.arange(500))
            a, b = (
                filler._pieces(starts, seq_length + 1, native=True),
                filler._pieces(starts, seq_length + 1, native=False),
            )
            assert (a.counts == b.counts).all() and (a.lengths == b.lengths).all()


@st.composite
def piece_rows(draw):
    """A seq_length and rows of pieces: cut points of the real tokens, empty pieces mid-row, padding."""
    seq_length = draw(st.integers(2, 40))
    width = seq_length + 1
    rows = []
    for _ in range(draw(st.integers(1, 5))):
        pad = draw(st.integers(0, width - 1))
        real = width - pad
        cuts = sorted(draw(st.lists(st.integers(1, real - 1), max_size=8, unique=True))) if real > 1 else []
        pieces = numpy.diff([0, *cuts, real]).tolist()
        if pad == 0 and len(pieces) > 1:  # empty sequences (megatron keeps them) before the last piece
            for _ in range(draw(st.integers(0, 3))):
                pieces.insert(draw(st.integers(0, len(pieces) - 1)), 0)
        rows.append((pieces, pad))
    return seq_length, rows


@settings(max_examples=300, deadline=None)
@given(piece_rows())
def test_vectorised_rule_equals_megatron_core_per_row(case):
    seq_length, rows = case
    pieces = Pieces(
        numpy.array([len(p) for p, _ in rows]),
        numpy.array([n for p, _ in rows for n in p], dtype=numpy.int64),
        numpy.array([seq_length + 1 - pad for _, pad in rows]),
    )
    segments = [p + ([pad] if pad else []) for p, pad in rows]
    overflow = any(len(s) - (s[-1] == 1) > seq_length for s in segments)
    if overflow:
        for native in (True, False):
            with pytest.raises(StatefulsetError, match="more than cu_seqlens has room"):
                document_fields(pieces, seq_length, native=native)
        return
    expected = [_megatron_rule(s, seq_length) for s in segments]
    for native in (True, False):  # the compiled kernel and the numpy version
        got = document_fields(pieces, seq_length, native=native)
        for name in ("cu_seqlens", "max_seqlen", "position_ids"):
            numpy.testing.assert_array_equal(got[name], numpy.stack([e[name] for e in expected]), err_msg=name)


def test_the_kernel_writes_every_remainder_of_its_wide_stores():
    """sf_document_fields stores position_ids 4 values and cu_seqlens padding 8 values at a time, then the
    rest one by one: rows whose documents take every length remainder modulo 4 and whose padding of
    cu_seqlens takes every remainder modulo 8 (1 to 15 segments), with and without bestfit padding,
    give the numpy rule's values and the megatron-core rule's, written into arrays full of garbage."""
    seq_length = 127
    width = seq_length + 1
    rows = []
    for documents in range(1, 16):
        for first in range(1, 5):
            for pad in (0, 3):
                lengths = [first + (i % 4) for i in range(documents - 1)]
                rest = width - pad - sum(lengths)
                rows.append(([*lengths, rest], pad))
    pieces = Pieces(
        numpy.array([len(p) for p, _ in rows]),
        numpy.array([n for p, _ in rows for n in p], dtype=numpy.int64),
        numpy.array([width - pad for _, pad in rows]),
    )
    expected = [_megatron_rule(p + ([pad] if pad else []), seq_length) for p, pad in rows]
    b = len(rows)
    garbage = {
        "cu_seqlens": numpy.full((b, width), -5, dtype=numpy.int32),
        "max_seqlen": numpy.full(b, -5, dtype=numpy.int32),
        "position_ids": numpy.full((b, seq_length), -5, dtype=numpy.int64),
    }
    kernel = document_fields(pieces, seq_length, native=True, out=garbage)
    assert all(kernel[name] is garbage[name] for name in garbage)  # written in place, by the kernel
    numpy_rule = document_fields(pieces, seq_length, native=False)
    for name in ("cu_seqlens", "max_seqlen", "position_ids"):
        numpy.testing.assert_array_equal(kernel[name], numpy_rule[name], err_msg=name)
        numpy.testing.assert_array_equal(kernel[name], numpy.stack([e[name] for e in expected]), err_msg=name)


@settings(max_examples=200, deadline=None)
@given(piece_rows(), st.integers(1, 3))
def test_fields_from_the_wire_equal_the_fields(case, count):
    """What a worker sends (its pieces) gives the trainer the fields document_fields gives, kernel or numpy."""
    seq_length, rows = case
    pieces = Pieces(
        numpy.array([len(p) for p, _ in rows]),
        numpy.array([n for p, _ in rows for n in p], dtype=numpy.int64),
        numpy.array([seq_length + 1 - pad for _, pad in rows]),
    )
    b = len(rows)
    wire = numpy.full((count, b, seq_length + 3), -7, dtype=numpy.int64)  # garbage past the pieces
    try:
        expected = document_fields(pieces, seq_length, native=False)
    except StatefulsetError as exc:
        message = str(exc).split(": ", 1)[1]
        with pytest.raises(StatefulsetError, match=message.split(" (")[0]):
            to_wire(pieces, wire[0], seq_length)
            fields_from_wire(wire[:1], seq_length, _empty_out(1, b, seq_length), lambda i: numpy.arange(b))
        return
    for i in range(count):
        to_wire(pieces, wire[i], seq_length)
    for native in (True, False):
        out = _empty_out(count, b, seq_length)
        fields_from_wire(wire, seq_length, out, lambda i: numpy.arange(b), native=native)
        for name in ("cu_seqlens", "max_seqlen", "position_ids"):
            for i in range(count):
                numpy.testing.assert_array_equal(out[name][i], expected[name], err_msg=name)


def _empty_out(count, rows, seq_length):
    return {
        "cu_seqlens": numpy.full((count, rows, seq_length + 1), -1, dtype=numpy.int32),
        "max_seqlen": numpy.full((count, rows), -1, dtype=numpy.int32),
        "position_ids": numpy.full((count, rows, seq_length), -1, dtype=numpy.int64),
    }


def test_a_broken_row_from_the_wire_names_its_sample():
    """A row the kernel refuses in the trainer is reported as the numpy rule reports it, naming its position."""
    wire = numpy.zeros((2, 2, 6), dtype=numpy.int64)
    good = Pieces(numpy.array([1, 2]), numpy.array([4, 2, 2]), numpy.array([4, 4]))
    bad = Pieces(numpy.array([1, 2]), numpy.array([4, 4, 0]), numpy.array([4, 4]))  # an empty last piece
    to_wire(good, wire[0], 3)
    to_wire(bad, wire[1], 3)
    for native in (True, False):
        with pytest.raises(StatefulsetError, match="sample at position 71: its last document piece is empty"):
            fields_from_wire(wire, 3, _empty_out(2, 2, 3), lambda i: numpy.array([[50, 51], [70, 71]][i]), native)


@pytest.fixture(params=["kernels", "numpy"])
def kernels_or_numpy(request, monkeypatch):
    """Both ways of computing the fields, in the trainer and in its (forked) workers."""
    if request.param == "numpy":
        monkeypatch.setenv("STATEFULSET_KERNELS", "0")
    compiled._reset()
    yield request.param
    monkeypatch.undo()
    compiled._reset()


@pytest.mark.parametrize("packing", ["megatron", "native", "bestfit"])
def test_boundaries_through_workers_equal_in_process_and_after_restore(corpus, packing, kernels_or_numpy):
    """Batches from 2 workers (pieces on the wire, fields made in the trainer) equal ``ds[p]`` and the
    in-process loader's, field for field and dtype for dtype, and so do those of a restored loader."""
    spec = {
        "data_path": {corpus[0]: 0.5, corpus[2]: 0.5},
        "seq_length": 40,
        "packing": packing,
        "split": "1",
        "num_samples": 400,
    }

    def loader(workers):
        wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
        ds = get_train_dataset(spec, batch_size=5, worker_config=wc, document_boundaries=True)
        return ds, get_savable_loader(ds)

    assert compiled.available() == (kernels_or_numpy == "kernels")
    ds, local = loader(0)
    expected = [batch for _, batch in zip(range(9), local, strict=False)]
    _, first = loader(2)
    got = [batch for _, batch in zip(range(4), first, strict=False)]
    _, restored = loader(2)
    restored.load_state_dict(first.state_dict())
    got += [batch for _, batch in zip(range(5), restored, strict=False)]
    for ours, theirs in zip(got, expected, strict=True):
        assert list(ours) == list(theirs)
        for name, value in theirs.items():
            assert ours[name].dtype == value.dtype and ours[name].shape == value.shape, name
            numpy.testing.assert_array_equal(ours[name].numpy(), value.numpy(), err_msg=name)
        for j, p in enumerate(ours["sample_id"].tolist()):
            for name, value in ds[p].items():
                numpy.testing.assert_array_equal(ours[name][j].numpy(), value, err_msg=name)


def test_boundaries_of_remote_shards_through_workers_reading_ahead(corpus, tmp_path, monkeypatch):
    """Remote shards are built on read-ahead threads, outside the ring slot: the pieces travel all the same."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from s3_servers import moto_server, upload

    with moto_server() as server:
        upload(server, "docs", {f"c/part_1{ext}": corpus[1] + ext for ext in (".bin", ".idx")})
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        for packing in ("megatron", "native", "bestfit"):
            common = {"seq_length": 50, "packing": packing, "split": "1", "path_to_cache": str(tmp_path / "cache")}
            local = get_train_dataset({**common, "data_path": corpus[1]}, batch_size=3, document_boundaries=True)
            remote_spec = {**common, "data_path": "s3://docs/c/part_1", "storage_options": server.options()}
            wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
            ds = get_train_dataset(remote_spec, batch_size=3, worker_config=wc, document_boundaries=True)
            assert ds.stream.remote
            for _, batch in zip(range(6), get_savable_loader(ds), strict=False):
                for j, p in enumerate(batch["sample_id"].tolist()):
                    for name, value in local[p].items():
                        numpy.testing.assert_array_equal(batch[name][j].numpy(), value, err_msg=f"{packing} {name}")


@pytest.mark.parametrize("packing", ["megatron", "native", "bestfit"])
@pytest.mark.parametrize("workers", [0, 2])
def test_boundaries_travel_with_batches_from_workers(corpus, packing, workers):
    spec = {"data_path": corpus[1], "seq_length": 50, "packing": packing, "split": "1"}
    wc = WorkerConfig(rank=1, world_size=2, num_workers=workers)
    ds = get_train_dataset(spec, batch_size=3, worker_config=wc, document_boundaries=True)
    loader = get_savable_loader(ds)
    names = {"text", "sample_id", "cu_seqlens", "max_seqlen", "position_ids"} | (
        {"loss_mask"} if packing == "bestfit" else set()
    )
    dtypes = {"cu_seqlens": torch.int32, "max_seqlen": torch.int32, "position_ids": torch.int64,
              "loss_mask": torch.float32, "text": torch.int64}  # fmt: skip
    for _, batch in zip(range(12), loader, strict=False):
        assert set(batch) == names
        for j, p in enumerate(batch["sample_id"].tolist()):
            sample = ds[p]
            for name in names - {"sample_id"}:
                assert batch[name].dtype == dtypes[name]
                numpy.testing.assert_array_equal(batch[name][j].numpy(), sample[name], err_msg=name)


def test_without_boundaries_batches_carry_no_extra_fields(corpus):
    ds = get_train_dataset({"data_path": corpus[0], "seq_length": 16, "split": "1"}, batch_size=2)
    assert set(next(iter(get_savable_loader(ds)))) == {"text", "sample_id"}
    assert set(ds[0]) == {"text", "sample_id"}
    with pytest.raises(StatefulsetError, match="document_boundaries must be True or False"):
        get_train_dataset({"data_path": corpus[0], "seq_length": 16}, batch_size=2, document_boundaries="yes")
