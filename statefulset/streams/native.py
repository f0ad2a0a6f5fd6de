"""``packing: native``: every sample computed from its position; no index, O(1) memory, any ``p >= 0``.

Windows and their keyed order are :mod:`statefulset.index.native.windows`, blends
:mod:`statefulset.index.native.blend_tree`. ``len(stream)`` is one pass over the windows.
"""

from __future__ import annotations

from typing import Any

import numpy

from statefulset.index.native.blend_tree import BlendSchedule
from statefulset.index.native.keys import derive_key
from statefulset.index.native.windows import WindowSource
from statefulset.spec.model import DatasetSpec
from statefulset.spec.splits import SPLITS
from statefulset.streams.base import OpenedSources, SampleStream, _fill_by_source


class _WindowFiller:
    def __init__(self, source: WindowSource) -> None:
        self.source = source

    def fill(self, local: numpy.ndarray, out: numpy.ndarray) -> None:
        starts = self.source.window_starts(local)
        lengths = numpy.full(starts.shape, out.shape[1], dtype=numpy.int64)
        self.source.dataset.gather(starts, lengths, out.reshape(-1))


class NativeStream(SampleStream):
    """Keyed windows of each source, blended position by position; nothing is built or stored."""

    def __init__(self, spec, split, identity, sources: list[WindowSource], weights: list[float]):
        super().__init__(spec, split, identity, sum(s.windows for s in sources), unbounded=True)
        self.sources = sources
        self.weights = weights
        self.schedule = BlendSchedule(weights) if len(sources) > 1 else None
        self._fillers = [_WindowFiller(s) for s in sources]

    def _fill(self, positions: numpy.ndarray, out: numpy.ndarray) -> None:
        if self.schedule is None:
            self._fillers[0].fill(positions, out)
            return
        which, local = self.schedule.locate(positions)
        _fill_by_source(which, local, out, self._fillers)


def open_native(spec: DatasetSpec, split: str, identity: dict[str, Any], opened: OpenedSources) -> NativeStream:
    """Keyed windows of each source; nothing is built."""
    with spec.blame("seq_length"):
        sources = [
            WindowSource(ds, r, spec.seq_length, derive_key(spec.seed, i, SPLITS.index(split)))
            for i, (ds, r) in enumerate(zip(opened.datasets, opened.ranges, strict=True))
        ]
    weights = [float(w) for _, w in opened.live] if opened.weighted else [float(s.windows) for s in sources]
    return NativeStream(spec, split, identity, sources, weights)
