"""``packing: native``: every sample computed from its position; no index, O(1) memory, any ``p >= 0``.

Windows and their keyed order are :mod:`statefulset.index.native.windows`, blends
:mod:`statefulset.index.native.blend_tree`. ``len(stream)`` is one pass over the windows.
"""

from __future__ import annotations

from typing import Any

import numpy

from statefulset.errors import StatefulsetError
from statefulset.index import compiled
from statefulset.index.native.keys import derive_key
from statefulset.index.native.windows import WindowSource
from statefulset.spec.model import DatasetSpec
from statefulset.spec.splits import SPLITS
from statefulset.streams.base import BlendedStream, OpenedSources
from statefulset.streams.compiled_gather import REFUSED, native_kernel
from statefulset.streams.documents import Pieces, within_rows
from statefulset.streams.label_masks import gather_ranges


class WindowFiller:
    def __init__(self, source: WindowSource) -> None:
        self.source = source
        lo, hi = source.sequence_range
        self._sequence_starts = source.dataset.sequence_pointers[lo:hi]  # bytes, mapped: searched, never copied
        self._pointers_address: int | None = None

    def fill(
        self, local: numpy.ndarray, out: numpy.ndarray, want: bool = False, masks: numpy.ndarray | None = None
    ) -> Pieces | None:
        starts = self.source.window_starts(local)
        lengths = numpy.full(starts.shape, out.shape[1], dtype=numpy.int64)
        gather_ranges(self.source.dataset, starts, lengths, out, masks)
        return self._pieces(starts, out.shape[1]) if want else None

    def _pieces(self, starts: numpy.ndarray, width: int, native: bool | None = None) -> Pieces:
        """The sequences each window crosses: cut where a sequence starts strictly inside it."""
        item = self.source.dataset.dtype.itemsize
        lib = compiled.pick(native)
        if lib is not None and self._sequence_starts.flags.c_contiguous:
            rows = starts.size
            # One block: the starts, then each row's piece count, the rows' used tokens (width), then
            # the pieces (at most width per row); reading an array's address costs ~1.7 µs, so the
            # kernel gets two. Counts, used and pieces are then Pieces.packed as they are.
            block = numpy.empty(rows * (width + 3), dtype=numpy.int64)
            block[:rows] = starts
            block[2 * rows : 3 * rows] = width
            address = block.ctypes.data
            if self._pointers_address is None:
                self._pointers_address = compiled.address(self._sequence_starts, numpy.int64)
            written = lib.sf_window_pieces(
                self._pointers_address, self._sequence_starts.size, item, address, rows, width,
                address + 8 * rows, address + 24 * rows,
            )  # fmt: skip
            if written < 0:
                raise StatefulsetError(f"internal: the window pieces kernel refused width {width} or starts {starts}")
            packed = block[rows : 3 * rows + written]
            return Pieces(packed[:rows], packed[2 * rows :], packed[rows : 2 * rows], packed)
        first = numpy.searchsorted(self._sequence_starts, starts * item, side="right")
        stop = numpy.searchsorted(self._sequence_starts, (starts + width) * item, side="left")
        cuts = stop - first
        rows = starts.size
        # Per row: 0, the cut points, width; its pieces are the differences (empty sequences dropped).
        marks = numpy.empty(int(cuts.sum()) + 2 * rows, dtype=numpy.int64)
        row_first = numpy.cumsum(cuts + 2) - (cuts + 2)
        marks[row_first] = 0
        marks[row_first + cuts + 1] = width
        inner = numpy.repeat(row_first + 1, cuts) + within_rows(cuts)
        at = numpy.repeat(first, cuts) + within_rows(cuts)
        marks[inner] = self._sequence_starts[at] // item - numpy.repeat(starts, cuts)
        lengths = numpy.diff(marks)
        row = numpy.repeat(numpy.arange(rows, dtype=numpy.int64), cuts + 2)[:-1]
        keep = (lengths > 0) & (row == numpy.repeat(numpy.arange(rows, dtype=numpy.int64), cuts + 2)[1:])
        counts = numpy.bincount(row[keep], minlength=rows).astype(numpy.int64)
        return Pieces(counts, lengths[keep], numpy.full(rows, width, dtype=numpy.int64))


class NativeStream(BlendedStream):
    """Keyed windows of each source, blended position by position; nothing is built or stored."""

    def __init__(self, spec, split, identity, sources: list[WindowSource], weights: list[float]):
        fillers = [WindowFiller(s) for s in sources]
        super().__init__(spec, split, identity, sources, fillers, weights, one_pass=split != "train")

    def _batch_kernel(self) -> Any:
        return native_kernel(self.sources, self.seq_length + 1)

    def _kernel_rows(self, kernel: Any, p: numpy.ndarray) -> Any:
        if self.schedule is None and self.unbounded:  # the kernel refuses a negative position
            return [0, p]
        if int(p.min()) < 0 or (not self.unbounded and int(p.max()) >= len(self)):
            return REFUSED  # the Python version names the position
        return [0, p] if self.schedule is None else list(self.locate(p))


def open_native(spec: DatasetSpec, split: str, identity: dict[str, Any], opened: OpenedSources) -> NativeStream:
    """Keyed windows of each source; nothing is built."""
    with spec.blame("seq_length"):
        sources = [
            WindowSource(ds, r, spec.seq_length, derive_key(spec.seed, i, SPLITS.index(split)))
            for i, (ds, r) in enumerate(zip(opened.datasets, opened.ranges, strict=True))
        ]
    weights = [float(w) for _, w in opened.live] if opened.weighted else [float(s.windows) for s in sources]
    return NativeStream(spec, split, identity, sources, weights)
