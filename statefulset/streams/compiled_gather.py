"""Batch assembly in one compiled call: plan every row's token ranges and copy them, widened.

``stream.gather(positions)`` of a few rows was dominated by fixed costs (issue 26): per batch,
tens of numpy calls and Python loops planned the ranges, then the bytes were joined and widened
in two more copies. Here one call of ``kernels.c``'s ``sf_gather_batch`` does it: from the
stream's index arrays (packing megatron: its blend, shuffle, sample and document indices; packing
native: each source's keyed window order, located in the blend by Python), it checks and plans
every row's ranges, copies them from the memory-mapped ``.bin`` into ``out`` (any token dtype),
the ``loss_mask`` beside them when asked, and returns the rows' pieces as
:class:`~statefulset.streams.documents.Pieces` lays them out. With ``document_boundaries`` the same
call writes the document fields from those pieces (``cu_seqlens``, ``max_seqlen``,
``position_ids``: :func:`statefulset.streams.documents.gather_fields`), the values of
``sf_document_fields``, instead of a second call after the pieces went to Python and back.

The stream's constants (addresses, dtypes, sizes of every array it reads) are written once into
a table (:class:`BatchKernel`); each batch writes its positions into this thread's scratch block
(:func:`statefulset.index.compiled.scratch`). Anything the kernel does not take (a remote shard, an
index dtype it does not read, no kernels) leaves the stream on its Python version, which gives the
same arrays; so does anything out of range, and the Python version then names it.
"""

from __future__ import annotations

from typing import Any

import numpy

from statefulset.index import compiled
from statefulset.index.native.permutation import ROUNDS, half_bits
from statefulset.streams.documents import Pieces

# kernels.c: SF_KINDS (tokens), sf_index_at's kinds (index arrays), and the layouts' sizes.
TOKEN_KINDS = {
    numpy.dtype(t): k
    for k, t in enumerate((numpy.uint8, numpy.int8, numpy.int16, numpy.uint16, numpy.int32, numpy.int64))
}
INDEX_KINDS = {numpy.dtype(t): k for k, t in enumerate((numpy.int16, numpy.int32, numpy.int64, numpy.uint32))}
TABLE, SOURCE, BATCH = 6, 18, 4
# kernels.c's SF_FIELDS_*: cu_seqlens, max_seqlen, position_ids, then the code (a request
# then says whether the pieces are kept where the fields were written: FieldTargets.request)
FIELDS = 4
MEGATRON, NATIVE = 0, 1
# Pieces a batch block holds at first, per row (a sample spans ~5 documents of 500 tokens); more
# are made room for when a batch needs them.
_PIECES_PER_ROW = 64
_FLOAT32 = numpy.dtype(numpy.float32)
# What fill() returns when the kernel did not fill the rows: the caller runs the Python version.
REFUSED = object()


class BatchKernel:
    """A stream's table for ``sf_gather_batch``, and the datasets whose ``.bin`` each batch checks after its copy."""

    def __init__(self, table: numpy.ndarray, datasets: list[Any], packing: int) -> None:
        self.table = table  # kept alive: the kernel reads it at this address
        self.address = table.ctypes.data
        self.datasets = datasets
        self.packing = packing
        self.inputs = 1 if packing == MEGATRON else 2  # values per row before the outputs
        self.has_masks = all(d.loss_mask is None or d.loss_mask.mapped_address for d in datasets)
        self.schedule: tuple[numpy.ndarray, numpy.ndarray] | None = None  # native: a data schedule's tables

    def fill(
        self,
        rows_in: list[Any],
        out: numpy.ndarray,
        want: bool,
        masks: numpy.ndarray | None,
        documents: list[int] | None = None,
    ) -> Any:
        """Rows of ``out`` (and ``masks``) from ``rows_in`` (megatron: the positions; native: each row's
        source, then its local sample); their pieces with ``want``, else None; REFUSED when not filled.

        ``documents`` (with ``want``): the document fields' three addresses, a code and whether to keep
        the pieces, as :class:`~statefulset.streams.documents.FieldTargets` holds them: the kernel
        writes the fields in the same call and sets the code (0: written; else the caller computes them
        apart). Where it wrote them and the pieces are not kept, None: they stay in the block."""
        lib = compiled.library()
        kind = TOKEN_KINDS.get(out.dtype)
        if lib is None or kind is None or (masks is not None and not self.has_masks):
            return REFUSED
        to = compiled.writable_address(out)
        to_labels = 0
        if masks is not None:
            to_labels = compiled.writable_address(masks) if masks.dtype == _FLOAT32 else None
        if to is None or to_labels is None:
            return REFUSED
        rows = out.shape[0]
        capacity = _PIECES_PER_ROW * rows
        tail = fields = None
        while True:
            size = BATCH + (self.inputs + 3) * rows + 2 * capacity
            block, address = compiled.scratch(size + FIELDS)
            if documents is not None and want:  # the fields' addresses after the batch's values
                tail, fields = size, address + 8 * size
                block[size : size + FIELDS - 1] = documents[: FIELDS - 1]
            block[0] = rows
            block[1] = kind
            block[2] = capacity
            block[3] = want
            at = BATCH
            for values in rows_in:
                block[at : at + rows] = values
                at += rows
            pieces = lib.sf_gather_batch(self.address, address, to, to_labels or None, fields)
            if pieces >= -1:
                break
            capacity = -pieces - 2  # room for every piece of this batch, then again
        if pieces == -1:
            return REFUSED
        lean = False  # pieces asked for only to compute the fields, which the kernel wrote: not copied out
        if tail is not None:
            code = documents[FIELDS - 1] = int(block[tail + FIELDS - 1])  # type: ignore[index]
            lean = code == 0 and not documents[FIELDS]  # type: ignore[index]
        sources = block[at : at + rows]
        used = self.datasets if len(self.datasets) == 1 else [self.datasets[d] for d in set(sources.tolist())]
        # Never a row of another version of a file (a stat each after the copy, as every gather).
        for dataset in used:
            dataset.bin_file.check_read()
            if masks is not None and dataset.loss_mask is not None:
                dataset.loss_mask.bin_file.check_read()
        if not want or lean:
            return None
        first = at + rows + capacity
        packed = block[first : first + 2 * rows + pieces].copy()
        return Pieces(packed[:rows], packed[2 * rows :], packed[rows : 2 * rows], packed)


def _source_fields(dataset: Any) -> list[int] | None:
    """The fields every source has (kernels.c, SF_SRC_TOKENS ... SF_SRC_ITEMSIZE), or None when not local."""
    tokens, kind = dataset.mapped_address, TOKEN_KINDS.get(dataset.dtype)
    if not tokens or kind is None:
        return None
    mask = 0
    if dataset.loss_mask is not None:
        mask = dataset.loss_mask.mapped_address or 0  # remote: masked batches stay on the Python version
    pointers = dataset.sequence_pointers
    if pointers.dtype != numpy.int64 or not pointers.flags.c_contiguous:
        return None
    itemsize = dataset.dtype.itemsize
    return [tokens, kind, dataset.num_tokens, mask, pointers.ctypes.data, len(dataset), itemsize]


def _index(array: numpy.ndarray) -> tuple[int, int] | None:
    """(address, kind) of an index array the kernel reads, or None."""
    kind = INDEX_KINDS.get(array.dtype)
    if kind is None or not array.flags.c_contiguous:
        return None
    return (array.ctypes.data if array.size else 0), kind


def megatron_kernel(sources: list[Any], blend: dict[str, numpy.ndarray] | None, length: int, width: int) -> Any:
    """The BatchKernel of a packing megatron stream (GPTSources, optionally blended), or None."""
    header = [len(sources), 0, 0, length, width, MEGATRON]
    if blend is not None:
        index, sample = _index(blend["dataset_index"]), _index(blend["dataset_sample_index"])
        if index is None or sample is None or index[1] != 0 or sample[1] != 2:
            return None
        header[1], header[2] = index[0], sample[0]
    fields = []
    for source in sources:
        common = _source_fields(source.dataset)
        shuffle, sample, document = (
            _index(a) for a in (source.shuffle_index, source.sample_index, source.document_index)
        )
        lengths = source.dataset.sequence_lengths
        if common is None or shuffle is None or sample is None or document is None or lengths.dtype != numpy.int32:
            return None
        if sample[1] not in (1, 2) or source.sample_index.ndim != 2 or not lengths.flags.c_contiguous:
            return None
        row = [*common, *shuffle, source.shuffle_index.size, *sample, *document, source.document_index.size]
        row += [lengths.ctypes.data, source.sample_index.shape[0]]
        fields.append(row + [0] * (SOURCE - len(row)))
    table = numpy.array(header + [v for row in fields for v in row], dtype=numpy.int64)
    return BatchKernel(table, [s.dataset for s in sources], MEGATRON)


def native_kernel(sources: list[Any], width: int, schedule: Any = None) -> Any:
    """The BatchKernel of a packing native stream (WindowSources), or None. With ``schedule`` (a data
    schedule's ``(nodes, stages)``: every stage's blend tree as ``BlendSchedule.flat_nodes`` gives
    them, leaves naming sources and children numbered in the whole list, and per stage its start, its
    root and every source's offset), the kernel locates each position itself: fill then takes
    ``[0, positions]``."""
    fields = []
    for source in sources:
        common = _source_fields(source.dataset)
        if common is None:
            return None
        lo, hi = source.sequence_range
        common[5] = hi - lo  # the split's sequences, from sequence lo on
        key = int(source.key)
        key = key - (1 << 64) if key >= 1 << 63 else key  # the kernel reads it back as uint64
        row = [*common, source.windows, half_bits(source.windows), key, ROUNDS, source.first_token, lo]
        fields.append(row + [0] * (SOURCE - len(row)))
    header = [len(sources), 0, 0, 0, width, NATIVE]
    arrays = None
    if schedule is not None:
        nodes, stages = schedule
        arrays = (
            numpy.array([len(nodes), len(stages)] + [v for row in stages for v in row], dtype=numpy.int64),
            numpy.array(nodes, dtype=numpy.int64).reshape(-1, 3),
        )
        header[1], header[2] = arrays[0].ctypes.data, arrays[1].ctypes.data
    table = numpy.array(header + [v for row in fields for v in row], dtype=numpy.int64)
    kernel = BatchKernel(table, [s.dataset for s in sources], NATIVE)
    kernel.schedule = arrays  # kept alive: the kernel reads them at their addresses
    return kernel
