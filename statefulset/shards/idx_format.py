"""The MMIDIDX (version 1) index format of Megatron bin/idx shards: encoding and checked decoding.

Layout of ``prefix.idx`` (all integers little-endian, arrays unaligned)::

    0            9 bytes   magic b"MMIDIDX\\x00\\x00"
    9            uint64    version (1)
    17           uint8     dtype code of the tokens in prefix.bin
    18           uint64    S = sequence count
    26           uint64    D = entries of document_indices (documents + 1)
    34           int32[S]  sequence_lengths (tokens)
    34+4S        int64[S]  sequence_pointers (byte offsets into prefix.bin)
    34+12S       int64[D]  document_indices (sequence boundaries, 0 ... S)
    34+12S+8D    int8[S]   sequence_modes (multimodal only; nothing in the file says so)

Everything here treats the bytes as untrusted: any inconsistency is a ``StatefulsetError``
naming the file and the field, never an assertion, an overflow or a wild read.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import NoReturn

import numpy

from statefulset.errors import StatefulsetError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34
_HEADER = struct.Struct("<9sQBQQ")

# Megatron's DType enum (megatron/core/datasets/indexed_dataset.py).
DTYPE_CODES: dict[int, numpy.dtype] = {
    1: numpy.dtype(numpy.uint8),
    2: numpy.dtype(numpy.int8),
    3: numpy.dtype(numpy.int16),
    4: numpy.dtype(numpy.int32),
    5: numpy.dtype(numpy.int64),
    6: numpy.dtype(numpy.float64),
    7: numpy.dtype(numpy.float32),
    8: numpy.dtype(numpy.uint16),
}
_CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}

# Explicit little-endian views, so a big-endian host still reads the files right.
LENGTH_DTYPE = numpy.dtype("<i4")
POINTER_DTYPE = numpy.dtype("<i8")
DOCUMENT_DTYPE = numpy.dtype("<i8")
MODE_DTYPE = numpy.dtype("i1")

# Validation walks the arrays in chunks so that checking a billion-sequence index needs
# constant memory.
CHUNK = 1 << 22
# The whole-index check's step (values): its int64 temporaries (1 MiB) are reused and stay in cache.
CHECK_STEP = 1 << 16


def token_dtype(dtype: object) -> numpy.dtype:
    """Normalise ``numpy.uint16``, ``"uint16"`` or ``numpy.dtype("uint16")``; reject others."""
    try:
        normalized = numpy.dtype(dtype).newbyteorder("=")
    except TypeError as exc:
        raise StatefulsetError(f"dtype {dtype!r} is not a numpy dtype") from exc
    if normalized not in _CODE_OF:
        names = ", ".join(str(d) for d in DTYPE_CODES.values())
        raise StatefulsetError(f"dtype {normalized} cannot be stored in a .bin file; use one of {names}")
    return normalized


def dtype_code(dtype: object) -> int:
    return _CODE_OF[token_dtype(dtype)]


def optimal_dtype(vocab_size: int) -> numpy.dtype:
    """The token dtype Megatron's preprocess_data.py picks for a vocabulary."""
    return numpy.dtype(numpy.uint16) if vocab_size < 65500 else numpy.dtype(numpy.int32)


@dataclass(frozen=True)
class IndexHeader:
    """The fixed part of an ``.idx`` file plus where each array starts."""

    dtype: numpy.dtype
    sequence_count: int
    document_count: int
    multimodal: bool

    @property
    def lengths_offset(self) -> int:
        return HEADER_SIZE

    @property
    def pointers_offset(self) -> int:
        return HEADER_SIZE + 4 * self.sequence_count

    @property
    def documents_offset(self) -> int:
        return HEADER_SIZE + 12 * self.sequence_count

    @property
    def modes_offset(self) -> int:
        return HEADER_SIZE + 12 * self.sequence_count + 8 * self.document_count

    @property
    def index_size(self) -> int:
        return self.modes_offset + (self.sequence_count if self.multimodal else 0)


def encode_header(dtype: object, sequence_count: int, document_count: int) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, dtype_code(dtype), sequence_count, document_count)


def decode_header(head: bytes, *, idx_size: int, multimodal: bool, path: str) -> IndexHeader:
    """Check the 34-byte header against the file size; ``head`` holds at least its first 34 bytes."""
    if idx_size < HEADER_SIZE or len(head) < HEADER_SIZE:
        raise StatefulsetError(f"{path}: file is {idx_size} bytes, shorter than the {HEADER_SIZE}-byte MMIDIDX header")
    magic, version, code, sequence_count, document_count = _HEADER.unpack_from(head)
    if magic != MAGIC:
        raise StatefulsetError(f"{path}: field 'magic' is {magic!r}, expected {MAGIC!r}: not a Megatron .idx file")
    if version != VERSION:
        raise StatefulsetError(f"{path}: field 'version' is {version}, only version {VERSION} is known")
    if code not in DTYPE_CODES:
        raise StatefulsetError(f"{path}: field 'dtype' has code {code}, valid codes are 1 to 8")
    if document_count < 1:
        raise StatefulsetError(
            f"{path}: field 'document_count' is 0; document_indices always holds at least the leading 0"
        )
    header = IndexHeader(DTYPE_CODES[code], sequence_count, document_count, multimodal)
    expected = header.index_size
    if expected != idx_size:
        hint = ""
        if not multimodal and idx_size == expected + sequence_count and sequence_count:
            hint = " (the extra bytes fit sequence_modes: open it with multimodal=True)"
        elif multimodal and idx_size == expected - sequence_count:
            hint = " (no room for sequence_modes: this index is not multimodal)"
        raise StatefulsetError(
            f"{path}: fields 'sequence_count'={sequence_count} and 'document_count'={document_count} "
            f"describe a {expected}-byte index, but the file is {idx_size} bytes{hint}"
        )
    return header


@dataclass(frozen=True)
class IndexArrays:
    """Zero-copy views of the arrays of an ``.idx`` buffer."""

    header: IndexHeader
    sequence_lengths: numpy.ndarray
    sequence_pointers: numpy.ndarray
    document_indices: numpy.ndarray
    sequence_modes: numpy.ndarray | None


def index_arrays(buffer: object, header: IndexHeader) -> IndexArrays:
    """Views into ``buffer`` (bytes, mmap, ...); they keep the buffer alive, so never dangle."""
    s, d = header.sequence_count, header.document_count
    lengths = numpy.frombuffer(buffer, LENGTH_DTYPE, count=s, offset=header.lengths_offset)
    pointers = numpy.frombuffer(buffer, POINTER_DTYPE, count=s, offset=header.pointers_offset)
    documents = numpy.frombuffer(buffer, DOCUMENT_DTYPE, count=d, offset=header.documents_offset)
    modes = None
    if header.multimodal:
        modes = numpy.frombuffer(buffer, MODE_DTYPE, count=s, offset=header.modes_offset)
    return IndexArrays(header, lengths, pointers, documents, modes)


def _first(mask: numpy.ndarray) -> int:
    return int(numpy.flatnonzero(mask)[0])


def _check_document_ends(arrays: IndexArrays, path: str) -> None:
    header = arrays.header
    documents = arrays.document_indices
    if int(documents[0]) != 0:
        raise StatefulsetError(f"{path}: field 'document_indices[0]' is {int(documents[0])}, expected 0")
    if int(documents[-1]) != header.sequence_count:
        raise StatefulsetError(
            f"{path}: field 'document_indices[{header.document_count - 1}]' is {int(documents[-1])}, "
            f"expected the sequence count {header.sequence_count}"
        )


def _check_bin_size(expected: int, bin_size: int, path: str, bin_path: str) -> None:
    if expected != bin_size:
        raise StatefulsetError(
            f"{bin_path}: file is {bin_size} bytes, but {path} describes {expected} bytes "
            "(field 'sequence_lengths' × itemsize, summed)"
        )


def check_ends(arrays: IndexArrays, *, bin_size: int, path: str, bin_path: str) -> None:
    """O(1) checks, for cheap reopening: book-ends of document_indices and the ``.bin`` size
    implied by the last pointer and length."""
    _check_document_ends(arrays, path)
    s = arrays.header.sequence_count
    expected = 0
    if s:
        last_length = int(arrays.sequence_lengths[-1])
        if last_length < 0:
            raise StatefulsetError(f"{path}: field 'sequence_lengths[{s - 1}]' is negative ({last_length})")
        expected = int(arrays.sequence_pointers[-1]) + last_length * arrays.header.dtype.itemsize
    _check_bin_size(expected, bin_size, path, bin_path)


def check_all(arrays: IndexArrays, *, bin_size: int, path: str, bin_path: str, buffer: object = None) -> None:
    """Every invariant of the index, step by step in constant memory.

    document_indices run from 0 to S without going down, lengths are non-negative, each
    pointer is the running byte sum of the lengths before it, and the ``.bin`` is exactly as
    large as the index says. ``buffer``: the memory map the arrays view; the pages of the pointers
    and document_indices it checked are let go again (:func:`_let_go`), so that a first open's check
    does not keep the whole index in this process's memory.
    """
    _check_document_ends(arrays, path)
    header = arrays.header
    _check_documents(arrays.document_indices, path)
    _let_go(buffer, header.documents_offset, 8 * header.document_count)
    running = _check_pointers(arrays, path)
    _let_go(buffer, header.pointers_offset, 8 * header.sequence_count)
    _check_bin_size(running, bin_size, path, bin_path)


def _check_documents(documents: numpy.ndarray, path: str) -> None:
    """document_indices never go down (the first is 0: :func:`_check_document_ends`)."""
    count = documents.shape[0]
    for start in range(0, count - 1, CHECK_STEP):
        chunk = documents[start : start + CHECK_STEP + 1]
        down = chunk[1:] < chunk[:-1]
        if down.any():
            i = start + 1 + _first(down)
            raise StatefulsetError(
                f"{path}: field 'document_indices[{i}]' is {int(documents[i])}, smaller than the entry before it"
            )


def _check_pointers(arrays: IndexArrays, path: str) -> int:
    """Lengths are non-negative and each pointer is the byte sum of the lengths before it; returns the total.

    Step by step: the step's first pointer is the running total, and each next pointer is the one
    before it plus its length in bytes (one difference, no running sum to build).
    """
    itemsize = arrays.header.dtype.itemsize
    lengths, pointers = arrays.sequence_lengths, arrays.sequence_pointers
    nbytes = numpy.empty(CHECK_STEP, dtype=numpy.int64)
    steps = numpy.empty(CHECK_STEP, dtype=numpy.int64)
    running = 0
    for start in range(0, arrays.header.sequence_count, CHECK_STEP):
        chunk = lengths[start : start + CHECK_STEP]
        n = chunk.shape[0]
        if int(chunk.min()) < 0:
            i = start + _first(chunk < 0)
            raise StatefulsetError(f"{path}: field 'sequence_lengths[{i}]' is negative ({int(lengths[i])})")
        actual = pointers[start : start + n]
        if int(actual[0]) != running:
            _pointer_error(path, start, int(actual[0]), running)
        numpy.multiply(chunk, itemsize, out=nbytes[:n], dtype=numpy.int64)
        numpy.subtract(actual[1:], actual[:-1], out=steps[: n - 1])
        wrong = steps[: n - 1] != nbytes[: n - 1]
        if wrong.any():
            j = _first(wrong)
            _pointer_error(path, start + j + 1, int(actual[j + 1]), int(actual[j]) + int(nbytes[j]))
        running = int(actual[-1]) + int(nbytes[n - 1])
    return running


def _pointer_error(path: str, i: int, actual: int, expected: int) -> NoReturn:
    raise StatefulsetError(
        f"{path}: field 'sequence_pointers[{i}]' is {actual}, "
        f"but the lengths before it put sequence {i} at byte {expected}"
    )


def _let_go(buffer: object, offset: int, nbytes: int) -> None:
    """Drop this process's mapping of the whole pages of ``buffer[offset : offset + nbytes]`` when ``buffer``
    is a memory map (``MADV_DONTNEED``: the file's pages stay in the page cache, and a later read of them
    maps them again); nothing for other buffers or where the platform has no ``madvise``."""
    advise = getattr(buffer, "madvise", None)
    dontneed = getattr(mmap, "MADV_DONTNEED", None)
    if advise is None or dontneed is None:
        return
    first = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        advise(dontneed, first, last - first)


def decode_index(
    buffer: object,
    *,
    idx_size: int,
    bin_size: int,
    multimodal: bool,
    path: str,
    bin_path: str,
    full: bool = True,
) -> IndexArrays:
    """Decode and check a whole ``.idx`` buffer against the ``.bin`` size it goes with."""
    header = decode_header(bytes(buffer[:HEADER_SIZE]), idx_size=idx_size, multimodal=multimodal, path=path)
    arrays = index_arrays(buffer, header)
    if full:
        check_all(arrays, bin_size=bin_size, path=path, bin_path=bin_path, buffer=buffer)
    else:
        check_ends(arrays, bin_size=bin_size, path=path, bin_path=bin_path)
    return arrays
