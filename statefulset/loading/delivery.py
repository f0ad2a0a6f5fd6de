"""One pass of a ``torch.utils.data.DataLoader`` over a rank's micro-batches: in order, watched.

The loaders (:mod:`statefulset.loading.loader`) hand out what a ``Delivery`` yields. It builds the
DataLoader over a :class:`~statefulset.loading.batches.BatchSource`, waits for each worker hand-off
under the watchdog (:mod:`statefulset.loading.watchdog`; with no workers the batches are built
on a helper thread so that the wait stays bounded), starts forked workers again that never
started (:mod:`statefulset.loading.worker_start`), and widens or pins the batches it receives.
A later pass may reuse a pass's DataLoader (``reuse``): its persistent workers then serve it
without a fork.
"""

from __future__ import annotations

import os
import weakref
from bisect import bisect_left
from time import perf_counter
from typing import Any

import numpy
import torch
from torch.utils.data import DataLoader

from statefulset.errors import StatefulsetError
from statefulset.index.native.keys import derive_key
from statefulset.loading import torch_internals
from statefulset.loading.batches import BatchSource, describe_batch
from statefulset.loading.datasets import StreamDataset
from statefulset.loading.encoded import pin
from statefulset.loading.metrics import Meter
from statefulset.loading.read_ahead import read_ahead_depth
from statefulset.loading.receive import receive
from statefulset.loading.ring import make_ring
from statefulset.loading.state import Cursor
from statefulset.loading.watchdog import HARD_PERIODS, InProcessSource, TimedOut, Watchdog
from statefulset.loading.worker_start import (
    POLL_SECONDS,
    ParentCheck,
    StartWatch,
    forks,
    frozen_for_fork,
    named_worker_death,
    stop_workers,
)
from statefulset.shards import storage_stats


def _identity(item: Any) -> Any:
    return item  # batches are (worker, slot, t) notes or ready tensors: nothing to collate


def _data_loader(dataset: StreamDataset, cursor: Cursor, options: dict[str, Any]) -> tuple[DataLoader, BatchSource]:
    stream = dataset.stream
    wrap = None if stream.unbounded or not dataset.repeat else len(stream)
    workers = dataset.worker_config.num_workers
    ring = None
    if workers:
        # With a task encoder too: encoded batches that keep the dataset's layout use the slots
        # (statefulset.loading.encoded).
        slots = options["prefetch_factor"] + 1  # see statefulset.loading.batches
        # Document fields travel as their pieces (a few hundred bytes instead of ~100x that); an
        # encoder's batches that keep the layout travel as the fields the trainer receives.
        fields = dataset.fields(wire=dataset.encoder is None)
        ring = make_ring(workers, slots, dataset.batch_size, fields, dataset.encoder)
    source = BatchSource(
        stream, cursor, dataset.stop_batch(cursor), wrap, ring, dataset.document_boundaries, dataset.encoder
    )
    # Worker seeds come from our own generator: creating the iterator never draws from (or
    # reseeds) the trainer's global torch RNG.
    seed = derive_key(stream.spec.seed, dataset.worker_config.seed_offset, dataset.worker_config.rank) >> 1
    context = options["multiprocessing_context"] if workers else None
    # A worker whose trainer died while it started exits (statefulset.loading.worker_start).
    check = ParentCheck(os.getpid() if forks(context) else None) if workers else None
    loader = DataLoader(
        source,
        batch_size=None,
        collate_fn=_identity,
        num_workers=workers,
        prefetch_factor=options["prefetch_factor"] if workers else None,
        persistent_workers=options["persistent_workers"] and workers > 0,
        multiprocessing_context=context,
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=check,
    )
    return loader, source


class Delivery:
    """One pass of a DataLoader: batches in order, watched, widened, pinned if asked.

    ``reuse``: the DataLoader and source of an earlier pass over the same cursor, whose
    persistent workers start this pass (torch resets them; no fork). ``restarted`` says whether
    this pass had to start its workers again (its DataLoader then begins later: not reusable).
    """

    def __init__(
        self,
        dataset: StreamDataset,
        cursor: Cursor,
        options: dict[str, Any],
        reuse: tuple[DataLoader, BatchSource, Any] | None = None,
    ) -> None:
        self.dataset, self.options = dataset, options
        self.workers = dataset.worker_config.num_workers
        self.watchdog: Watchdog = options["watchdog"]
        self.timeout = options["timeout"]
        self.pin = options["pin_memory"] and torch.cuda.is_available()
        self.next_t = cursor.batches
        self.first = True
        self.ready: list[dict[str, torch.Tensor]] = []  # the rest of a worker's bundle, last first
        self.start_watch = StartWatch(options["multiprocessing_context"]) if self.workers else None
        self.restarted = self.superseded = False
        self.in_process: InProcessSource | None = None
        self.meter: Meter = options["meter"]
        # For ready_batches: [a view of the ring's stamps, their bytes at the last read, the end stamps sorted,
        # the ring's bundle]; None: made at the next call (a new ring)
        self._ends: list[Any] | None = None
        # Weakly: a strong reference made a cycle (delivery -> meter -> delivery) that kept a dropped
        # loader's persistent workers alive until a garbage collection.
        self.meter.delivery = weakref.ref(self)
        if reuse is not None:
            self._resume(*reuse)
        else:
            self._start(cursor)

    def _start(self, cursor: Cursor) -> None:
        self.loader, self.source = _data_loader(self.dataset, cursor, self.options)
        self._ends = None
        self.meter.ring = self.source.ring
        if self.workers:
            # The trainer's uncollected garbage is never finalised in a worker (statefulset.loading.worker_start).
            with frozen_for_fork():
                self.iterator = iter(self.loader)  # forks the workers
            torch_internals.check_iterator(self.iterator)
            self.start_watch.watch(self.source.ring.started)  # type: ignore[union-attr]
        else:
            self.iterator = iter(self.loader)
            if self.watchdog.timeout is not None:  # no workers: build on a thread, wait under the watchdog
                # Without a task encoder, STATEFULSET_READ_AHEAD batches a request (statefulset.loading.watchdog).
                ahead = max(read_ahead_depth(), 1) if self.source.encoder is None else 1
                self.in_process = InProcessSource(self.iterator, per_request=ahead)

    def _resume(self, loader: DataLoader, source: BatchSource, iterator: Any) -> None:
        """A new pass of persistent workers: torch drains the last pass's batches and restarts them."""
        self.loader, self.source = loader, source
        self._ends = None
        self.meter.ring = source.ring
        # The drain waits with the iterator's timeout: bound it by the watchdog's (or the loader's).
        period = self.watchdog.period(True)
        bound = min(x for x in (period * HARD_PERIODS if period else None, self.timeout or None, 3600.0) if x)
        torch_internals.set_wait_timeout(iterator, bound)
        try:
            self.iterator = iter(loader)
        except RuntimeError as exc:
            raise StatefulsetError(
                f"{describe_batch(source, self.next_t, self.workers)}: the persistent DataLoader workers did "
                f"not finish the last pass within {bound:g} s to start a new one: {exc}"
            ) from exc

    def _get(self, period: float | None) -> Any:
        if not self.workers:
            return next(self.iterator) if self.in_process is None else self.in_process.get(period)
        if self.start_watch is None or not self.start_watch.pending():
            return self._wait(period)
        # Until every worker has started, wait in steps of a second and look for stuck ones.
        waited = 0.0
        while True:
            step = POLL_SECONDS if period is None else min(POLL_SECONDS, max(period - waited, 1e-3))
            try:
                return self._wait(step)
            except TimedOut:
                waited += step
            stuck = self.start_watch.unstarted(self.iterator)
            if stuck:
                stop_workers(self.iterator, stuck)
                self.start_watch.restarted(stuck, self.next_t)
                self.meter.restarts += len(stuck)
                self.restarted = True
                c = self.source.cursor  # the same batches again, from the first one not delivered
                self._start(Cursor(c.base, self.next_t, c.dp_rank, c.dp_size, c.batch_size))
            if period is not None and waited >= period:
                raise TimedOut
            if self.timeout and waited >= self.timeout:
                raise StatefulsetError(
                    f"{describe_batch(self.source, self.next_t, self.workers)}: "
                    f"DataLoader timed out after {self.timeout} seconds"
                )

    def _wait(self, period: float | None) -> Any:
        """The next item within ``period`` seconds (None: no bound), or TimedOut."""
        # DataLoader reads its timeout for each batch; a timed-out wait leaves the iterator intact.
        limits = [x for x in (period, self.timeout or None) if x]
        torch_internals.set_wait_timeout(self.iterator, min(limits) if limits else 0)
        try:
            return next(self.iterator)
        except RuntimeError as exc:
            text = str(exc)
            if "timed out" in text and period is not None and (not self.timeout or period < self.timeout):
                raise TimedOut from None
            if "exited unexpectedly" in text or "timed out" in text:
                raise StatefulsetError(f"{describe_batch(self.source, self.next_t, self.workers)}: {text}") from exc
            raise

    def __next__(self) -> Any:
        start = perf_counter()  # the data wait (statefulset.loading.metrics): inline, no timer object a batch
        try:
            batch = self._next()
        except RuntimeError as exc:  # a worker died: torch says so wherever the trainer is
            named = named_worker_death(exc, describe_batch(self.source, self.next_t, self.workers))
            if named is None:
                raise
            raise named from exc
        finally:
            self.meter.wait += perf_counter() - start
        self.meter.batches += 1
        return batch

    def _next(self) -> Any:
        if self.superseded:
            raise StatefulsetError(
                "this pass of a validation loader was superseded by a later iter() of the same loader: its "
                "persistent workers serve one pass at a time (finish a pass, or use one loader per pass)"
            )
        if not self.ready:
            item = self.watchdog.wait(self._get, self.first, self._describe, self.meter)
            self.ready = receive(self.source, item, self.next_t)
            self.ready.reverse()
        batch = self.ready.pop()
        self.next_t += 1
        self.first = False
        if self.pin:
            batch = pin(batch)
        return batch

    def ready_batches(self) -> int:
        """Batches built ahead and not handed out yet: the rest of the current bundle, then every ring
        slot a worker has filled with a later bundle (its end stamp at or past the next batch).

        Read after every batch if need be: the slots' stamps change twice a bundle, so their bytes
        (all of them: a contiguous copy costs half a strided one of the end stamps alone) are compared
        with the last read's and the end stamps sorted again only when a worker wrote one; the count
        is then a bisection of that sorted list (exact: the same count as a scan of the stamps)."""
        ends = self._ends
        if ends is None:  # a view of the shared stamps, made once per ring (_start and _resume drop it)
            ring = self.source.ring if self.workers else None
            if ring is None:
                return len(self.ready)
            ends = self._ends = [ring.stamps.numpy(), b"", [], ring.bundle]
        stamps = ends[0].tobytes()
        if stamps != ends[1]:
            ends[1], ends[2] = stamps, sorted(numpy.frombuffer(stamps, dtype=numpy.int64)[1::2].tolist())
        ordered = ends[2]
        return len(self.ready) + ends[3] * (len(ordered) - bisect_left(ordered, self.next_t))

    def _describe(self) -> str:
        """The awaited batch, for the watchdog and the stall report: worker, positions, files, oldest request."""
        text = describe_batch(self.source, self.next_t, self.workers)
        if self.workers:
            text += f"; batches ready in the workers' slots: {self.ready_batches()}"
        shards = [d.path_prefix for d in self.dataset.stream.shards]
        found = storage_stats.oldest(self.meter.storage_rows(), shards)
        if found is not None:
            age, where = found
            text += f"; oldest storage request in flight: {age:.1f} s, reading {where + '.*' if where else '?'}"
        return text

    def __iter__(self) -> Delivery:
        return self
