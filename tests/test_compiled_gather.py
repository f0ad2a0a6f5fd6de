"""Batch assembly in one compiled call (:mod:`statefulset.streams.compiled_gather`, issue 26).

``stream.gather`` plans and copies a batch in one kernel call; the rows, their pieces (document
boundaries) and their ``loss_mask`` must be the Python version's, bit for bit: over random
positions of both packings, single sources and blends of several prefixes, positions in many
epochs, documents shorter than a sample (many pieces per row) and empty sequences, every token
dtype of ``out``; and with ``STATEFULSET_KERNELS=0`` nothing changes. The document fields written
in the same call (``document_boundaries``) are the Python version's too, and rows they refuse raise
its error.
"""

from __future__ import annotations

import numpy
import pytest

from statefulset import IndexedDatasetWriter
from statefulset.errors import SequenceIndexError, StatefulsetError
from statefulset.index import compiled
from statefulset.streams.compiled_gather import REFUSED
from statefulset.streams.documents import FieldTargets, document_fields, gather_fields
from statefulset.streams.opening import open_stream

SEQ = 64


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Three uint16 shards (one with a loss-mask shard), documents of 0 to ~200 tokens; a fourth of
    documents of 0 to 2 tokens (rows of more pieces than a batch block holds at first)."""
    root = tmp_path_factory.mktemp("compiled_gather")
    prefixes = []
    for i in range(4):
        rng = numpy.random.default_rng(10 + i)
        lengths = rng.geometric(1 / (20 + 30 * i), size=300 + 100 * i) - 1  # some empty
        if i == 3:
            lengths = rng.integers(0, 3, size=3000)
        tokens = rng.integers(0, 60000, size=int(lengths.sum()), dtype=numpy.uint16)
        prefix = str(root / f"shard{i}")
        with IndexedDatasetWriter(prefix, numpy.uint16) as w:
            at = 0
            for n in lengths.tolist():
                w.add_document(tokens[at : at + n])
                at += n
        if i == 1:
            with IndexedDatasetWriter(prefix + "_loss_mask", numpy.uint8) as m:
                at = 0
                for n in lengths.tolist():
                    m.add_document(rng.integers(0, 3, size=n, dtype=numpy.uint8))
                    at += n
        prefixes.append(prefix)
    return root, prefixes


def specs(root, prefixes):
    blend = [0.5, prefixes[0], 0.3, prefixes[1], 0.2, prefixes[2]]
    cache = str(root / "cache")
    yield "megatron one", {"data_path": prefixes[0], "seq_length": SEQ, "split": "1", "seed": 5,
                           "num_samples": 3000, "path_to_cache": cache}  # fmt: skip
    yield "megatron blend", {"data_path": blend, "seq_length": SEQ, "split": "1", "seed": 6, "num_samples": 3000,
                             "path_to_cache": cache}  # fmt: skip
    yield "megatron masked", {"data_path": prefixes[1], "seq_length": SEQ, "split": "1", "seed": 7,
                              "num_samples": 2000, "path_to_cache": cache}  # fmt: skip
    yield "native one", {"data_path": prefixes[0], "seq_length": SEQ, "split": "1", "seed": 5, "packing": "native"}
    yield "native blend", {"data_path": blend, "seq_length": SEQ, "split": "1", "seed": 6, "packing": "native"}
    yield "megatron tiny", {"data_path": prefixes[3], "seq_length": SEQ, "split": "1", "seed": 8,
                            "num_samples": 500, "path_to_cache": cache}  # fmt: skip
    yield "native tiny", {"data_path": prefixes[3], "seq_length": SEQ, "split": "1", "seed": 8, "packing": "native"}
    stages = [{"start": 0, "data_path": {prefixes[0]: 0.7, prefixes[2]: 0.3}},
              {"start": 500, "data_path": {prefixes[0]: 0.2, prefixes[1]: 0.5, prefixes[2]: 0.3}},
              {"start": 2000, "data_path": {prefixes[1]: 1.0}}]  # fmt: skip
    yield "native stages", {"stages": stages, "seq_length": SEQ, "split": "1", "seed": 9, "packing": "native"}
    yield "native masked", {"data_path": prefixes[1], "seq_length": SEQ, "split": "1", "seed": 7, "packing": "native"}


def positions(stream, rng, rows):
    high = len(stream) if not stream.unbounded else 50 * len(stream)  # native: 50 epochs of windows
    if rng.random() < 0.3:  # a batch across a schedule's stage boundaries or near the start
        return rng.integers(0, min(2500, high), size=rows)
    return rng.integers(0, high, size=rows)


def batches(stream, p, dtype=numpy.int64):
    """gather, gather_pieces and gather_masked of ``p``, as arrays."""
    out = [stream.gather(p, numpy.empty((p.size, SEQ + 1), dtype=dtype))]
    text, pieces = stream.gather_pieces(p)
    out += [text, pieces.counts, pieces.lengths, pieces.used]
    text, pieces, labels = stream.gather_masked(p)
    out += [text, pieces.counts, pieces.lengths, labels]
    return out


def python_batches(stream, p, dtype=numpy.int64):
    """The same from the Python version (the stream's _fill, as before the kernel)."""
    out = numpy.empty((p.size, SEQ + 1), dtype=dtype)
    stream._fill(p, out, False)
    result = [out]
    text = numpy.empty((p.size, SEQ + 1), dtype=numpy.int64)
    pieces = stream._fill(p, text, True)
    result += [text, pieces.counts, pieces.lengths, pieces.used]
    text = numpy.empty((p.size, SEQ + 1), dtype=numpy.int64)
    labels = numpy.empty((p.size, SEQ), dtype=numpy.float32)
    pieces = stream._fill(p, text, True, labels)
    return [*result, text, pieces.counts, pieces.lengths, labels]


def assert_same(ours, theirs, what):
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype, what
        numpy.testing.assert_array_equal(a, b, err_msg=what)


@pytest.mark.parametrize("rows", [1, 8, 33])
def test_one_call_equals_the_python_version(shards, rows):
    root, prefixes = shards
    rng = numpy.random.default_rng(rows)
    for name, spec in specs(root, prefixes):
        stream = open_stream(spec)
        for trial in range(20):
            p = positions(stream, rng, rows)
            assert stream._fill_compiled(p, numpy.empty((rows, SEQ + 1), numpy.int64), False, None) is not REFUSED
            dtype = (numpy.int64, numpy.uint16, numpy.int32)[trial % 3]
            assert_same(batches(stream, p, dtype), python_batches(stream, p, dtype), f"{name} {p}")


@pytest.fixture
def no_kernels(monkeypatch):
    monkeypatch.setenv("STATEFULSET_KERNELS", "0")
    compiled._reset()
    yield
    monkeypatch.undo()
    compiled._reset()


def test_without_kernels_the_rows_are_the_same(shards):
    root, prefixes = shards
    rng = numpy.random.default_rng(0)
    streams = [(name, open_stream(spec)) for name, spec in specs(root, prefixes)]
    cases = [(name, s, positions(s, rng, 8)) for name, s in streams for _ in range(5)]
    with_kernels = [batches(s, p) for _, s, p in cases]
    mp = pytest.MonkeyPatch()
    mp.setenv("STATEFULSET_KERNELS", "0")
    compiled._reset()
    try:
        assert not compiled.available()
        for (name, s, p), expected in zip(cases, with_kernels, strict=True):
            assert s._fill_compiled(p, numpy.empty((8, SEQ + 1), numpy.int64), False, None) is REFUSED
            assert_same(batches(s, p), expected, name)
    finally:
        mp.undo()
        compiled._reset()


def test_positions_outside_the_stream_are_named(shards):
    root, prefixes = shards
    for _name, spec in specs(root, prefixes):
        stream = open_stream(spec)
        bad = [-1] if stream.unbounded else [-1, len(stream)]
        for b in bad:
            with pytest.raises(SequenceIndexError, match=f"position {b} is outside"):
                stream.gather([0, b, 1])
    valid = open_stream({**dict(specs(root, prefixes))["native blend"], "split": "50,25,25"}, "valid")
    with pytest.raises(SequenceIndexError, match=f"position {len(valid)} is outside"):
        valid.gather([0, len(valid)])


def test_refusals_write_nothing(shards):
    """Bad arguments, a position past the stream, a source or local sample out of range: -1 and
    ``out`` untouched (the caller then runs the Python version, which names what is wrong)."""
    root, prefixes = shards
    lib = compiled.library()
    named = dict(specs(root, prefixes))
    for name, inputs, bad in [
        ("megatron blend", 1, [[5, None]]),  # None: the stream's length
        ("megatron one", 1, [[-1, 3]]),
        ("native blend", 2, [[0, 0, 1, -1]]),  # a negative position (the kernel locates it in the blend)
        ("native one", 2, [[0, 3, 1, 2]]),  # source 3 of 1
    ]:
        stream = open_stream(named[name])
        stream.gather(numpy.arange(2))
        kernel = stream._kernel
        if name == "native one":  # the rows' sources given, not located by the kernel
            kernel.table = kernel.table.copy()
            kernel.table[1] = 0
        for values in bad:
            values = [len(stream) if v is None else v for v in values]
            for table, kind in [(kernel.table, 5), (kernel.table, 9), (numpy.concatenate([[0], kernel.table[1:]]), 5)]:
                out = numpy.full((2, SEQ + 1), 77, dtype=numpy.int64)
                block = numpy.zeros(4 + (inputs + 3) * 2 + 2 * 128, dtype=numpy.int64)
                block[:4] = [2, kind, 128, 1]
                good = [0, 1] if inputs == 1 else [0, 0, 0, 1]
                block[4 : 4 + 2 * inputs] = values if kind == 5 and table is kernel.table else good
                assert lib.sf_gather_batch(table.ctypes.data, block.ctypes.data, out.ctypes.data, None, None) == -1, (
                    name
                )
                assert (out == 77).all(), name


def test_the_kernel_locates_positions_as_python_does(shards):
    """The kernel locates positions in a plain blend's tree and in a schedule of several stages as
    Python does: far positions too (where the shares' products pass 2^32), through stage boundaries."""
    root, prefixes = shards
    named = dict(specs(root, prefixes))
    rng = numpy.random.default_rng(4)
    blend, staged = open_stream(named["native blend"]), open_stream(named["native stages"])
    for stream in (blend, staged):
        stream.gather(numpy.arange(3))
        assert stream._kernel.schedule is not None
    for high in (10**4, 2**33, 2**45, 2**60):
        p = rng.integers(0, high, size=16)
        assert_same(batches(blend, p), python_batches(blend, p), str(p))
        assert_same(batches(staged, p), python_batches(staged, p), str(p))


def test_one_pass_splits_equal_the_python_version(shards):
    """valid/test of a native blend (one pass, located in Python, each row's source passed in)."""
    root, prefixes = shards
    rng = numpy.random.default_rng(5)
    for split in ("valid", "test"):
        stream = open_stream({**dict(specs(root, prefixes))["native blend"], "split": "50,25,25"}, split)
        for _ in range(10):
            p = rng.integers(0, len(stream), size=8)
            assert stream._fill_compiled(p, numpy.empty((8, SEQ + 1), numpy.int64), False, None) is not REFUSED
            assert_same(batches(stream, p), python_batches(stream, p), f"{split} {p}")


def python_fields(stream, p):
    """text, loss_mask (masked streams) and the document fields by the Python version (the stream's
    _fill, then the numpy rule), and the rule's error message where it refuses the rows."""
    text = numpy.empty((p.size, SEQ + 1), numpy.int64)
    labels = numpy.empty((p.size, SEQ), numpy.float32) if stream.masked else None
    pieces = stream._fill(p, text, True, labels)
    out = {"text": text} if labels is None else {"text": text, "loss_mask": labels}
    try:
        out.update(document_fields(pieces, SEQ, p, native=False))
    except StatefulsetError as exc:
        return out, str(exc)
    return out, None


def assert_fields(ours, theirs, what):
    assert sorted(ours) == sorted(theirs), what
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype and ours[name].shape == value.shape, f"{what} {name}"
        numpy.testing.assert_array_equal(ours[name], value, err_msg=f"{what} {name}")


@pytest.mark.parametrize("rows", [1, 8, 33])
def test_document_fields_in_the_batch_call_equal_the_python_version(shards, rows):
    """The batch kernel writes cu_seqlens, max_seqlen and position_ids in the call that copies the
    rows: with the rows (and loss_mask), bit for bit the Python version's (stream._fill, then the
    numpy rule), dtypes included, into new arrays and into given ones (text in any token dtype), and
    the same where the pieces are not kept (``keep=False``: None instead); rows the rule refuses
    (more documents than cu_seqlens has room for: the tiny shard's) raise its error, naming the sample."""
    root, prefixes = shards
    rng = numpy.random.default_rng(100 + rows)
    refused = written = 0
    for name, spec in specs(root, prefixes):
        stream = open_stream(spec)
        for trial in range(12):
            p = positions(stream, rng, rows)
            expected, error = python_fields(stream, p)
            targets = FieldTargets(rows, SEQ, {})
            text, _ = stream.gather_pieces(p, documents=targets.request)
            assert targets.written == (error is None), f"{name} {p}"  # the kernel wrote them, or refused
            lean = FieldTargets(rows, SEQ, {}, keep=False)  # the pieces not copied out where it wrote them
            lean_text, pieces = stream.gather_pieces(p, documents=lean.request)
            assert (pieces is None) == (error is None) == lean.written, f"{name} {p}"
            if error is None:
                assert_fields({"text": lean_text, **lean.fields}, {"text": text, **targets.fields}, f"{name} lean")
            if error is not None:
                refused += 1
                with pytest.raises(StatefulsetError) as raised:
                    gather_fields(stream, p, True)
                assert str(raised.value) == error
                continue
            written += 1
            assert_fields(
                {"text": text, **targets.fields}, {k: v for k, v in expected.items() if k != "loss_mask"}, name
            )
            assert_fields(gather_fields(stream, p, True), expected, f"{name} {p}")
            dtype = (numpy.int64, stream.token_dtype)[trial % 2]
            given = {k: numpy.full(v.shape, 7, dtype=dtype if k == "text" else v.dtype) for k, v in expected.items()}
            got = gather_fields(stream, p, True, dict(given))
            assert all(got[k] is given[k] for k in given), name  # written in place
            assert_fields(got, {**expected, "text": expected["text"].astype(dtype)}, f"{name} {p} {dtype}")
    assert written > 20 and refused > 0, (written, refused)


def test_refused_rows_write_no_document_fields(shards):
    """A batch the kernel refuses (a position past the stream) writes no field and leaves the code
    at -1: the Python version then names the position."""
    root, prefixes = shards
    stream = open_stream(dict(specs(root, prefixes))["megatron one"])
    given = {"cu_seqlens": numpy.full((2, SEQ + 1), 7, numpy.int32), "max_seqlen": numpy.full(2, 7, numpy.int32),
             "position_ids": numpy.full((2, SEQ), 7, numpy.int64)}  # fmt: skip
    targets = FieldTargets(2, SEQ, given)
    with pytest.raises(SequenceIndexError, match=f"position {len(stream)} is outside"):
        stream.gather_pieces([0, len(stream)], documents=targets.request)
    assert targets.request[3] == -1 and not targets.written
    assert all((value == 7).all() for value in given.values())
