"""A data schedule's train stream: each stage's mixture over its positions, each source keeping its own place.

Stage ``k`` covers positions ``[start_k, start_{k+1})``; position ``p`` inside it is position
``q = p - start_k`` of the stage's blend tree (:mod:`statefulset.index.native.blend_tree`), which
names a source and ``r``, the source's ``r``-th draw *within the stage*. The source then serves its
local sample ``offset_k[source] + r``, where ``offset_k`` counts its draws in all earlier stages:
``count_j(source, start_{j+1} - start_j)`` summed over ``j < k``, each an O(log K) walk down stage
``j``'s tree. So a source's samples continue its own epoch order across any number of stage
changes: no repeat, no skip, whatever the weights did. Opening is O(stages x sources); reading a
position is O(log stages + log K).

Sources are keyed by their content digest (of the ``.idx`` and the ``.bin``:
:mod:`statefulset.shards.digests`), not their place in a list, so adding a source to a later stage
changes nothing for the others, and two shards with identical ``.idx`` files get their own orders.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from typing import Any

import numpy

from statefulset.index.native.blend_tree import BlendSchedule
from statefulset.index.native.keys import derive_key
from statefulset.index.native.windows import WindowSource
from statefulset.spec.splits import SPLITS
from statefulset.streams.base import OpenedSources, SampleStream, epoch_sizes, fill_by_source, samples_per_epoch
from statefulset.streams.bestfit import BESTFIT_VERSION, BinFiller, bestfit_sources, check_pad_id
from statefulset.streams.compiled_gather import REFUSED, native_kernel
from statefulset.streams.documents import Pieces
from statefulset.streams.members import members_of, trim
from statefulset.streams.native import WindowFiller


def stage_digest(start: int, sources: list[tuple[str, tuple[int, int], float]]) -> str:
    """What a stage's samples depend on: its start and each source's content digest, split range and weight."""
    text = json.dumps([start, [[d, list(r), w] for d, r, w in sources]])
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class _Locator:
    """``locate(positions) -> (source, local)`` over the whole schedule: the interface explain() uses."""

    def __init__(self, stream: StagedStream) -> None:
        self.stream = stream

    def locate(self, positions: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
        return self.stream.locate(positions)


class StagedStream(SampleStream):
    """Positions split into stages, each a blend over some of the sources; sources count their own draws."""

    def __init__(
        self,
        spec: Any,
        split: str,
        identity: dict[str, Any],
        sources: list[Any],
        fillers: list[Any],
        prefixes: list[str],
        stages: list[tuple[int, list[tuple[int, float]]]],
        padded: bool = False,
    ) -> None:
        super().__init__(spec, split, identity, sum(s.windows for s in sources), unbounded=True)
        self.sources = sources
        self.prefixes = prefixes
        self._fillers = fillers
        self.padded = padded
        self.starts = numpy.array([start for start, _ in stages], dtype=numpy.int64)
        self._start_list = self.starts.tolist()
        self.stage_sources = [[s for s, _ in members] for _, members in stages]
        self.stage_weights = [[w for _, w in members] for _, members in stages]
        self.schedules = [BlendSchedule(w) if len(w) > 1 else None for w in self.stage_weights]
        # offsets[k, s]: source s's draws before stage k (the place it continues from).
        self.offsets = numpy.zeros((len(stages), len(sources)), dtype=numpy.int64)
        for k in range(1, len(stages)):
            drawn = self._stage_counts(k - 1, int(self.starts[k] - self.starts[k - 1]))
            self.offsets[k] = self.offsets[k - 1] + drawn
        self.schedule = _Locator(self)  # what provenance and the overview call
        self._offset_rows = self.offsets.tolist()
        # One stage of one source read from its first sample: a position is that source's local sample.
        first = self.stage_sources[0][0]
        one = len(stages) == 1 and self.schedules[0] is None and self._offset_rows[0][first] == self._start_list[0]
        self._only_source = first if one else None

    def _batch_kernel(self) -> Any:  # packing native; bestfit stays on its Python version
        return None if self.padded else native_kernel(self.sources, self.seq_length + 1, self._schedule_tables())

    def _kernel_rows(self, kernel: Any, p: numpy.ndarray) -> Any:
        if self._only_source is not None:  # the kernel refuses a negative position
            return [self._only_source, p]
        if kernel.schedule is not None:  # the kernel locates the positions (and refuses p < 0)
            return [0, p]
        if int(p.min()) < 0:
            return REFUSED  # the Python version names it
        return list(self.locate(p))

    def _schedule_tables(self) -> tuple[list[tuple[int, int, int]], list[list[int]]]:
        """The schedule for the batch kernel to locate positions (compiled_gather.native_kernel): every
        stage's blend tree (a lone source is a tree of one leaf), leaves naming the stream's sources and
        children numbered in the whole list; per stage its start, its root and the sources' offsets."""
        nodes: list[tuple[int, int, int]] = []
        stages = []
        for k, schedule in enumerate(self.schedules):
            members, root = self.stage_sources[k], len(nodes)
            flat = [(-1, 0, 0)] if schedule is None else schedule.flat_nodes()
            nodes += [(share, left + root, right + root) if share >= 0 else (-1 - members[-1 - share], 0, 0)
                      for share, left, right in flat]  # fmt: skip
            stages.append([self._start_list[k], root, *self._offset_rows[k]])
        return nodes, stages

    @property
    def weights(self) -> list[float]:
        """The last stage's weight of every source (0 for sources it does not read)."""
        out = [0.0] * len(self.sources)
        for s, w in zip(self.stage_sources[-1], self.stage_weights[-1], strict=True):
            out[s] = w
        return out

    @property
    def epoch_sizes(self) -> dict[str, int]:
        """Samples in one epoch of each source, by prefix."""
        return epoch_sizes(self.sources)

    @property
    def samples_per_epoch(self) -> int:
        """Samples in one epoch of the only source (epoch e is positions [e*n, (e+1)*n) when one stage reads it)."""
        return samples_per_epoch(self.sources)

    def _stage_counts(self, k: int, n: int) -> numpy.ndarray:
        """Draws of every source among the first ``n`` positions of stage ``k``."""
        out = numpy.zeros(len(self.sources), dtype=numpy.int64)
        schedule = self.schedules[k]
        counts = [n] if schedule is None else schedule.counts(n)
        for s, c in zip(self.stage_sources[k], counts, strict=True):
            out[s] += c
        return out

    def stage_of(self, position: int) -> int:
        """The stage governing ``position``."""
        return bisect.bisect_right(self._start_list, position) - 1  # on ints: no numpy call per read

    def _locate(self, p: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
        """``(source, local sample)`` of every position, flattened (:meth:`SampleStream.locate` keeps the last)."""
        p = p.reshape(-1)
        if len(self._start_list) == 1 and self.schedules[0] is None:  # one stage, one source: every batch
            source = self.stage_sources[0][0]
            local = p + (self._offset_rows[0][source] - self._start_list[0])
            return numpy.full(p.size, source, dtype=numpy.int64), local
        stage = numpy.searchsorted(self.starts, p, side="right") - 1
        which = numpy.empty(p.size, dtype=numpy.int64)
        local = numpy.empty(p.size, dtype=numpy.int64)
        for k in sorted(set(stage.tolist())):
            rows = numpy.flatnonzero(stage == k)
            q = p[rows] - self.starts[k]
            schedule = self.schedules[k]
            if schedule is None:
                member, r = numpy.zeros(q.size, dtype=numpy.int64), q
            else:
                member, r = schedule.locate(q)
            source = numpy.asarray(self.stage_sources[k], dtype=numpy.int64)[member]
            which[rows] = source
            local[rows] = self.offsets[k, source] + r
        return which, local

    def source_positions(self, position: int) -> dict[str, int]:
        """For each source prefix: how many of its samples the positions ``[0, position)`` drew."""
        return dict(zip(self.prefixes, self.source_counts(position), strict=True))

    def source_counts(self, position: int) -> list[int]:
        """:meth:`source_positions` as a list in source order, on Python ints (what ``metrics()`` reads)."""
        p = int(position)
        if p < 0:
            raise ValueError(f"source_positions: position must be non-negative, got {p}")
        k = bisect.bisect_right(self._start_list, p) - 1  # stage_of, inlined: metrics() reads this every step
        n = p - self._start_list[k]
        schedule = self.schedules[k]
        out = self._offset_rows[k][:]
        for s, c in zip(self.stage_sources[k], [n] if schedule is None else schedule.counts(n), strict=True):
            out[s] += c
        return out

    def source_counts_many(self, positions: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
        """:meth:`source_counts` at each of ``positions`` (non-negative int64) at once, and the stage
        of each: ``(counts (len(positions), sources), stages)`` (one vectorised walk per stage)."""
        p = numpy.asarray(positions, dtype=numpy.int64)
        stages = numpy.searchsorted(self.starts, p, side="right") - 1
        out = numpy.empty((p.size, len(self.sources)), dtype=numpy.int64)
        for k in numpy.unique(stages).tolist():
            rows = numpy.flatnonzero(stages == k)
            n = p[rows] - self._start_list[k]
            schedule = self.schedules[k]
            drawn = n[:, None] if schedule is None else schedule.counts_many(n)
            block = numpy.repeat(self.offsets[k][None, :], rows.size, axis=0)
            numpy.add.at(block, (slice(None), self.stage_sources[k]), drawn)  # a source listed twice adds twice
            out[rows] = block
        return out, stages

    def _fill(
        self, positions: numpy.ndarray, out: numpy.ndarray, want: bool, masks: numpy.ndarray | None = None
    ) -> Pieces | None:
        which, local = self.locate(positions)
        return fill_by_source(which, local, out, self._fillers, want, masks)

    def __repr__(self) -> str:
        return f"StagedStream({self.split}, seq_length={self.seq_length}, {len(self.starts)} stages, unbounded)"


def open_staged(spec: Any, split: str, identity: dict[str, Any], opened: OpenedSources) -> StagedStream:
    """The train stream of a spec with ``stages``: its sources (every prefix any stage names), keyed by content."""
    prefixes = [prefix for prefix, _ in opened.live]
    # A source's key comes from its content digest, not from its place among the prefixes: adding a
    # source to a later stage leaves every other source's order as it was.
    keys = [derive_key(spec.seed, int(d[:15], 16), SPLITS.index(split)) for d in opened.digests]
    if spec.packing == "bestfit":
        pad_id = check_pad_id(spec, opened)
        sources: list[Any] = bestfit_sources(spec, split, opened, keys)
        fillers: list[Any] = [BinFiller(s, pad_id) for s in sources]
        identity["pad_id"] = pad_id
        identity["bestfit"] = BESTFIT_VERSION
    else:
        pad_id = None
        with spec.blame("seq_length"):
            sources = [
                WindowSource(ds, r, spec.seq_length, key)
                for ds, r, key in zip(opened.datasets, opened.ranges, keys, strict=True)
            ]
        fillers = [WindowFiller(s) for s in sources]
    where = {prefix: i for i, prefix in enumerate(prefixes)}
    stages, digests, described = [], [], []
    for start, blend in spec.stage_blends():
        # No weight: blended by size (each source's samples per epoch), as a plain data_path is. A
        # prefix missing from ``where`` has weight 0 in a plain data_path, which opens no such source.
        members = [
            (where[prefix], float(sources[where[prefix]].windows) if weight is None else float(weight))
            for prefix, weight in blend
            if prefix in where
        ]
        stages.append((start, members))
        parts = [(opened.digests[s], opened.ranges[s], w) for s, w in members]
        digests.append([start, stage_digest(start, parts)])
        described.append(members_of(*(list(column) for column in zip(*parts, strict=True))))
    # The past depends on the stages that began before a position, never on later ones: the
    # fingerprint leaves the sources out ("data") and the restore compares the stages that began
    # before the saved position (statefulset.loading.state).
    identity["data"] = "stages"
    identity["stages"] = digests
    identity["stage_members"] = described  # so that a refusal can say which source differs, while small
    trim(identity)
    stream = StagedStream(spec, split, identity, sources, fillers, prefixes, stages, padded=pad_id is not None)
    stream.pad_id = pad_id  # type: ignore[attr-defined]
    return stream
