"""Every corruption of an index or data file is a StatefulsetError naming the file and field."""

from __future__ import annotations

import contextlib
import struct

import numpy
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statefulset import IndexedDataset, IndexedDatasetWriter, StatefulsetError
from statefulset.shards import idx_format
from statefulset.shards.idx_format import decode_index

S, D = 6, 4  # the shard below: 6 sequences in 3 documents (D = 3 + 1 entries)
LENGTHS_AT, POINTERS_AT, DOCS_AT = 34, 34 + 4 * S, 34 + 12 * S


@pytest.fixture
def shard(tmp_path):
    prefix = tmp_path / "shard"
    with IndexedDatasetWriter(prefix, numpy.uint16) as w:
        w.add_document([1, 2, 3], lengths=[1, 2])
        w.add_document([4, 5, 6, 7])
        w.add_document([8, 9, 10, 11, 12], lengths=[2, 0, 3])
    return prefix


def patch(path, offset, fmt, value):
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    path.write_bytes(bytes(data))


CASES = [
    # (what to change, offset, struct format, value, the error must mention)
    ("magic", 0, "<9s", b"NOTANIDX\x00", r"shard\.idx: field 'magic'"),
    ("version", 9, "<Q", 2, r"shard\.idx: field 'version' is 2"),
    ("dtype code 0", 17, "<B", 0, r"shard\.idx: field 'dtype' has code 0"),
    ("dtype code 9", 17, "<B", 9, r"shard\.idx: field 'dtype' has code 9"),
    ("sequence_count", 18, "<Q", S + 1, r"shard\.idx: fields 'sequence_count'=7"),
    ("huge sequence_count", 18, "<Q", 2**63, r"shard\.idx: fields 'sequence_count'"),
    ("document_count", 26, "<Q", D - 1, r"shard\.idx: fields .*'document_count'=3"),
    ("no documents", 26, "<Q", 0, r"shard\.idx: field 'document_count' is 0"),
    ("negative length", LENGTHS_AT + 4, "<i", -2, r"shard\.idx: field 'sequence_lengths\[1\]' is negative"),
    ("length vs pointer", LENGTHS_AT + 8, "<i", 3, r"shard\.idx: field 'sequence_pointers\[3\]'"),
    ("pointer", POINTERS_AT + 16, "<q", 5, r"shard\.idx: field 'sequence_pointers\[2\]' is 5"),
    ("first document", DOCS_AT, "<q", 1, r"shard\.idx: field 'document_indices\[0\]' is 1"),
    ("last document", DOCS_AT + 24, "<q", 5, r"shard\.idx: field 'document_indices\[3\]' is 5"),
    ("documents go down", DOCS_AT + 16, "<q", 1, r"shard\.idx: field 'document_indices\[2\]' is 1, smaller"),
    ("last length", LENGTHS_AT + 20, "<i", 4, r"shard\.bin: file is 24 bytes, but .*shard\.idx describes 26"),
]


@pytest.mark.parametrize(("what", "offset", "fmt", "value", "message"), CASES, ids=[c[0] for c in CASES])
def test_index_corruption(shard, what, offset, fmt, value, message):
    patch(shard.with_suffix(".idx"), offset, fmt, value)
    with pytest.raises(StatefulsetError, match=message):
        IndexedDataset(shard)


STEP = idx_format.CHECK_STEP
LONG_S = 2 * STEP + 7  # sequences of the shard below: the whole-index check takes three steps


@pytest.fixture
def long_shard(tmp_path):
    """LONG_S sequences of 1 to 3 tokens, two per document (the last document holds one)."""
    prefix = tmp_path / "long"
    lengths = numpy.arange(LONG_S) % 3 + 1
    per_document = numpy.full(LONG_S // 2 + 1, 2)
    per_document[-1] = LONG_S - 2 * (LONG_S // 2)
    with IndexedDatasetWriter(prefix, numpy.uint16) as w:
        tokens = numpy.arange(int(lengths.sum())) % 1000
        w.add_documents(tokens, lengths, sequences_per_document=per_document)
    return prefix


def _long_layout() -> tuple[int, int, int]:
    """Where the lengths, pointers and document_indices of the long shard's .idx start."""
    return 34, 34 + 4 * LONG_S, 34 + 12 * LONG_S


def _pointer_at(prefix, i) -> int:
    return struct.unpack_from("<q", prefix.with_suffix(".idx").read_bytes(), _long_layout()[1] + 8 * i)[0]


@pytest.mark.parametrize(
    ("where", "field"),
    [
        (STEP, "pointer"),  # the first pointer of the second step: checked against the running total
        (STEP - 1, "pointer"),  # the last pointer of the first step
        (2 * STEP + 3, "pointer"),
        (STEP, "length"),
        (2 * STEP + 6, "length"),  # the very last length
        (STEP, "document"),  # the first entry of a step, against the last of the step before
        (STEP + 1, "document"),
    ],
)
def test_whole_index_check_across_its_steps(long_shard, where, field):
    """The check walks the index in steps of CHECK_STEP values: a fault at a step's edges is found
    and named like one inside a step (index, value, and what the entries before it imply)."""
    IndexedDataset(long_shard)  # the shard as written passes
    lengths_at, pointers_at, documents_at = _long_layout()
    idx = long_shard.with_suffix(".idx")
    if field == "pointer":
        right = _pointer_at(long_shard, where)
        patch(idx, pointers_at + 8 * where, "<q", right + 2)
        message = rf"long\.idx: field 'sequence_pointers\[{where}\]' is {right + 2}, .* at byte {right}$"
    elif field == "length":
        patch(idx, lengths_at + 4 * where, "<i", -1)
        message = rf"long\.idx: field 'sequence_lengths\[{where}\]' is negative \(-1\)"
    else:
        patch(idx, documents_at + 8 * where, "<q", 1)
        message = rf"long\.idx: field 'document_indices\[{where}\]' is 1, smaller than the entry before it"
    with pytest.raises(StatefulsetError, match=message):
        IndexedDataset(long_shard)


@pytest.mark.parametrize("cut", [0, 10, 33, 34, 60, -1])
def test_truncated_index(shard, cut):
    idx = shard.with_suffix(".idx")
    idx.write_bytes(idx.read_bytes()[:cut])
    with pytest.raises(StatefulsetError, match=r"shard\.idx: (file is|fields)"):
        IndexedDataset(shard)


def test_index_with_trailing_bytes(shard):
    idx = shard.with_suffix(".idx")
    idx.write_bytes(idx.read_bytes() + b"\x00" * 3)
    with pytest.raises(StatefulsetError, match=r"shard\.idx: .*but the file is 141 bytes"):
        IndexedDataset(shard)


@pytest.mark.parametrize("change", [b"", b"\x00\x00"], ids=["truncated", "longer"])
def test_bin_size_mismatch(shard, change):
    binary = shard.with_suffix(".bin")
    data = binary.read_bytes()
    binary.write_bytes(data[:-2] if change == b"" else data + change)
    with pytest.raises(StatefulsetError, match=r"shard\.bin: file is \d+ bytes, but .*shard\.idx describes 24"):
        IndexedDataset(shard)
    with pytest.raises(StatefulsetError, match=r"shard\.bin"):
        IndexedDataset(shard, validate=False)  # the O(1) checks catch it too


def _decode(idx: bytes, bin_size: int, multimodal: bool = False):
    return decode_index(
        idx, idx_size=len(idx), bin_size=bin_size, multimodal=multimodal, path="x.idx", bin_path="x.bin"
    )


def _valid_index(tmp_path_factory) -> tuple[bytes, int]:
    prefix = tmp_path_factory.mktemp("fuzz") / "s"
    with IndexedDatasetWriter(prefix, numpy.int32) as w:
        for n in range(7):
            w.add_document(numpy.arange(n * 3), lengths=[n, 2 * n])
    return (prefix.with_suffix(".idx").read_bytes(), prefix.with_suffix(".bin").stat().st_size)


FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.binary(max_size=200), bin_size=st.integers(0, 10_000), multimodal=st.booleans())
def test_fuzz_random_bytes(data, bin_size, multimodal):
    with contextlib.suppress(StatefulsetError):
        _decode(data, bin_size, multimodal)


@FUZZ
@given(
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
    cut=st.one_of(st.none(), st.integers(0, 400)),
    extra=st.binary(max_size=16),
    multimodal=st.booleans(),
)
def test_fuzz_mutated_valid_index(tmp_path_factory, edits, cut, extra, multimodal):
    idx, bin_size = _valid_index(tmp_path_factory)
    data = bytearray(idx)
    for pos, value in edits:
        data[pos % len(data)] = value
    data = bytes(data[:cut] if cut is not None else data) + extra
    try:
        arrays = _decode(data, bin_size, multimodal)
    except StatefulsetError:
        return
    # Whatever got through is self-consistent: every sequence lies inside the .bin.
    itemsize = arrays.header.dtype.itemsize
    ends = arrays.sequence_pointers + arrays.sequence_lengths.astype(numpy.int64) * itemsize
    assert (arrays.sequence_lengths >= 0).all() and (ends <= bin_size).all()
    assert (numpy.diff(arrays.document_indices) >= 0).all()
