"""What every sample stream is: packed samples of ``seq_length + 1`` tokens at integer positions.

``stream[p]`` is a pure function of (spec, p). ``stream.gather(positions)`` is the hot path:
``[B, seq_length + 1]`` int64 assembled with one vectorised plan of token ranges per source and
one copy per range. Each packing is a module of its own (:mod:`statefulset.streams.megatron`,
:mod:`statefulset.streams.native`); :mod:`statefulset.streams.opening` opens a spec into one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy

from statefulset.errors import SequenceIndexError, StatefulsetError
from statefulset.index.native.blend_tree import BlendSchedule
from statefulset.index.native.one_pass import OnePassBlend
from statefulset.shards.faults import changed_error
from statefulset.shards.reader import IndexedDataset
from statefulset.shards.storage import local_version
from statefulset.spec.model import DatasetSpec
from statefulset.streams.compiled_gather import REFUSED
from statefulset.streams.documents import Pieces, merge_pieces
from statefulset.streams.located import LastLocated
from statefulset.streams.provenance import Provenance, explain

# Megatron's add_extra_token_to_sequence: a sample holds seq_length + 1 tokens.
EXTRA = 1
# Batches up to this many samples are planned on Python ints, larger gathers with numpy.
_LIST_PLAN_MAX_SAMPLES = 64
_THIS_AND_NEXT = numpy.array([0, 1], dtype=numpy.int64)
_FLOAT32 = numpy.dtype(numpy.float32)


def reopen_pinned(reopen: Any, spec: DatasetSpec, split: str, pins: list[tuple[str, str]]) -> SampleStream:
    """The stream reopened in another process, refused when a ``.bin`` is not the version the first opened.

    The refusal (and any failure to reopen) is raised by the stream's first use, not here: this runs
    while a spawn/forkserver DataLoader worker unpickles its dataset, before torch's worker loop, and an
    error there kills the worker with nothing reported but "exited unexpectedly" (issue 24). The
    worker's first fetch calls :meth:`SampleStream.check_unchanged`, which the batch ring reports."""
    try:
        stream = reopen(spec, split)
    except Exception as exc:
        stream = SampleStream(spec, split, {}, 0, unbounded=False)
        stream.refused = _unopened(split, pins, exc)
        return stream
    for (path, opened), dataset in zip(pins, stream.shards, strict=True):
        if dataset.bin_version != opened:
            stream.refused = changed_error(path, opened, dataset.bin_version)
            break
    return stream


def _unopened(split: str, pins: list[tuple[str, str]], exc: Exception) -> StatefulsetError:
    """Why the stream could not be reopened: a local ``.bin`` changed since it was opened, else ``exc``."""
    for path, opened in pins:
        now = local_version(path)
        if now is not None and now != opened:
            error = changed_error(path, opened, now)
            break
    else:
        files = ", ".join(path for path, _ in pins)
        error = StatefulsetError(
            f"{split} stream ({files}): reopening it in this process failed: {type(exc).__name__}: {exc}"
        )
    error.__cause__ = exc
    return error


class SampleStream:
    """Packed samples of ``seq_length + 1`` tokens at integer positions."""

    def __init__(self, spec: DatasetSpec, split: str, identity: dict[str, Any], length: int, unbounded: bool) -> None:
        self.spec = spec
        self.split = split
        self.seq_length = spec.seq_length
        self.packing = spec.packing
        # What the samples depend on, field by field (so a state that does not fit can say which);
        # "data" digests every source's content (.idx and .bin), split range and weight.
        self.identity = identity
        self.fingerprint = hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=16).hexdigest()
        self._length = length
        self.unbounded = unbounded  # native: every p >= 0 is a sample; megatron: p < len(stream)
        self.open_seconds: float | None = None  # how long open_stream took, and the indices it built
        self.open_built: dict[str, int] = {}
        # How a worker process reopens this stream (streams.opening sets it; a base class cannot
        # import the module that opens its subclasses).
        self.reopen: Any = None
        # Set by streams.opening: the narrowest dtype holding every source's tokens (what batches
        # travel in between processes), and whether any source is read from object storage.
        self.token_dtype = numpy.dtype(numpy.int64)
        self.remote = False
        # Whether samples may end in padding (packing bestfit): rows then carry a loss_mask.
        self.padded = False
        # Whether a source has a loss-mask shard (statefulset.shards.loss_masks): rows then carry a loss_mask.
        self.masked = False
        # Set by streams.opening, for a refused restore to name shards: every source's prefix, in
        # the order of identity["shards"]; and "data" as statefulset 0.1.0 computed it (.idx only).
        self.source_prefixes: list[str] = []
        self.legacy_data: str | None = None
        # The shards read, set by streams.opening: a worker (forked or reopened) checks that each
        # .bin is still the version opened here, so that no batch mixes tokens of two versions.
        self.shards: list[IndexedDataset] = []
        # Set by reopen_pinned in a worker process when the stream there is not the one opened here
        # (a .bin changed, or reopening failed): raised by the stream's first use.
        self.refused: StatefulsetError | None = None
        self._last = LastLocated()
        self._kernel: Any = None  # compiled_gather.BatchKernel, made at the first batch (False: none)

    def __len__(self) -> int:
        return self._length

    def locate(self, positions: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
        """``(source, local sample)`` of every position, as new arrays (the last answer is kept: LastLocated)."""
        p = numpy.asarray(positions, dtype=numpy.int64)
        found = self._last.get(p)
        return found if found is not None else self._last.put(p, self._locate(p))

    def _locate(self, p: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
        raise NotImplementedError(f"{type(self).__name__} does not locate positions in its sources")

    def __reduce__(self) -> tuple[Any, ...]:
        # Workers started with spawn/forkserver reopen the stream (cached indices are mmapped)
        # instead of receiving pickled index arrays, and check they reopened the same .bin versions.
        if self.refused is not None:  # not the stream opened first: never handed on
            raise self.refused
        pins = [(d.path_prefix + ".bin", d.bin_version) for d in self.shards]
        return (reopen_pinned, (self.reopen, self.spec, self.split, pins))

    def check_unchanged(self) -> None:
        """A StatefulsetError naming the first ``.bin`` replaced or rewritten since this stream opened it
        (a ``stat`` per local shard; S3 objects are checked by every read instead)."""
        if self.refused is not None:
            raise self.refused
        for dataset in self.shards:
            dataset.check_unchanged()

    def __getitem__(self, position: int) -> dict[str, Any]:
        try:
            p = int(position)
        except TypeError:
            raise TypeError(f"stream positions are ints, not {type(position).__name__}") from None
        return {"text": self.gather(numpy.array([p], dtype=numpy.int64))[0], "sample_id": p}

    def explain(self, position: int, tokenizer: Any = None) -> Provenance:
        """Where ``self[position]`` came from: split, source, epoch, the pieces it was cut from (docs/provenance.md)."""
        if self.refused is not None:
            raise self.refused
        return explain(self, position, tokenizer)

    def gather(self, positions: Any, out: numpy.ndarray | None = None) -> numpy.ndarray:
        """The samples at ``positions`` as one int64 array ``[len(positions), seq_length + 1]``.

        ``out`` may also have a narrower dtype that holds every token (``token_dtype``).
        """
        return self._gather(positions, out, False)[0]

    def gather_pieces(
        self, positions: Any, out: numpy.ndarray | None = None, documents: list[int] | None = None
    ) -> tuple[numpy.ndarray, Pieces | None]:
        """:meth:`gather`, and the documents inside each row (:mod:`statefulset.streams.documents`); ``documents``:
        a ``FieldTargets.request`` the batch kernel may write the fields into (None for pieces it does not keep)."""
        out, pieces = self._gather(positions, out, True, None, documents)
        return out, _some(pieces) if pieces is not None or documents is None else None

    def gather_masked(
        self,
        positions: Any,
        out: numpy.ndarray | None = None,
        want: bool = True,
        labels: numpy.ndarray | None = None,
        documents: list[int] | None = None,
    ) -> tuple[numpy.ndarray, Pieces | None, numpy.ndarray]:
        """:meth:`gather_pieces` (the pieces only with ``want``, else None), and the rows' ``loss_mask``: float32
        ``[len(positions), seq_length]``, into ``labels`` when given (C-contiguous, that shape and
        dtype), each label's token's mask read from the sources' mask shards along the tokens' own
        ranges (1 for a source without one, 0 on bestfit padding: :mod:`statefulset.streams.label_masks`)."""
        count = numpy.asarray(positions).size
        shape = (count, self.seq_length)
        if labels is None or labels.shape != shape or labels.dtype != _FLOAT32 or not labels.flags.c_contiguous:
            labels = numpy.empty(shape, dtype=numpy.float32)
        out, pieces = self._gather(positions, out, want, labels, documents if want else None)
        return out, _some(pieces) if want else None, labels

    def _gather(
        self,
        positions: Any,
        out: numpy.ndarray | None,
        want: bool,
        masks: numpy.ndarray | None = None,
        documents: list[int] | None = None,
    ) -> tuple[numpy.ndarray, Pieces | None]:
        if self.refused is not None:
            raise self.refused
        p = numpy.asarray(positions, dtype=numpy.int64).reshape(-1)
        width = self.seq_length + EXTRA
        if out is None:
            out = numpy.empty((p.size, width), dtype=numpy.int64)
        elif (
            out.shape != (p.size, width)
            or not out.flags.c_contiguous
            or not numpy.can_cast(self.token_dtype, out.dtype, "safe")
        ):
            self._check_positions(p)  # a position outside the stream is named first
            raise StatefulsetError(
                f"gather: out must be C-contiguous {(p.size, width)} of a dtype holding {self.token_dtype}, "
                f"got {out.shape} {out.dtype}"
            )
        if not p.size:
            return out, None
        # One compiled call for the whole batch where the stream has one (it checks the positions);
        # otherwise, or for anything it refuses, the Python version, which names what is wrong.
        pieces = self._fill_compiled(p, out, want, masks, documents)
        if pieces is REFUSED:
            self._check_positions(p)
            pieces = self._fill(p, out, want, masks)
        return out, pieces

    def _check_positions(self, p: numpy.ndarray) -> None:
        if p.size and (int(p.min()) < 0 or (not self.unbounded and int(p.max()) >= self._length)):
            bad = int(p.min()) if int(p.min()) < 0 else int(p.max())
            raise SequenceIndexError(
                f"{self.split} stream: position {bad} is outside [0, {self._length})"
                + ("" if self.unbounded else " (megatron packing builds a finite stream; raise num_samples)")
            )

    def _fill_compiled(
        self, p: numpy.ndarray, out: numpy.ndarray, want: bool, masks: numpy.ndarray | None, documents: Any = None
    ) -> Any:
        """:meth:`_fill` in one compiled call (:mod:`statefulset.streams.compiled_gather`; the document
        fields too when ``documents`` asks), or REFUSED (nothing written) where the stream has no
        kernel or :meth:`_kernel_rows` refuses these positions. The kernel is made at the first batch."""
        kernel = self._kernel
        if kernel is None:
            kernel = self._kernel = self._batch_kernel() or False
        rows_in = REFUSED if kernel is False else self._kernel_rows(kernel, p)
        return REFUSED if rows_in is REFUSED else kernel.fill(rows_in, out, want, masks, documents)

    def _batch_kernel(self) -> Any:
        """This stream's ``compiled_gather.BatchKernel``, or None (every batch on :meth:`_fill`)."""
        return None

    def _kernel_rows(self, kernel: Any, p: numpy.ndarray) -> Any:
        """What ``kernel.fill`` takes for positions ``p`` (megatron: ``[p]``), or REFUSED."""
        return [p]

    def _fill(
        self, positions: numpy.ndarray, out: numpy.ndarray, want: bool, masks: numpy.ndarray | None = None
    ) -> Pieces | None:
        """Rows of ``out`` (and ``masks``: float32 ``loss_mask`` rows) at ``positions``; with ``want``, their pieces."""
        raise NotImplementedError

    def __repr__(self) -> str:
        size = "unbounded" if self.unbounded else f"{self._length} samples"
        return f"{type(self).__name__}({self.split}, seq_length={self.seq_length}, {size})"


def _some(pieces: Pieces | None) -> Pieces:
    if pieces is None:  # no position
        empty = numpy.empty(0, dtype=numpy.int64)
        pieces = Pieces(empty, empty, empty)
    return pieces


def fill_by_source(
    which: numpy.ndarray,
    local: numpy.ndarray,
    out: numpy.ndarray,
    sources: list[Any],
    want: bool = False,
    masks: numpy.ndarray | None = None,
) -> Pieces | None:
    """Rows of ``out`` (and ``masks``) from several sources: each source gathers its rows in one call."""
    present = sorted(set(which.tolist()))  # not numpy.unique: its first call imports numpy.ma (~7 ms)
    if len(present) == 1:
        return sources[present[0]].fill(local, out, want, masks)
    parts = []
    for d in present:
        rows = numpy.flatnonzero(which == d)
        block = numpy.empty((rows.size, out.shape[1]), dtype=out.dtype)
        mask_block = None if masks is None else numpy.empty((rows.size, masks.shape[1]), dtype=masks.dtype)
        pieces = sources[d].fill(local[rows], block, want, mask_block)
        out[rows] = block
        if masks is not None:
            masks[rows] = mask_block
        if want:
            parts.append((rows, pieces))
    return merge_pieces(out.shape[0], parts) if want else None


def epoch_sizes(sources: list[Any]) -> dict[str, int]:
    """Samples in one epoch of each source (packing native and bestfit), by prefix."""
    return {s.dataset.path_prefix: int(s.windows) for s in sources}


def samples_per_epoch(sources: list[Any]) -> int:
    """The only source's samples per epoch; a blend's sources each have their own (``epoch_sizes``)."""
    if len(sources) != 1:
        raise StatefulsetError(
            f"samples_per_epoch: this stream blends {len(sources)} sources, each with epochs of its own; "
            "read each source's from stream.epoch_sizes (prefix -> samples per epoch)"
        )
    return int(sources[0].windows)


class BlendedStream(SampleStream):
    """Sources whose local samples cover every ``p >= 0`` (each with ``windows`` samples per epoch and a
    filler), blended position by position by the native blend tree: packing native and bestfit.

    The train split is unbounded and follows the weights. Validation and test (``one_pass``) are one
    pass: every sample of every source exactly once, interleaved by size whatever the weights
    (:class:`~statefulset.index.native.one_pass.OnePassBlend`); positions past it do not exist.
    """

    def __init__(
        self,
        spec,
        split,
        identity,
        sources: list[Any],
        fillers: list[Any],
        weights: list[float],
        one_pass: bool = False,
    ):
        super().__init__(spec, split, identity, sum(s.windows for s in sources), unbounded=not one_pass)
        self.sources = sources
        self._fillers = fillers
        self.schedule: BlendSchedule | OnePassBlend | None
        if one_pass:
            self.weights = [float(s.windows) for s in sources]
            self.schedule = OnePassBlend([s.windows for s in sources]) if len(sources) > 1 else None
        else:
            self.weights = weights
            self.schedule = BlendSchedule(weights) if len(sources) > 1 else None

    def _locate(self, p: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
        if self.schedule is None:
            return numpy.zeros(p.shape, dtype=numpy.int64), p.copy()
        return self.schedule.locate(p)

    def source_positions(self, position: int) -> dict[str, int]:
        """For each source prefix: how many of its samples the positions ``[0, position)`` drew."""
        return {s.dataset.path_prefix: c for s, c in zip(self.sources, self.source_counts(position), strict=True)}

    def source_counts(self, position: int) -> list[int]:
        """:meth:`source_positions` as a list in source order (what ``metrics()`` reads)."""
        p = int(position)
        if p < 0:
            raise ValueError(f"source_positions: position must be non-negative, got {p}")
        return [p] if self.schedule is None else [int(c) for c in self.schedule.counts(p)]

    def source_counts_many(self, positions: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
        """:meth:`source_counts` at each of ``positions`` (non-negative int64) at once, and their stage
        (always 0): ``(counts (len(positions), sources), stages)``."""
        p = numpy.asarray(positions, dtype=numpy.int64)
        if self.schedule is None:
            counts = p[:, None].copy()
        elif isinstance(self.schedule, BlendSchedule):
            counts = self.schedule.counts_many(p)
        else:  # one pass: counts capped at the pass, on Python ints
            counts = numpy.array([self.schedule.counts(q) for q in p.tolist()], dtype=numpy.int64)
        return counts, numpy.zeros(p.size, dtype=numpy.int64)

    @property
    def epoch_sizes(self) -> dict[str, int]:
        """Samples in one epoch of each source, by prefix."""
        return epoch_sizes(self.sources)

    @property
    def samples_per_epoch(self) -> int:
        """Samples in one epoch of the spec's only source (epoch e is positions [e*n, (e+1)*n))."""
        return samples_per_epoch(self.sources)

    def _fill(
        self, positions: numpy.ndarray, out: numpy.ndarray, want: bool, masks: numpy.ndarray | None = None
    ) -> Pieces | None:
        if self.schedule is None:
            return self._fillers[0].fill(positions, out, want, masks)
        which, local = self.locate(positions)
        return fill_by_source(which, local, out, self._fillers, want, masks)


@dataclass(frozen=True)
class OpenedSources:
    """A split's sources, opened and identified: what a packing builds its stream from."""

    live: list[tuple[str, float | None]]  # (prefix, weight) of every source with a positive weight
    weighted: bool
    per_split: bool  # the spec gives each split its own prefixes (no split ratios)
    num_samples: int | None
    datasets: list[IndexedDataset]
    ranges: list[tuple[int, int]]  # each source's sequences in this split
    digests: list[str]  # each source's content digest (.idx and .bin: statefulset.shards.digests)
    cache_root: str  # where derived indices live: the spec's path_to_cache, else this node's default
    # Indices a packing built while the .idx files were being hashed, by source (streams.megatron.build_ahead).
    built_ahead: dict[int, Any] = field(default_factory=dict)
