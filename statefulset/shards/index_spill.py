"""The index of a shard being written, kept in memory that does not grow with the corpus.

A writer's sequence lengths, document ends (and, for multimodal shards, sequence modes) wait in
Python lists (fastest per document) only up to ``SPILL_EVERY`` entries; then they go to
anonymous files next to the shard, so memory stays flat however many sequences are written or
merged. :meth:`IndexSpill.write_index` streams them out as an MMIDIDX ``.idx``
(:mod:`statefulset.shards.idx_format`), computing the pointers on the way.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import IO

import numpy

from statefulset.shards import idx_format

SPILL_EVERY = 1 << 20
COPY_BYTES = 16 << 20  # the block size of every streamed copy (index files and, in the writer, tokens)


class IndexSpill:
    """Sequence lengths, document ends and modes of a shard being written, spilled to anonymous files.

    ``lengths``, ``documents`` and ``modes`` are the lists a writer appends to per document;
    :meth:`spill` empties them (in place: a writer may hold them) into the files. Document ends
    count sequences from the start of the shard; the leading 0 of ``document_indices`` is added
    by :meth:`write_index`.
    """

    def __init__(self, folder: str, multimodal: bool) -> None:
        self.lengths: list[int] = []
        self.documents: list[int] = []
        self.modes: list[int] = []
        self._lengths_file: IO[bytes] = tempfile.TemporaryFile(dir=folder)
        self._documents_file: IO[bytes] = tempfile.TemporaryFile(dir=folder)
        self._modes_file: IO[bytes] | None = tempfile.TemporaryFile(dir=folder) if multimodal else None

    def spill(self) -> None:
        """Move the listed entries to the files (call before writing to the files directly)."""
        if self.lengths:
            self._lengths_file.write(numpy.asarray(self.lengths, idx_format.LENGTH_DTYPE).tobytes())
            self.lengths.clear()
        if self.documents:
            self._documents_file.write(numpy.asarray(self.documents, idx_format.DOCUMENT_DTYPE).tobytes())
            self.documents.clear()
        if self.modes:
            self._modes_file.write(numpy.asarray(self.modes, idx_format.MODE_DTYPE).tobytes())  # type: ignore[union-attr]
            self.modes.clear()

    def append_arrays(self, lengths: numpy.ndarray, ends: numpy.ndarray, modes: numpy.ndarray | None) -> None:
        """Many entries at once: sequence ``lengths``, document ``ends`` (sequence counts) and ``modes``."""
        self.spill()
        self._lengths_file.write(lengths.astype(idx_format.LENGTH_DTYPE).tobytes())
        self._documents_file.write(ends.astype(idx_format.DOCUMENT_DTYPE).tobytes())
        if self._modes_file is not None and modes is not None:
            self._modes_file.write(modes.astype(idx_format.MODE_DTYPE).tobytes())

    def append_index(self, arrays: idx_format.IndexArrays, first_sequence: int) -> None:
        """A whole shard's entries, after ``first_sequence`` sequences, in chunks of ``idx_format.CHUNK``."""
        self.spill()
        lengths, boundaries, chunk = arrays.sequence_lengths, arrays.document_indices, idx_format.CHUNK
        for start in range(0, lengths.size, chunk):
            self._lengths_file.write(lengths[start : start + chunk].tobytes())
            if self._modes_file is not None:
                self._modes_file.write(arrays.sequence_modes[start : start + chunk].tobytes())
        for start in range(1, boundaries.size, chunk):
            shifted = boundaries[start : start + chunk] + first_sequence
            self._documents_file.write(shifted.astype(idx_format.DOCUMENT_DTYPE).tobytes())

    def append_shape_of(self, other: IndexSpill, first_sequence: int) -> int:
        """``other``'s lengths and document ends (not its modes), after ``first_sequence`` sequences;
        streamed in blocks of ``COPY_BYTES``. Returns the number of tokens they describe."""
        other.spill()
        self.spill()
        tokens = 0
        for source, target, shift in (
            (other._lengths_file, self._lengths_file, None),
            (other._documents_file, self._documents_file, first_sequence),
        ):
            source.flush()
            offset = 0
            while block := os.pread(source.fileno(), COPY_BYTES, offset):
                offset += len(block)
                if shift is None:
                    tokens += int(numpy.frombuffer(block, idx_format.LENGTH_DTYPE).sum(dtype=numpy.int64))
                    target.write(block)
                else:
                    ends = numpy.frombuffer(block, idx_format.DOCUMENT_DTYPE) + shift
                    target.write(ends.astype(idx_format.DOCUMENT_DTYPE).tobytes())
        return tokens

    def write_index(self, out: IO[bytes], dtype: numpy.dtype, sequence_count: int, document_count: int) -> None:
        """The whole ``.idx`` (header, lengths, pointers, document indices, modes) to ``out``."""
        self.spill()
        out.write(idx_format.encode_header(dtype, sequence_count, document_count + 1))
        self._lengths_file.seek(0)
        shutil.copyfileobj(self._lengths_file, out, COPY_BYTES)
        # Pointers are the running byte sum of the lengths, built chunk by chunk with a carry.
        self._lengths_file.seek(0)
        itemsize, carry = dtype.itemsize, 0
        while block := self._lengths_file.read(idx_format.CHUNK * 4):
            nbytes = numpy.frombuffer(block, idx_format.LENGTH_DTYPE).astype(numpy.int64) * itemsize
            ends = numpy.cumsum(nbytes) + carry
            out.write((ends - nbytes).astype(idx_format.POINTER_DTYPE).tobytes())
            carry = int(ends[-1])
        out.write(numpy.zeros(1, idx_format.DOCUMENT_DTYPE).tobytes())
        self._documents_file.seek(0)
        shutil.copyfileobj(self._documents_file, out, COPY_BYTES)
        if self._modes_file is not None:
            self._modes_file.seek(0)
            shutil.copyfileobj(self._modes_file, out, COPY_BYTES)

    def close(self) -> None:
        for spill in (self._lengths_file, self._documents_file, self._modes_file):
            if spill is not None:
                spill.close()
