"""Micro-batches of a rank's layout, built in worker processes and handed to the trainer cheaply.

Worker ``w`` of ``N`` builds batches ``t ≡ w (mod N)``; ``torch.utils.data.DataLoader`` delivers
them round-robin, which is batch order.

The hand-off: each worker owns ``slots`` buffers of one shared-memory block (a ring), allocated
once in the trainer process. A worker gathers a batch straight into its next slot, in the
corpus's own dtype (uint16 for most vocabularies: a quarter of int64's bytes), and sends only
``(worker, slot, t)`` through the DataLoader's queue. The trainer widens the slot into a fresh
int64 tensor before it asks for the next batch. Measured on this project's 2-core machine
(docs/benchmarks.md), a new shared-memory tensor per batch cost ~1 ms of trainer time (a
segment, a file descriptor passed over a socket, a mapping); a slot costs a ~20 µs copy.

Why ``slots = prefetch_factor + 1`` suffices: the DataLoader lets at most ``prefetch_factor``
requests per worker be outstanding, and asks a worker for its next batch only after the trainer
took one of its batches. So while the trainer reads slot ``k`` of a worker, that worker can be
writing at most its batch ``k + prefetch_factor``, in another slot.

That is torch's policy, not a promise (:mod:`statefulset.loading.torch_internals`), so the ring
checks it: each slot has two sequence stamps in shared memory. The worker writes the bundle's
first batch number to the *begin* stamp before it writes the slot and to the *end* stamp after;
the trainer, after copying the slot out, checks that both equal the batch it expected. A worker
that started to refill the slot during the copy has changed the begin stamp, and the trainer
raises a ``StatefulsetError`` naming the slot instead of handing over a torn batch. (The stamps
are plain stores: on x86 they are seen in program order; CPUs with weaker ordering, such as
ARM, may let a refill show before its begin stamp, so there the check is not a full guarantee.)

Errors inside a worker travel the same way, as ``("error", worker, t, message)``, so the trainer
raises one ``StatefulsetError`` naming the worker and the batch, not a worker traceback.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy
from torch.utils.data import IterableDataset, get_worker_info

from statefulset.errors import StatefulsetError
from statefulset.loading.encoded import Arena, pack
from statefulset.loading.encoded_bundle import EncodeFailed, Gathered, encode_bundle, whole_bundles
from statefulset.loading.encoded_ring import Staged, in_ring_layout, staged, staged_kept, write_slot
from statefulset.loading.read_ahead import read_ahead, read_ahead_depth
from statefulset.loading.ring import BatchRing
from statefulset.loading.state import Cursor
from statefulset.shards import storage_stats
from statefulset.streams.base import SampleStream
from statefulset.streams.documents import WIRE, gather_fields
from statefulset.streams.provenance import source_prefixes


class BatchSource(IterableDataset):
    """Batches ``cursor.batches, +1, ...`` (before ``stop``) of a cursor's layout, split over workers."""

    def __init__(
        self,
        stream: SampleStream,
        cursor: Cursor,
        stop: int | None,
        wrap: int | None,
        ring: BatchRing | None,
        boundaries: bool = False,
        encoder: Any = None,
    ) -> None:
        self.stream = stream
        self.cursor = cursor
        self.stop = stop
        self.wrap = wrap
        self.ring = ring
        self.boundaries = boundaries  # add cu_seqlens, max_seqlen, position_ids
        # A TaskEncoderRunner (statefulset.transforms.encoder): batches then travel as
        # statefulset.loading.encoded describes, not through the ring's slots.
        self.encoder = encoder

    def __getstate__(self) -> dict[str, Any]:
        # The trainer's arena blocks (_from_arena) stay in the trainer.
        return {k: v for k, v in self.__dict__.items() if k != "_arenas"}

    def positions(self, t: int) -> numpy.ndarray:
        """The stream positions that batch ``t`` reads (its sample ids modulo a validation wrap)."""
        positions = self.cursor.positions(t)
        return positions % self.wrap if self.wrap else positions

    def _numbers(self, worker: int, workers: int, bundle: int = 1) -> Iterator[int]:
        """This worker's batch numbers: bundles ``worker, worker + workers, ...`` of ``bundle`` batches."""
        first = self.cursor.batches + worker * bundle
        starts = itertools.count(first, workers * bundle)
        for start in starts:
            for t in range(start, start + bundle):
                if self.stop is not None and t >= self.stop:
                    return
                yield t

    def _build(
        self,
        t: int,
        out: dict[str, numpy.ndarray] | None = None,
        dtype: Any = numpy.int64,
        wire: bool = False,
        positions: numpy.ndarray | None = None,
    ) -> dict[str, numpy.ndarray]:
        """Every field of batch ``t``, into ``out``'s arrays when given (``text`` in ``dtype`` otherwise;
        ``wire``: the document fields as their pieces, :data:`WIRE`); ``positions``: ``self.positions(t)``
        when the caller has them."""
        if positions is None:
            positions = self.positions(t)
        if out is None:
            out = {"text": numpy.empty((positions.size, self.stream.seq_length + 1), dtype=dtype)}
            if wire and self.boundaries:
                out[WIRE] = numpy.empty((positions.size, self.stream.seq_length + 3), dtype=numpy.int64)
        return gather_fields(self.stream, positions, self.boundaries, out)

    def batches(
        self, dtype: Any, worker: int = 0, workers: int = 1, bundle: int = 1, wire: bool = False
    ) -> Iterator[tuple[int, Any]]:
        """``(t, rows)`` in order; rows is an array, or a future of one when reading ahead (remote data)."""
        numbers = self._numbers(worker, workers, bundle)
        depth = read_ahead_depth() if self.stream.remote else 0
        if depth:
            yield from read_ahead(lambda t: self._build(t, dtype=dtype, wire=wire), numbers, depth)
        else:
            for t in numbers:
                yield t, None  # built by the caller, straight into its buffer

    def encoded(self, t: int, rows: Any, ring: BatchRing | None = None, home: tuple[Any, int] | None = None) -> Any:
        """Batch ``t`` through the task encoder (``rows``: its fields, a future of them, or None to build).

        With the worker's ``ring``: the global RNG states are the caller's to put back (once per
        hand-off), and samples that keep the dataset's layout come back :class:`Staged` for the ring.
        ``home``: ``(view, i)``, the slot (``ring.view``, stamps begun) and place where the batch goes: the
        rows are gathered there (``text`` in the ring's dtype) and the encoder gets views of them (encoded_ring)."""
        return self.encode_gathered(self.gathered(t, rows, home), ring, home)

    def gathered(self, t: int, rows: Any, home: tuple[Any, int] | None = None) -> Gathered:
        """Batch ``t``'s fields, gathered into place ``home`` (``(slot view, i)``) when given, not yet encoded."""
        positions = self.cursor.positions(t)
        wrapped = positions % self.wrap if self.wrap else positions  # self.positions(t)
        target = None if home is None else {name: array[home[1]] for name, array in home[0].items()}
        slot_rows = None if target is None else dict(target)  # the slot's own arrays, whatever replaces them
        if rows is None:
            fields = self._build(t, out=target, positions=wrapped)
        else:
            fields = rows.result()
            if target is not None:  # read ahead (remote data): copied into the slot
                for name, value in fields.items():
                    target[name][...] = value
                fields = target
        return Gathered(fields, slot_rows, positions, wrapped)

    def encode_gathered(self, batch: Gathered, ring: BatchRing | None, home: tuple[Any, int] | None) -> Any:
        """:meth:`encoded` of a batch :meth:`gathered` (into ``home`` when given)."""
        fields, slot_rows, positions, wrapped = batch
        sources = source_prefixes(self.stream, wrapped)
        if ring is None:
            return self.encoder.micro_batch(fields, positions, sources)
        if not self.encoder.collates:
            return self.encoder.micro_batch(fields, positions, sources, keep=False)
        if self.encoder.encode_in_place(fields, positions):  # FillInTheMiddle's compiled path: rows changed in place
            found = staged_kept(fields, slot_rows, ring.fields, ring.staged_names, positions)
            if found is not None:
                return found.placed(home, slot_rows)
            return self.encoder.batched(self.encoder.as_samples(fields, positions, sources), int(positions[0]))
        views = {name: list(values) for name, values in fields.items()}  # each row's view, made at once
        samples, kept = self.encoder.encode_rows(views, positions, sources)
        layout = (ring.fields, ring.staged_names, positions)
        found = staged_kept(fields, slot_rows, *layout) if kept else staged(samples, *layout, fields, views)
        return found.placed(home, slot_rows) if found is not None else self.encoder.batched(samples, int(positions[0]))

    def _serve_encoded(self, ring: BatchRing, worker: int, workers: int) -> Iterator[tuple[Any, ...]]:
        """A worker's encoded micro-batches, a bundle at a time: through the ring when they keep its
        layout, else packed (statefulset.loading.encoded); errors as the ring's. A keyed encoder's
        global RNG states are put back before each hand-off (statefulset.transforms.encoder)."""
        t = None
        saved = None
        try:
            self.stream.check_unchanged()  # a worker (re)started: the .bin files are still the ones opened
            saved = self.encoder.saved_globals()
            pending: list[Any] = []
            bundles = 0
            arena = Arena(ring.slots)  # bundles out of the ring's layout
            whole = whole_bundles(self.encoder)  # gathered per micro-batch, encoded per bundle (encoded_bundle)
            for t, rows in self.batches(ring.dtype, worker, workers, ring.bundle):
                if pending and t != pending[0][0] + len(pending):  # the next bundle began: send this one
                    yield self._hand_off(ring, worker, bundles, pending, saved, arena, whole)
                    pending, bundles = [], bundles + 1
                view = ring.view(worker, bundles % ring.slots)
                if not pending:
                    ring.begin(worker, bundles % ring.slots, t)  # before its rows are gathered into the slot
                home = (view, len(pending))
                pending.append((t, self.gathered(t, rows, home) if whole else self.encoded(t, rows, ring, home)))
                if len(pending) == ring.bundle:
                    yield self._hand_off(ring, worker, bundles, pending, saved, arena, whole)
                    pending, bundles = [], bundles + 1
            if pending:
                yield self._hand_off(ring, worker, bundles, pending, saved, arena, whole)
        except Exception as exc:  # reported by the trainer, naming this worker and batch
            if isinstance(exc, EncodeFailed):  # the micro-batch of the sample that failed
                t, exc = exc.t, exc.cause
            yield "error", worker, t, f"{type(exc).__name__}: {exc}"
        finally:
            if saved is not None:
                self.encoder.restore(saved)

    def fill(
        self, ring: BatchRing, worker: int, slot: int, numbers: range, stale: Callable[[], bool]
    ) -> tuple[Any, ...] | None:
        """Batches ``numbers`` (at most ``ring.bundle``) into slot ``slot`` of ``worker``, in a worker
        process: the note :func:`receive` takes, or None when ``stale()`` turned true before a batch
        (a worker pool re-targeted mid-bundle: statefulset.integrations.torchft). Errors as the ring's."""
        t = None
        saved = None
        try:
            saved = self.encoder.saved_globals() if self.encoder is not None else None
            depth = read_ahead_depth() if self.stream.remote else 0
            built = read_ahead(lambda t: self._build(t, dtype=ring.dtype), numbers, depth) if depth else None
            pending: list[Any] = []
            view = ring.view(worker, slot)
            ring.begin(worker, slot, numbers[0])
            for i, t in enumerate(numbers):
                if stale():
                    if built is not None:
                        built.close()  # its read-ahead threads stop
                    return None
                rows = next(built)[1] if built is not None else None
                if self.encoder is not None:
                    pending.append((t, self.encoded(t, rows, ring, (view, i))))
                elif rows is None:
                    self._build(t, out={name: array[i] for name, array in view.items()})
                else:
                    for name, value in rows.result().items():
                        view[name][i][...] = value
            if self.encoder is not None:
                return self._send_encoded(ring, worker, slot, pending, saved)
            return _sent(ring, worker, slot, numbers[0], len(numbers))
        except Exception as exc:  # reported by the trainer, naming this worker and batch
            return "error", worker, t, f"{type(exc).__name__}: {exc}"
        finally:
            if saved is not None:
                self.encoder.restore(saved)

    def _hand_off(
        self, ring: BatchRing, worker: int, bundles: int, pending: list[Any], saved: Any, arena: Arena, whole: bool
    ) -> tuple[Any, ...]:
        """:meth:`_send_encoded`; ``whole``: ``pending`` holds the bundle gathered, encoded here in one call."""
        if whole:
            first, count, slot = pending[0][0], len(pending), bundles % ring.slots
            pending = encode_bundle(self, ring, ring.view(worker, slot), pending)  # type: ignore[assignment]
            if pending is None:  # every sample kept: the slot holds the bundle
                if saved is not None:
                    self.encoder.restore(saved)
                return _sent(ring, worker, slot, first, count)
        return self._send_encoded(ring, worker, bundles, pending, saved, arena)

    def _send_encoded(
        self, ring: BatchRing, worker: int, bundles: int, pending: list[Any], saved: Any, arena: Arena | None = None
    ) -> tuple[Any, ...]:
        """A bundle into the ring's slot when it keeps the layout (its tokens within the ring's dtype,
        checked as they are written), else into the arena's (or one block)."""
        if saved is not None:  # the global RNG states as they were before the worker's keyed calls
            self.encoder.restore(saved)
        first, batches = pending[0][0], [batch for _, batch in pending]
        slot = bundles % ring.slots
        if all(type(b) is Staged or in_ring_layout(ring, self.cursor.positions(t), b) for t, b in pending):
            ring.begin(worker, slot, first)
            view = ring.view(worker, slot)
            if all(write_slot(view, i, batch, ring.limits) for i, batch in enumerate(batches)):
                return _sent(ring, worker, slot, first, len(batches))
        # Out of the ring's layout: the slot (if begun) is left unsent, its stamps never checked.
        values = [_collated(b) for b in batches]
        if arena is not None:
            return ("arena", worker, first, len(batches), *arena.place(values, slot, first))
        return ("encoded", worker, first, len(batches), *pack(values))

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is None:  # num_workers=0: the trainer process builds int64 rows itself
            self.stream.check_unchanged()  # a new pass (epoch, validation round) over replaced files
            for t, rows in self.batches(numpy.int64):
                if self.encoder is not None:
                    yield "local", t, self.encoded(t, rows)
                else:
                    yield t, (rows.result() if rows is not None else self._build(t))
            return
        ring = self.ring
        if ring is None:
            raise StatefulsetError("internal: a worker started without its batch ring")
        ring.started[info.id] = 1
        storage_stats.attach(ring.stats[info.id].numpy(), [d.path_prefix for d in self.stream.shards])
        if self.encoder is not None:
            yield from self._serve_encoded(ring, info.id, info.num_workers)
            return
        t = None
        try:
            self.stream.check_unchanged()  # a worker (re)started: the .bin files are still the ones opened
            bundles = 0
            filled, first = 0, None
            wire = any(field.name == WIRE for field in ring.fields)
            for t, rows in self.batches(ring.dtype, info.id, info.num_workers, ring.bundle, wire):
                view = ring.view(info.id, bundles % ring.slots)
                if first is not None and t != first + filled:  # the next bundle began: send this one
                    yield _sent(ring, info.id, bundles % ring.slots, first, filled)
                    bundles, filled, first = bundles + 1, 0, None
                    view = ring.view(info.id, bundles % ring.slots)
                if first is None:
                    first = t
                    ring.begin(info.id, bundles % ring.slots, first)
                target = {name: array[filled] for name, array in view.items()}
                if rows is None:
                    self._build(t, out=target)
                else:
                    for name, value in rows.result().items():
                        target[name][...] = value
                filled += 1
                if filled == ring.bundle:
                    yield _sent(ring, info.id, bundles % ring.slots, first, filled)
                    bundles, filled, first = bundles + 1, 0, None
            if filled:
                yield _sent(ring, info.id, bundles % ring.slots, first, filled)
        except Exception as exc:  # reported by the trainer, naming this worker and batch
            yield "error", info.id, t, f"{type(exc).__name__}: {exc}"


def _collated(batch: Any) -> Any:
    return batch.collated() if isinstance(batch, Staged) else batch


def _sent(ring: BatchRing, worker: int, slot: int, first: int, count: int) -> tuple[Any, ...]:
    """The note for a filled slot, after its end stamp is written."""
    ring.end(worker, slot, first)
    return "bundle", worker, slot, first, count


def describe_batch(source: BatchSource, t: int, workers: int) -> str:
    """For the watchdog: who builds batch ``t`` and which files it reads."""
    bundle = source.ring.bundle if source.ring is not None else 1
    worker = (t - source.cursor.batches) // bundle % workers if workers else 0
    who = f"DataLoader worker {worker} of {workers}" if workers else "the trainer process"
    started = source.ring is None or bool(source.ring.started[worker])
    positions = source.positions(t)
    try:
        files = sorted({source.stream.explain(int(p)).source for p in positions})
        reads = ", ".join(f + ".bin" for f in files)
    except Exception:  # the report must not fail on a stream that cannot explain itself
        reads = "?"
    doing = "was building" if started else "has not started; it is to build"
    return (
        f"{who} {doing} micro-batch {t} (stream positions {int(positions[0])}..{int(positions[-1])}), reading {reads}"
    )
