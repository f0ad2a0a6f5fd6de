"""``IndexedDatasetWriter``: byte-identical to megatron-core's ``IndexedDatasetBuilder``, atomic,
vectorised, and appending whole shards (``add_index``) in memory that does not grow with the corpus
(the index waits in an :class:`~statefulset.shards.index_spill.IndexSpill`)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from types import TracebackType
from typing import IO, Any

import numpy

from statefulset.errors import StatefulsetError
from statefulset.shards import idx_format, index_spill
from statefulset.shards.direct_io import SequentialWriter
from statefulset.shards.index_spill import SPILL_EVERY, IndexSpill
from statefulset.shards.reader import IndexedDataset, prefix_str
from statefulset.shards.storage import map_file
from statefulset.shards.temporaries import hold, release, sweep, temp_path

_INT32_MAX = numpy.iinfo(numpy.int32).max


def _local_path(prefix: str) -> str:
    if prefix.startswith("file://"):
        return prefix[len("file://") :]
    if "://" in prefix:
        raise StatefulsetError(
            f"{prefix}: shards are written to local files only (atomic rename needs a filesystem); "
            "write locally, then upload both files"
        )
    return prefix


def _create(path: str) -> IO[bytes]:
    # Not tempfile: its files are private (0600) and would stay so after the rename; shards
    # get the same permissions as any file the user creates (0666 less the umask).
    return open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _check_lengths(lengths: Any, total: int, where: str) -> numpy.ndarray:
    lens = numpy.asarray(lengths)
    if lens.ndim != 1 or (lens.size and lens.dtype.kind not in "iu"):
        raise StatefulsetError(f"{where}: lengths must be a 1-D sequence of integers")
    lens = lens.astype(numpy.int64, copy=False)
    if lens.size and (lens.min() < 0 or lens.max() > _INT32_MAX):
        bad = int(numpy.flatnonzero((lens < 0) | (lens > _INT32_MAX))[0])
        raise StatefulsetError(f"{where}: lengths[{bad}] = {int(lens[bad])} is not in [0, 2**31-1]")
    if int(lens.sum()) != total:
        raise StatefulsetError(f"{where}: lengths sum to {int(lens.sum())} but there are {total} tokens")
    return lens


class IndexedDatasetWriter:
    """Write ``prefix.bin`` and ``prefix.idx``.

    Use as a context manager, or call :meth:`close`. Nothing appears under the final names
    until everything is written and synced: tokens go to a temporary file, and leaving the
    ``with`` block with an exception (or a crash) never leaves an ``.idx`` that opens.

    Per document: :meth:`add_document`. Many documents at once, fully vectorised:
    :meth:`add_documents`. Whole shards: :meth:`add_index` (streamed). Megatron's
    ``add_item`` / ``end_document`` / ``finalize`` are there for code written against
    ``IndexedDatasetBuilder``.
    """

    def __init__(
        self, path_prefix: str | os.PathLike[str], dtype: object = numpy.uint16, multimodal: bool = False
    ) -> None:
        self.path_prefix = _local_path(prefix_str(path_prefix))
        self.dtype: numpy.dtype = idx_format.token_dtype(dtype)
        self.multimodal = bool(multimodal)
        folder = os.path.dirname(os.path.abspath(self.path_prefix))
        self._folder = folder
        base = os.path.basename(self.path_prefix)
        for ext in ("bin", "idx"):
            if os.path.isdir(f"{self.path_prefix}.{ext}"):
                raise StatefulsetError(f"{self.path_prefix}.{ext}: is a folder, cannot write a shard there")
        self._bin_tmp = temp_path(folder, base, "bin")
        self._idx_tmp: str | None = None
        try:
            os.makedirs(folder, exist_ok=True)
            sweep(folder, base)  # what writers of this prefix killed earlier left behind
            self._bin = SequentialWriter(self._bin_tmp)
            hold(self._bin_tmp)
            self._index = IndexSpill(folder, self.multimodal)
        except OSError as exc:
            release(self._bin_tmp)
            if os.path.exists(self._bin_tmp):
                os.remove(self._bin_tmp)
            raise StatefulsetError(f"{self.path_prefix}: cannot write here: {exc}") from exc
        # The index's own lists, appended to directly on the per-document path (spilling empties them in place).
        self._lengths, self._documents, self._modes = self._index.lengths, self._index.documents, self._index.modes
        self.sequence_count = 0
        self.document_count = 0
        self._open_item = False
        self._closed = False

    # -- context manager ------------------------------------------------------------------
    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(
                f"IndexedDatasetWriter({self.path_prefix!r}) was never closed; nothing was written",
                ResourceWarning,
                stacklevel=1,
            )
            self.abort()

    # -- adding data ------------------------------------------------------------------------
    def _tokens(self, tokens: Any, where: str) -> numpy.ndarray:
        arr = numpy.asarray(tokens)
        if arr.ndim != 1:
            raise StatefulsetError(f"{where}: tokens must be 1-D, got shape {arr.shape}")
        if arr.dtype != self.dtype:
            if arr.size and not numpy.can_cast(arr.dtype, self.dtype, "safe"):
                self._check_range(arr, where)
            arr = arr.astype(self.dtype)
        return numpy.ascontiguousarray(arr)

    def _check_range(self, arr: numpy.ndarray, where: str) -> None:
        if self.dtype.kind == "f":
            return
        if arr.dtype.kind not in "iub":
            raise StatefulsetError(f"{where}: tokens have dtype {arr.dtype}; {self.dtype} needs integers")
        info = numpy.iinfo(self.dtype)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < info.min or hi > info.max:
            bad = int(numpy.flatnonzero((arr < info.min) | (arr > info.max))[0])
            raise StatefulsetError(
                f"{where}: token {int(arr[bad])} at position {bad} does not fit {self.dtype} "
                f"[{info.min}, {info.max}]; pick a wider dtype"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise StatefulsetError(f"{self.path_prefix}: writer is already closed")

    def add_document(
        self, tokens: Any, lengths: Sequence[int] | None = None, modes: Sequence[int] | None = None
    ) -> None:
        """Add one document: one sequence, or several when ``lengths`` (tokens per sequence) is given."""
        if (
            lengths is None
            and not self.multimodal
            and type(tokens) is numpy.ndarray
            and tokens.dtype == self.dtype
            and tokens.ndim == 1
            and tokens.flags.c_contiguous
            and not self._closed
            and tokens.size <= _INT32_MAX
        ):
            # The common case (a token array in the shard's dtype) skips every conversion.
            self._bin.write(tokens)
            self._lengths.append(tokens.size)
            self.sequence_count += 1
            self.document_count += 1
            self._documents.append(self.sequence_count)
            if len(self._documents) >= SPILL_EVERY:
                self._index.spill()
            return
        self._check_open()
        where = f"{self.path_prefix}: document {self.document_count}"
        arr = self._tokens(tokens, where)
        if lengths is None:
            if arr.size > _INT32_MAX:
                raise StatefulsetError(f"{where}: {arr.size} tokens do not fit one sequence (int32 length)")
            new_lengths = [arr.size]
        else:
            new_lengths = _check_lengths(lengths, arr.size, where).tolist()
        new_modes = self._mode_values(modes, len(new_lengths), where)
        # Validated: only now does anything change.
        self._lengths.extend(new_lengths)
        self._modes.extend(new_modes)
        self._bin.write(arr)
        self.sequence_count += len(new_lengths)
        self.document_count += 1
        self._documents.append(self.sequence_count)
        if len(self._lengths) >= SPILL_EVERY or len(self._documents) >= SPILL_EVERY:
            self._index.spill()

    def _mode_values(self, modes: Any, count: int, where: str) -> list[int]:
        if not self.multimodal:
            if modes is not None:
                raise StatefulsetError(f"{where}: modes given, but the writer is not multimodal")
            return []
        if modes is None:
            return [0] * count
        values = numpy.asarray(modes, dtype=numpy.int64).reshape(-1)
        if values.size != count or (values.size and (values.min() < -128 or values.max() > 127)):
            raise StatefulsetError(f"{where}: need {count} modes in [-128, 127], got {values.tolist()}")
        return values.tolist()

    def add_item(self, tokens: Any, mode: int = 0) -> None:
        """Megatron's ``add_item``: one sequence of a document closed by :meth:`end_document`."""
        self._check_open()
        where = f"{self.path_prefix}: sequence {self.sequence_count}"
        arr = self._tokens(tokens, where)
        if arr.size > _INT32_MAX:
            raise StatefulsetError(f"{where}: {arr.size} tokens do not fit one sequence (int32 length)")
        self._modes.extend(self._mode_values([mode] if self.multimodal else None, 1, where))
        self._bin.write(arr)
        self._lengths.append(arr.size)
        self.sequence_count += 1
        self._open_item = True

    def end_document(self) -> None:
        """Megatron's ``end_document``: the items added since the last one form a document."""
        self._check_open()
        self.document_count += 1
        self._documents.append(self.sequence_count)
        self._open_item = False
        if len(self._lengths) >= SPILL_EVERY or len(self._documents) >= SPILL_EVERY:
            self._index.spill()

    def add_documents(
        self,
        tokens: Any,
        lengths: Any,
        *,
        sequences_per_document: Any = None,
        modes: Any = None,
    ) -> None:
        """Add many documents in one vectorised call.

        ``tokens`` is all their tokens concatenated, ``lengths`` the tokens per sequence, and
        ``sequences_per_document`` how many consecutive sequences form each document (default:
        one each).
        """
        self._check_open()
        where = f"{self.path_prefix}: documents from {self.document_count}"
        arr = self._tokens(tokens, where)
        lens = _check_lengths(lengths, arr.size, where)
        if sequences_per_document is None:
            per_doc = numpy.ones(lens.size, dtype=numpy.int64)
        else:
            per_doc = _check_lengths(sequences_per_document, lens.size, f"{where}: sequences_per_document")
        if self.multimodal:
            mode_values = numpy.zeros(lens.size, numpy.int64) if modes is None else numpy.asarray(modes)
            if mode_values.shape != lens.shape or (
                mode_values.size and (mode_values.min() < -128 or mode_values.max() > 127)
            ):
                raise StatefulsetError(f"{where}: need {lens.size} modes in [-128, 127]")
        elif modes is not None:
            raise StatefulsetError(f"{where}: modes given, but the writer is not multimodal")
        self._bin.write(arr)
        ends = numpy.cumsum(per_doc) + self.sequence_count
        self._index.append_arrays(lens, ends, mode_values if self.multimodal else None)
        self.sequence_count += lens.size
        self.document_count += per_doc.size

    def add_shaped_like(self, other: IndexedDatasetWriter, value: int) -> None:
        """Documents shaped as everything ``other`` holds so far (its sequences and documents), every
        token ``value``: a loss-mask shard begun when its token shard is already part-written. Streams
        ``other``'s spilled index in blocks: memory stays flat."""
        self._check_open()
        tokens = self._index.append_shape_of(other._index, self.sequence_count)
        self._write_filled(tokens, value)
        self.sequence_count += other.sequence_count
        self.document_count += other.document_count

    def add_index(self, path_prefix: str | os.PathLike[str], storage_options: dict | None = None) -> None:
        """Append a whole shard (Megatron's ``add_index``), streaming: memory stays flat."""
        self._check_open()
        source = IndexedDataset(path_prefix, multimodal=self.multimodal, storage_options=storage_options)
        self._append_index(source.path_prefix, source._arrays)
        block = bytearray(index_spill.COPY_BYTES)  # one reused buffer: fresh pages are what costs here
        with source._bin_file.open() as f:
            while n := f.readinto(block):
                self._bin.write(memoryview(block)[:n])

    def add_index_only(self, idx_path: str, bin_size: int) -> None:
        """Append a shard's index without its tokens, whose ``.bin`` of ``bin_size`` bytes the caller
        places after the tokens so far (an object store concatenating parts by server-side copy)."""
        self._check_open()
        buffer = map_file(idx_path)
        arrays = idx_format.decode_index(
            buffer, idx_size=len(buffer), bin_size=bin_size, multimodal=self.multimodal, path=idx_path,
            bin_path=f"its .bin ({bin_size} bytes)",
        )  # fmt: skip
        self._append_index(idx_path, arrays)

    def add_filled_index(self, idx_path: str, bin_size: int, value: int) -> None:
        """Documents shaped as the shard whose index is ``idx_path`` (its ``.bin`` of ``bin_size`` bytes),
        every token ``value``: the ones a part without a loss mask adds to a merged mask shard."""
        self._check_open()
        buffer = map_file(idx_path)
        arrays = idx_format.decode_index(
            buffer, idx_size=len(buffer), bin_size=bin_size, multimodal=False, path=idx_path,
            bin_path=f"its .bin ({bin_size} bytes)",
        )  # fmt: skip
        tokens = int(arrays.sequence_lengths.sum(dtype=numpy.int64))
        self._append_index(idx_path, arrays, check_dtype=False)
        self._write_filled(tokens, value)

    def _write_filled(self, tokens: int, value: int) -> None:
        """``tokens`` tokens of ``value`` to the ``.bin``, in blocks of ``COPY_BYTES`` tokens at most."""
        fill = numpy.full(max(min(tokens, index_spill.COPY_BYTES), 1), value, dtype=self.dtype)
        for start in range(0, tokens, fill.size):
            self._bin.write(fill[: min(fill.size, tokens - start)])

    def _append_index(self, where: str, arrays: idx_format.IndexArrays, check_dtype: bool = True) -> None:
        """The index entries of a whole shard (``where``), after the sequences so far."""
        if check_dtype and arrays.header.dtype != self.dtype:
            raise StatefulsetError(
                f"{where}: dtype {arrays.header.dtype} differs from {self.dtype} of the merge into "
                f"{self.path_prefix}; shards of different dtypes cannot be merged"
            )
        self._index.append_index(arrays, self.sequence_count)
        self.sequence_count += arrays.sequence_lengths.size
        self.document_count += arrays.document_indices.size - 1

    # -- finishing --------------------------------------------------------------------------
    def close(self) -> None:
        """Write the index and move both files to their final names (bin first, then idx)."""
        if self._closed:
            return
        if self._open_item:
            self.end_document()
        try:
            self._index.spill()
            self._bin.close()
            base = os.path.basename(self.path_prefix)
            self._idx_tmp = temp_path(self._folder, base, "idx")
            with _create(self._idx_tmp) as out:
                hold(self._idx_tmp)
                self._index.write_index(out, self.dtype, self.sequence_count, self.document_count)
                out.flush()
                os.fsync(out.fileno())
            # Remove a previous index first: at no moment can an old .idx pair with a new .bin.
            idx_path, bin_path = self.path_prefix + ".idx", self.path_prefix + ".bin"
            if os.path.lexists(idx_path):
                os.remove(idx_path)
            os.replace(self._bin_tmp, bin_path)
            os.replace(self._idx_tmp, idx_path)
            release(self._idx_tmp)
            self._idx_tmp = None
            _fsync_dir(self._folder)
        except BaseException:
            self.abort()
            raise
        self._release()

    finalize = close

    def abort(self) -> None:
        """Drop everything written so far; the final names are left untouched."""
        if self._closed:
            return
        self._bin.abort()
        for path in (self._bin_tmp, self._idx_tmp):
            if path and os.path.exists(path):
                os.remove(path)
        self._release()

    def _release(self) -> None:
        release(self._bin_tmp)
        release(self._idx_tmp)
        self._index.close()
        self._closed = True
