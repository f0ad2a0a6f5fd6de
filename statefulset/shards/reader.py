"""``IndexedDataset``: the checked, memory-mapped reader of Megatron bin/idx shards."""

from __future__ import annotations

import operator
import os
from typing import Any

import numpy

from statefulset.errors import SequenceIndexError, StatefulsetError
from statefulset.shards import idx_format
from statefulset.shards.facts import once
from statefulset.shards.index_copies import index_copy
from statefulset.shards.storage import ShardFile, local_path, map_file


def prefix_str(path_prefix: str | os.PathLike[str]) -> str:
    prefix = os.fspath(path_prefix)
    for ext in (".bin", ".idx"):
        if prefix.endswith(ext):
            raise StatefulsetError(f"{prefix}: give the prefix without extension (for example {prefix[: -len(ext)]!r})")
    return prefix


# Average tokens per range above which slice copies beat one vectorised gather (measured, see gather()).
_GATHER_LOOP_MIN_RUN = 64
# Up to this many ranges, gather plans on Python ints (a batch of B samples is about B·(1 + S/mean length)).
_GATHER_LIST_MAX = 4096


def _int_list(values: Any) -> list[int]:
    if isinstance(values, numpy.ndarray):
        if values.dtype.kind not in "iu":
            raise StatefulsetError(f"token ranges must be integers, got {values.dtype}")
        return values.reshape(-1).tolist()
    return list(map(operator.index, values))


class IndexedDataset:
    """Random access to the sequences of ``prefix.bin`` / ``prefix.idx``.

    ``len(ds)`` is the number of sequences and ``ds[i]`` the tokens of sequence ``i``, a
    read-only numpy array in the file's dtype (``(tokens, mode)`` when ``multimodal``). As in
    megatron-core, the reader must be told whether the index carries sequence modes.

    Opening checks the whole index (see :func:`idx_format.check_all`) unless ``validate`` is
    False, which keeps only the O(1) checks (header, counts, file sizes). Arrays handed out
    stay valid after the dataset is gone. Pickling sends only the path, so worker processes
    reopen the files instead of copying them.

    Paths may be fsspec URLs (``s3://``, ``gs://``, ``memory://`` ...; ``file://`` is
    memory-mapped). A remote ``.idx`` is used from this node's local copy
    (:mod:`statefulset.shards.index_copies`); a remote ``.bin`` is read by ranged requests, one
    batched, concurrent call per :meth:`gather` (:mod:`statefulset.shards.remote`).
    """

    def __init__(
        self,
        path_prefix: str | os.PathLike[str],
        multimodal: bool = False,
        *,
        storage_options: dict[str, Any] | None = None,
        validate: bool = True,
        facts_dir: str | None = None,
    ) -> None:
        self.path_prefix = prefix_str(path_prefix)
        self.multimodal = bool(multimodal)
        self.storage_options = storage_options
        self.facts_dir = facts_dir  # where "this version passed the full check" is remembered
        # The loss-mask shard read along with this one (statefulset.shards.loss_masks), set by the stream opening it.
        self.loss_mask: IndexedDataset | None = None
        self._open(validate)

    def _open(self, validate: bool) -> None:
        idx_path, bin_path = self.path_prefix + ".idx", self.path_prefix + ".bin"
        kind = "verified-multimodal" if self.multimodal else "verified"
        self._idx_file: ShardFile | None = None
        if local_path(idx_path) is not None:
            idx_file = self._idx_file = ShardFile(idx_path, self.storage_options)
            self._bin_file = ShardFile(bin_path, self.storage_options)
            buffer, idx_size, copy = idx_file.map(), idx_file.size, None
        else:
            # Remote: the index is read at random by every lookup, so it is used from this
            # node's local copy, which also remembers that it passed the full check.
            self._bin_file = ShardFile(bin_path, self.storage_options)
            copy = index_copy(idx_path, self.storage_options)
            buffer = map_file(copy.path)
            idx_size = len(buffer)

        def decode(full: bool) -> idx_format.IndexArrays:
            return idx_format.decode_index(
                buffer,
                idx_size=idx_size,
                bin_size=self._bin_file.size,
                multimodal=self.multimodal,
                path=idx_path,
                bin_path=bin_path,
                full=full,
            )

        arrays = None
        if validate and copy is not None and not copy.verified:
            arrays = decode(full=True)
            copy.mark_verified()
        elif validate and copy is None:
            # A version that passed every check once needs only the O(1) checks again; processes
            # opening it at once share the full check (one checks, the others wait).
            def full_check() -> bool:
                nonlocal arrays
                arrays = decode(full=True)
                # "Passed" is recorded for the version at the path now: it must be the one decoded.
                self.check_index_unchanged()
                return True

            once(kind, (idx_path, bin_path), full_check, "checking this index in full", self.facts_dir)
        if arrays is None:
            arrays = decode(full=False)
        self._arrays = arrays
        # The content digest of a remote index comes free with its local copy.
        self.known_digest: str | None = copy.digest if copy is not None else None
        self.dtype: numpy.dtype = arrays.header.dtype
        self._itemsize = self.dtype.itemsize
        self._bin_buffer = self._bin_file.map() if self._bin_file.is_local else None

    def check_index_unchanged(self) -> None:
        """A StatefulsetError naming the ``.idx`` when the file at its path is no longer the version this
        dataset mapped (replaced or rewritten since): what was hashed or checked by path afterwards
        would not be what this dataset reads. A remote index is read from its local copy, whose
        digest comes with it: nothing to do."""
        if self._idx_file is not None:
            self._idx_file.check_unchanged()

    @property
    def bin_file(self) -> ShardFile:
        """The ``.bin`` this dataset reads (its size, ranged reads)."""
        return self._bin_file

    @property
    def bin_version(self) -> str:
        """The ``.bin``'s version as opened: inode, size and mtime locally, ETag and size remotely."""
        return self._bin_file.version

    def check_unchanged(self) -> None:
        """A StatefulsetError naming the ``.bin`` when it was replaced or rewritten since it was opened."""
        self._bin_file.check_unchanged()

    @property
    def is_remote(self) -> bool:
        """True when the ``.bin`` is on object storage (read by ranged requests)."""
        return not self._bin_file.is_local

    # -- pickling: the path, never the data ------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {
            "path_prefix": self.path_prefix,
            "multimodal": self.multimodal,
            "storage_options": self.storage_options,
            "facts_dir": self.facts_dir,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._open(validate=False)

    # -- index arrays ------------------------------------------------------------------------
    @property
    def sequence_lengths(self) -> numpy.ndarray:
        """int32 [S]: tokens per sequence."""
        return self._arrays.sequence_lengths

    @property
    def sequence_pointers(self) -> numpy.ndarray:
        """int64 [S]: byte offset of each sequence in the ``.bin``."""
        return self._arrays.sequence_pointers

    @property
    def document_indices(self) -> numpy.ndarray:
        """int64 [D+1]: sequence boundaries of the documents, from 0 to S."""
        return self._arrays.document_indices

    @property
    def sequence_modes(self) -> numpy.ndarray | None:
        """int8 [S] for multimodal indices, else None."""
        return self._arrays.sequence_modes

    @property
    def num_documents(self) -> int:
        return self._arrays.header.document_count - 1

    @property
    def num_tokens(self) -> int:
        return self._bin_file.size // self._itemsize

    def token_span(self, first: int, stop: int) -> tuple[int, int]:
        """Token offsets in the ``.bin`` where sequences ``[first, stop)`` begin and end: O(1), since
        consecutive sequences are consecutive in the file. ``(0, 0)`` for no sequences."""
        if stop <= first:
            return 0, 0
        begin = int(self.sequence_pointers[first]) // self._itemsize
        end = int(self.sequence_pointers[stop - 1]) // self._itemsize + int(self.sequence_lengths[stop - 1])
        return begin, end

    @property
    def index_nbytes(self) -> int:
        return self._arrays.header.index_size

    def __len__(self) -> int:
        return self._arrays.header.sequence_count

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.path_prefix!r}, sequences={len(self)}, documents={self.num_documents}, "
            f"tokens={self.num_tokens}, dtype={self.dtype})"
        )

    # -- reads ---------------------------------------------------------------------------------
    def _sequence(self, idx: Any) -> int:
        try:
            i = int(idx)
        except TypeError:
            raise TypeError(f"sequence index must be an int or a slice, not {type(idx).__name__}") from None
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise SequenceIndexError(f"{self.path_prefix}: sequence {idx} out of range for {n} sequences")
        return i

    def _read(self, byte_offset: int, count: int) -> numpy.ndarray:
        if self._bin_buffer is not None:
            return numpy.frombuffer(self._bin_buffer, self.dtype, count=count, offset=byte_offset)
        return numpy.frombuffer(self._bin_file.read(byte_offset, count * self._itemsize), self.dtype)

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise StatefulsetError(f"{self.path_prefix}: slices must have step 1, got {step}")
            if start >= stop:
                return []
            lengths = self.sequence_lengths[start:stop]
            tokens = self._read(int(self.sequence_pointers[start]), int(lengths.sum(dtype=numpy.int64)))
            parts = numpy.split(tokens, numpy.cumsum(lengths)[:-1])
            if self.multimodal:
                return [(p, int(m)) for p, m in zip(parts, self.sequence_modes[start:stop], strict=True)]
            return parts
        i = self._sequence(idx)
        tokens = self._read(int(self.sequence_pointers[i]), int(self.sequence_lengths[i]))
        if self.multimodal:
            return tokens, int(self.sequence_modes[i])
        return tokens

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> numpy.ndarray:
        """Tokens ``[offset, offset+length)`` of sequence ``idx`` (megatron-core's ``get``)."""
        i = self._sequence(idx)
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise StatefulsetError(
                f"{self.path_prefix}: tokens [{offset}, {offset + length}) are outside sequence {i} of {size} tokens"
            )
        return self._read(int(self.sequence_pointers[i]) + offset * self._itemsize, length)

    def read_range(self, token_offset: int, count: int) -> numpy.ndarray:
        """``count`` tokens of the ``.bin`` from token ``token_offset``, across sequence boundaries."""
        if token_offset < 0 or count < 0 or token_offset + count > self.num_tokens:
            raise StatefulsetError(
                f"{self.path_prefix}.bin: tokens [{token_offset}, {token_offset + count}) are outside "
                f"[0, {self.num_tokens})"
            )
        return self._read(token_offset * self._itemsize, count)

    def gather(self, token_starts: Any, lengths: Any, out: numpy.ndarray) -> None:
        """Copy the token ranges ``[start, start + length)`` of the ``.bin``, back to back, into flat ``out``;
        a StatefulsetError naming the ``.bin`` if it was rewritten in place meanwhile (one ``stat`` after
        the copy: :meth:`ShardFile.check_read`), so that ``out`` never holds tokens of another version."""
        self._copy_ranges(token_starts, lengths, out)
        self._bin_file.check_read()

    def _copy_ranges(self, token_starts: Any, lengths: Any, out: numpy.ndarray) -> None:
        """:meth:`gather`'s copy.

        The hot path of batch assembly (a batch is tens of ranges). Up to ``_GATHER_LIST_MAX``
        ranges are planned on Python ints, which beats numpy's per-call overhead at that size:
        long ranges are sliced out of the mapped file as ``memoryview``s, joined in one call and
        converted to ``out``'s dtype in one copy; many short ranges take one vectorised gather.
        More ranges than that are checked and planned with numpy.
        """
        count = len(token_starts)
        if count != len(lengths):
            raise StatefulsetError(f"{self.path_prefix}: {count} range starts but {len(lengths)} lengths")
        if count > _GATHER_LIST_MAX:
            self._gather_arrays(
                numpy.asarray(token_starts, dtype=numpy.int64).reshape(-1),
                numpy.asarray(lengths, dtype=numpy.int64).reshape(-1),
                out,
            )
            return
        starts, counts = _int_list(token_starts), _int_list(lengths)
        total = sum(counts)
        if total != out.shape[0]:
            raise StatefulsetError(f"{self.path_prefix}: ranges hold {total} tokens, the output {out.shape[0]}")
        if not count:
            return
        if min(starts) < 0 or min(counts) < 0:
            raise StatefulsetError(f"{self.path_prefix}.bin: a token range falls outside [0, {self.num_tokens})")
        if self._bin_buffer is not None and count * _GATHER_LOOP_MIN_RUN <= total:
            # Slicing the bytes clips at the end of the file, so a range past it makes the joined
            # bytes come up short: that is the upper bounds check.
            item, view = self._itemsize, self._bytes
            joined = b"".join([view[s * item : (s + n) * item] for s, n in zip(starts, counts, strict=True)])
            if len(joined) != total * item:
                raise StatefulsetError(f"{self.path_prefix}.bin: a token range falls outside [0, {self.num_tokens})")
            out[:] = numpy.frombuffer(joined, self.dtype)
            return
        if max(map(operator.add, starts, counts)) > self.num_tokens:
            raise StatefulsetError(f"{self.path_prefix}.bin: a token range falls outside [0, {self.num_tokens})")
        if self._bin_buffer is None:
            self._gather_remote(starts, counts, out)
        else:
            self._gather_short(numpy.array(starts, dtype=numpy.int64), numpy.array(counts, dtype=numpy.int64), out)

    def _gather_arrays(self, starts: numpy.ndarray, counts: numpy.ndarray, out: numpy.ndarray) -> None:
        total = int(counts.sum())
        if total != out.shape[0]:
            raise StatefulsetError(f"{self.path_prefix}: ranges hold {total} tokens, the output {out.shape[0]}")
        if starts.size and (
            int(starts.min()) < 0 or int(counts.min()) < 0 or int((starts + counts).max()) > self.num_tokens
        ):
            raise StatefulsetError(f"{self.path_prefix}.bin: a token range falls outside [0, {self.num_tokens})")
        if self._bin_buffer is None:
            self._gather_remote(starts.tolist(), counts.tolist(), out)
        elif starts.size * _GATHER_LOOP_MIN_RUN <= total:
            tokens, at = self._tokens, 0
            for s, n in zip(starts.tolist(), counts.tolist(), strict=True):
                out[at : at + n] = tokens[s : s + n]
                at += n
        else:
            self._gather_short(starts, counts, out)

    def _gather_remote(self, starts: list[int], counts: list[int], out: numpy.ndarray) -> None:
        # One call for the whole batch: the storage layer coalesces and overlaps the requests.
        item = self._itemsize
        parts = self._bin_file.read_ranges([s * item for s in starts], [n * item for n in counts])
        out[:] = numpy.frombuffer(b"".join(parts), self.dtype)

    def _gather_short(self, starts: numpy.ndarray, counts: numpy.ndarray, out: numpy.ndarray) -> None:
        # Position i of out reads token (start of its range) + (i - first output slot of its range).
        shift = numpy.repeat(starts - (numpy.cumsum(counts) - counts), counts)
        out[:] = self._tokens[shift + numpy.arange(out.shape[0], dtype=numpy.int64)]

    @property
    def mapped_address(self) -> int | None:
        """The address of the local ``.bin``'s memory map (``num_tokens`` values of ``dtype``), for a
        compiled kernel to copy ranges from; None when remote. The map lives as long as this dataset
        (the array view behind the address keeps it open); check a copy with ``bin_file.check_read()``."""
        found = self.__dict__.get("_mapped_address")
        if found is None and self._bin_buffer is not None:
            found = self._mapped_address = self._tokens.ctypes.data
        return found

    @property
    def _tokens(self) -> numpy.ndarray:
        view = self.__dict__.get("_token_view")
        if view is None:
            view = self._token_view = numpy.frombuffer(self._bin_buffer, self.dtype)
        return view

    @property
    def _bytes(self) -> memoryview:
        view = self.__dict__.get("_byte_view")
        if view is None:
            view = self._byte_view = memoryview(self._bin_buffer).cast("B")
        return view

    def document(self, doc: int) -> list[numpy.ndarray]:
        """The sequences of document ``doc``."""
        n = self.num_documents
        d = int(doc) + n if int(doc) < 0 else int(doc)
        if not 0 <= d < n:
            raise SequenceIndexError(f"{self.path_prefix}: document {doc} out of range for {n} documents")
        return self[int(self.document_indices[d]) : int(self.document_indices[d + 1])]

    @staticmethod
    def exists(path_prefix: str | os.PathLike[str]) -> bool:
        prefix = os.fspath(path_prefix)
        return os.path.exists(prefix + ".idx") and os.path.exists(prefix + ".bin")
