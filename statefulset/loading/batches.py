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

Errors inside a worker travel the same way, as ``("error", worker, t, message)``, so the trainer
raises one ``StatefulsetError`` naming the worker and the batch, not a worker traceback.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy
import torch
from torch.utils.data import IterableDataset, get_worker_info

from statefulset.errors import StatefulsetError
from statefulset.loading.read_ahead import read_ahead, read_ahead_depth
from statefulset.loading.state import Cursor
from statefulset.streams.base import SampleStream

# A worker sends batches in bundles of about this many bytes: each DataLoader round trip (index
# queue, result queue, their feeder threads) costs ~0.3 ms of CPU here, which one 32 KB batch
# cannot pay for, while a bundle of eight can.
BUNDLE_BYTES = 256 * 1024
MAX_BUNDLE = 16


def bundle_size(batch_size: int, width: int, dtype: numpy.dtype) -> int:
    """Batches per worker hand-off: 1 for batches of BUNDLE_BYTES or more, at most MAX_BUNDLE."""
    per_batch = batch_size * width * numpy.dtype(dtype).itemsize
    return max(1, min(MAX_BUNDLE, BUNDLE_BYTES // max(per_batch, 1)))


class BatchRing:
    """``workers × slots`` buffers of ``bundle`` batches each, in one shared-memory block."""

    def __init__(
        self, workers: int, slots: int, batch_size: int, width: int, dtype: numpy.dtype, bundle: int = 1
    ) -> None:
        self.workers, self.slots, self.bundle = workers, slots, bundle
        self.shape, self.dtype = (bundle, batch_size, width), numpy.dtype(dtype)
        self.slot_bytes = bundle * batch_size * width * self.dtype.itemsize
        self.block = torch.empty(workers * slots * self.slot_bytes, dtype=torch.uint8).share_memory_()
        self._flat = self.block.numpy()
        self._views: dict[tuple[int, int], numpy.ndarray] = {}

    def view(self, worker: int, slot: int) -> numpy.ndarray:
        """Slot ``slot`` of ``worker`` as ``[bundle, batch_size, width]`` of the ring's dtype."""
        found = self._views.get((worker, slot))
        if found is None:
            at = (worker * self.slots + slot) * self.slot_bytes
            found = self._flat[at : at + self.slot_bytes].view(self.dtype).reshape(self.shape)
            self._views[(worker, slot)] = found
        return found

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_flat", "_views")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._flat = self.block.numpy()
        self._views = {}


class BatchSource(IterableDataset):
    """Batches ``cursor.batches, +1, ...`` (before ``stop``) of a cursor's layout, split over workers."""

    def __init__(
        self, stream: SampleStream, cursor: Cursor, stop: int | None, wrap: int | None, ring: BatchRing | None
    ) -> None:
        self.stream = stream
        self.cursor = cursor
        self.stop = stop
        self.wrap = wrap
        self.ring = ring

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

    def _build(self, t: int, out: numpy.ndarray | None = None, dtype: Any = numpy.int64) -> numpy.ndarray:
        positions = self.positions(t)
        if out is None:
            out = numpy.empty((positions.size, self.stream.seq_length + 1), dtype=dtype)
        return self.stream.gather(positions, out=out)

    def batches(self, dtype: Any, worker: int = 0, workers: int = 1, bundle: int = 1) -> Iterator[tuple[int, Any]]:
        """``(t, rows)`` in order; rows is an array, or a future of one when reading ahead (remote data)."""
        numbers = self._numbers(worker, workers, bundle)
        depth = read_ahead_depth() if self.stream.remote else 0
        if depth:
            yield from read_ahead(lambda t: self._build(t, dtype=dtype), numbers, depth)
        else:
            for t in numbers:
                yield t, None  # built by the caller, straight into its buffer

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is None:  # num_workers=0: the trainer process builds int64 rows itself
            for t, rows in self.batches(numpy.int64):
                yield t, (rows.result() if rows is not None else self._build(t))
            return
        ring = self.ring
        if ring is None:
            raise StatefulsetError("internal: a worker started without its batch ring")
        t = None
        try:
            bundles = 0
            filled, first = 0, None
            for t, rows in self.batches(ring.dtype, info.id, info.num_workers, ring.bundle):
                view = ring.view(info.id, bundles % ring.slots)
                if first is not None and t != first + filled:  # the next bundle began: send this one
                    yield "bundle", info.id, bundles % ring.slots, first, filled
                    bundles, filled, first = bundles + 1, 0, None
                    view = ring.view(info.id, bundles % ring.slots)
                if first is None:
                    first = t
                if rows is None:
                    self._build(t, out=view[filled])
                else:
                    view[filled] = rows.result()
                filled += 1
                if filled == ring.bundle:
                    yield "bundle", info.id, bundles % ring.slots, first, filled
                    bundles, filled, first = bundles + 1, 0, None
            if filled:
                yield "bundle", info.id, bundles % ring.slots, first, filled
        except Exception as exc:  # reported by the trainer, naming this worker and batch
            yield "error", info.id, t, f"{type(exc).__name__}: {exc}"


def receive(source: BatchSource, item: Any, expected: int) -> list[dict[str, torch.Tensor]]:
    """The trainer's batches from what a worker (or the in-process source) handed over."""
    if item[0] == "error":
        _, worker, t, message = item
        where = f"micro-batch {t}" if t is not None else "its first micro-batch"
        raise StatefulsetError(f"DataLoader worker {worker}, building {where}: {message}")
    if item[0] == "bundle":
        _, worker, slot, t, count = item
        ring = source.ring
        # Widened out of the slot now: the worker may refill it once we ask for more.
        texts = torch.empty((count, *ring.shape[1:]), dtype=torch.int64)  # type: ignore[union-attr]
        texts.numpy()[:] = ring.view(worker, slot)[:count]  # type: ignore[union-attr]
        rows = list(texts.unbind(0))
    else:
        t, array = item
        count, rows = 1, [torch.from_numpy(array)]
    if t != expected:
        raise StatefulsetError(f"internal: expected micro-batch {expected}, a worker delivered {t}")
    return [
        {"text": text, "sample_id": torch.from_numpy(source.cursor.positions(t + i))} for i, text in enumerate(rows)
    ]


def describe_batch(source: BatchSource, t: int, workers: int) -> str:
    """For the watchdog: who builds batch ``t`` and which files it reads."""
    bundle = source.ring.bundle if source.ring is not None else 1
    worker = (t - source.cursor.batches) // bundle % workers if workers else 0
    who = f"DataLoader worker {worker} of {workers}" if workers else "the trainer process"
    positions = source.positions(t)
    try:
        files = sorted({source.stream.explain(int(p)).source for p in positions})
        reads = ", ".join(f + ".bin" for f in files)
    except Exception:  # the report must not fail on a stream that cannot explain itself
        reads = "?"
    return (
        f"{who} was building micro-batch {t} (stream positions {int(positions[0])}..{int(positions[-1])}), "
        f"reading {reads}"
    )
