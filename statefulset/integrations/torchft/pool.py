"""FaultTolerantLoader's workers: forked once, re-targeted in place when the quorum changes.

A *plan* is what the workers build ahead: this rank's batches ``t, t+1, ...`` of a layout (a
:class:`~statefulset.loading.state.Cursor`: DP rank ``r`` of DP size ``k·W`` placed after the
committed frontier), under a *generation* number. The worker processes live as long as the loader.
They are torch ``DataLoader`` workers over a map-style dataset whose indices are *requests*,
``(generation, base, dp_size, t, count)``: build batches ``t .. t+count-1`` of that layout into
the next slot of the worker's batch ring (:mod:`statefulset.loading.batches`). The requests come
from a :class:`Feed` that stands where a sampler would, in the trainer process, so torch keeps
doing what it does for the savable loader (at most ``prefetch_factor`` requests in flight per
worker, results in request order, the parent watched by every worker) while the trainer decides
what is asked.

A quorum change is a new plan, sent to the live workers: the trainer raises the generation, in
shared memory and in its own copy, and the feed's next requests are the new plan's. A worker drops
a request of an older generation unbuilt, and stops a bundle mid-way when the generation moves
under it; the trainer discards every result of an older generation without reading its slot. So
no batch of an old plan is ever served, and no process starts. The new plan's first requests are
of one batch, then 2, 4, ... up to the ring's bundle, so that its first batch waits for one build,
not a bundle's.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from statefulset.errors import StatefulsetError
from statefulset.index.native.keys import derive_key
from statefulset.loading import torch_internals
from statefulset.loading.batches import BatchSource
from statefulset.loading.datasets import StreamDataset
from statefulset.loading.encoded import pin
from statefulset.loading.receive import receive
from statefulset.loading.ring import BatchRing, make_ring
from statefulset.loading.state import Cursor
from statefulset.loading.watchdog import STALL_SECONDS, TimedOut, Watchdog
from statefulset.loading.worker_start import (
    POLL_SECONDS,
    StartWatch,
    exit_if_orphaned,
    frozen_for_fork,
    named_worker_death,
    stop_workers,
)
from statefulset.shards import storage_stats

_log = logging.getLogger("statefulset")


@dataclass(frozen=True)
class Options:
    """The ``get_savable_loader`` keywords the workers honour (the others have nothing to tune here)."""

    prefetch_factor: int
    pin_memory: bool
    multiprocessing_context: Any
    timeout: float
    watchdog: Watchdog

    @classmethod
    def of(cls, options: dict[str, Any]) -> Options:
        """From keywords that ``get_savable_loader`` accepted, with its defaults."""
        watchdog = Watchdog(
            options.get("watchdog_timeout_seconds", 60),
            options.get("watchdog_initial_timeout_seconds"),
            options.get("fail_on_timeout", False),
            options.get("stall_seconds", STALL_SECONDS),
        )
        return cls(
            options.get("prefetch_factor", 2), bool(options.get("pin_memory", False)),
            options.get("multiprocessing_context"), options.get("timeout", 0), watchdog,
        )  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """A plan: its generation number and the layout its batches follow."""

    generation: int
    cursor: Cursor  # batch t of the plan holds cursor.positions(t); t counts on across plans


class Feed:
    """The requests the DataLoader sends to the workers (a sampler's place): the current plan's
    bundles in order, one batch at first after a change, then doubling up to ``bundle``."""

    def __init__(self, bundle: int) -> None:
        self.bundle = bundle
        self.plan: Plan | None = None
        self.next_t = 0
        self.size = 1

    def start(self, plan: Plan, t: int) -> None:
        self.plan, self.next_t, self.size = plan, t, 1

    def __iter__(self) -> Any:
        while True:
            plan, t, count = self.plan, self.next_t, self.size
            if plan is None:
                raise StatefulsetError("internal: the torchft workers were asked for a batch before a plan")
            self.next_t, self.size = t + count, min(self.bundle, 2 * count)
            yield plan.generation, plan.cursor.base, plan.cursor.dp_size, t, count


class Builds(Dataset):
    """What a worker does with a request (in the worker process): ``(generation, note)``, where the
    note is what :func:`~statefulset.loading.receive.receive` takes, or None when the request's
    plan was replaced before or while it was built."""

    def __init__(self, source: BatchSource, generation: torch.Tensor, trainer: int | None) -> None:
        self.source = source
        self.generation = generation  # shared: the current plan's generation
        self.view: Any = None  # the worker's numpy view of it, made there (a tensor index costs ~5 us a batch)
        self.trainer = trainer  # the forking trainer's pid (None: not forked)
        self.requests = 0
        self.checked = False

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "view": None}  # spawn/forkserver: the tensor travels shared, the view is remade

    def current(self) -> int:
        """The current plan's generation, read before each batch."""
        view = self.view
        if view is None:
            view = self.view = self.generation.numpy()
        return int(view[0])

    def __getitem__(self, request: tuple[int, int, int, int, int]) -> tuple[int, Any]:
        generation, base, dp_size, first, count = request
        if self.current() != generation:
            return generation, None
        info = get_worker_info()
        worker = info.id if info is not None else 0
        source, ring = self.source, self.source.ring
        # Consecutive requests take consecutive slots: torch keeps at most prefetch_factor requests
        # in flight per worker, so the slot the trainer reads is never the one being written.
        slot = self.requests % ring.slots  # type: ignore[union-attr]
        self.requests += 1
        if not self.checked:
            try:
                source.stream.check_unchanged()  # the .bin files are still the ones opened
            except Exception as exc:
                return generation, ("error", worker, first, f"{type(exc).__name__}: {exc}")
            self.checked = True
        c = source.cursor
        if c.base != base or c.dp_size != dp_size:  # another plan's layout (a change): made once per plan
            source.cursor = Cursor(base, 0, c.dp_rank, dp_size, c.batch_size)
        numbers = range(first, first + count)
        return generation, source.fill(ring, worker, slot, numbers, lambda: self.current() != generation)  # type: ignore[arg-type]


def _started(worker_id: int) -> None:
    """A worker's first act (worker_init_fn): its start flag, its storage counters."""
    info = get_worker_info()
    builds: Builds = info.dataset  # type: ignore[union-attr,assignment]
    exit_if_orphaned(builds.trainer)  # the trainer died while this worker started (seen in the SIGKILL test)
    source = builds.source
    ring: BatchRing = source.ring  # type: ignore[assignment]
    ring.started[worker_id] = 1
    storage_stats.attach(ring.stats[worker_id].numpy(), [d.path_prefix for d in source.stream.shards])


def _identity(item: Any) -> Any:
    return item


class PlanWorkers:
    """``dataset.worker_config.num_workers`` persistent workers building this rank's plan ahead.

    :meth:`retarget` starts a plan (the first forks the workers); :meth:`next` hands out its
    batches in order. Every wait is under the watchdog's bounds (and ``timeout``), as the savable
    loader's; :meth:`close` stops the workers (so does dropping this object), and torch's workers
    leave by themselves when the trainer process dies.
    """

    def __init__(self, dataset: StreamDataset, options: Options) -> None:
        self.dataset, self.options = dataset, options
        self.workers = dataset.worker_config.num_workers
        stream, b = dataset.stream, dataset.batch_size
        fields = dataset.fields()
        self.ring = make_ring(self.workers, options.prefetch_factor + 1, b, fields, dataset.encoder)
        self.generation = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.generation_view = self.generation.numpy()  # written at each change: numpy's store, not torch's
        self.wrap = None if stream.unbounded or not dataset.repeat else len(stream)
        self.feed = Feed(self.ring.bundle)
        self.plan: Plan | None = None
        self.source: BatchSource | None = None  # the trainer's view of the plan (for receive)
        self.expected = 0  # the next batch number to hand out
        self.ready: list[Any] = []  # the rest of the current bundle, last first
        self.discarded = 0  # results of older plans dropped unread
        self.iterator: Any = None
        self.first = True
        self.start_watch = StartWatch(options.multiprocessing_context)
        self.pin_memory = options.pin_memory and torch.cuda.is_available()  # read once, not per batch

    def _source(self, cursor: Cursor) -> BatchSource:
        d = self.dataset
        return BatchSource(d.stream, cursor, None, self.wrap, self.ring, d.document_boundaries, d.encoder)

    def retarget(self, first: int, dp_size: int) -> None:
        """The plan from now on: batch ``k`` of it holds global positions ``first + (k·dp_size + r)·B + j``."""
        b, rank = self.dataset.batch_size, self.dataset.worker_config.rank
        cursor = Cursor(first - self.expected * dp_size * b, 0, rank, dp_size, b)
        generation = self.plan.generation + 1 if self.plan is not None else 1
        self.plan = Plan(generation, cursor)
        self.generation_view[0] = generation  # the workers drop what they build for an older plan
        self.source = self._source(cursor)
        self.ready.clear()
        self.feed.start(self.plan, self.expected)
        if self.iterator is None:
            self._start()

    def _start(self) -> None:
        """Fork the workers (the first plan, or again after a worker that never started)."""
        d = self.dataset
        seed = derive_key(d.stream.spec.seed, d.worker_config.seed_offset, d.worker_config.rank) >> 1
        self.ring.started.zero_()
        forking = self.start_watch.forking
        loader = DataLoader(
            Builds(self._source(self.plan.cursor), self.generation, os.getpid() if forking else None),  # type: ignore[union-attr]
            batch_size=None, sampler=self.feed, collate_fn=_identity, num_workers=self.workers,
            prefetch_factor=self.options.prefetch_factor, persistent_workers=True, worker_init_fn=_started,
            multiprocessing_context=self.options.multiprocessing_context,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        self.feed.start(self.plan, self.expected)  # type: ignore[arg-type]
        # Garbage of the trainer (a dropped torchft ManagerServer, say) must not be collected in a
        # forked worker: its finalizer waits for threads that a fork does not copy (seen here: a
        # worker's first collection hung in tokio's runtime shutdown, the workers never started).
        with frozen_for_fork():
            self.iterator = iter(loader)  # forks the workers
        torch_internals.check_iterator(self.iterator)
        self.start_watch.watch(self.ring.started)

    def pids(self) -> list[int]:
        """The worker processes' ids, in worker order."""
        return [p.pid for p in torch_internals.worker_processes(self.iterator)] if self.iterator is not None else []

    def built_ahead(self) -> int:
        """Bundles the workers have finished and the trainer has not taken (their ring slots' end
        stamps at or past the next batch)."""
        return int((self.ring.stamps.numpy()[:, :, 1] >= self.expected).sum())

    def received(self, k: int) -> Any | None:
        """The plan's batch ``k`` after the next one when the trainer already holds it (a bundle taken
        from the ring, not yet handed out), the ``k`` before it dropped unserved; else None (no wait)."""
        if k >= len(self.ready):
            return None
        del self.ready[len(self.ready) - k :]  # ready is last first: its end holds the next batches
        self.expected += k
        return self._next()

    def next(self) -> Any:
        """The plan's next batch: older plans' results are discarded unread."""
        ready = self.ready
        if ready and not self.pin_memory:  # the rest of a bundle the trainer holds: nothing to wait for
            self.expected += 1
            return ready.pop()
        try:
            return self._next()
        except RuntimeError as exc:  # a worker died: torch says so wherever the trainer is
            named = named_worker_death(exc, self._describe())
            if named is None:
                raise
            raise named from exc

    def _next(self) -> Any:
        while not self.ready:
            item = self.options.watchdog.wait(self._get, self.first, self._describe)
            generation, note = item
            if generation != self.plan.generation:  # type: ignore[union-attr]
                self.discarded += 1
                continue
            if note is None:
                raise StatefulsetError(f"internal: a worker dropped a request of the current plan {generation}")
            self.ready = receive(self.source, note, self.expected)  # type: ignore[arg-type]
            self.ready.reverse()
            self.first = False
        batch = self.ready.pop()
        self.expected += 1
        return pin(batch) if self.pin_memory else batch

    def _get(self, period: float | None) -> Any:
        if not self.start_watch.pending():
            return self._wait(period)
        waited = 0.0  # until every worker has started: steps of a second, looking for stuck ones
        while True:
            step = POLL_SECONDS if period is None else min(POLL_SECONDS, max(period - waited, 1e-3))
            try:
                return self._wait(step)
            except TimedOut:
                waited += step
            stuck = self.start_watch.unstarted(self.iterator)
            if stuck:
                stop_workers(self.iterator, stuck)
                self.start_watch.restarted(stuck, self.expected)
                self.ready.clear()
                self._start()
            if period is not None and waited >= period:
                raise TimedOut

    def _wait(self, period: float | None) -> Any:
        """The next result within ``period`` seconds (None: no bound but the loader's timeout), or TimedOut."""
        timeout = self.options.timeout
        limits = [x for x in (period, timeout or None) if x]
        torch_internals.set_wait_timeout(self.iterator, min(limits) if limits else 0)
        try:
            return next(self.iterator)
        except RuntimeError as exc:
            text = str(exc)
            if "timed out" in text and period is not None and (not timeout or period < timeout):
                raise TimedOut from None
            if "exited unexpectedly" in text or "timed out" in text:
                raise StatefulsetError(f"{self._describe()}: {text}") from exc
            raise

    def _describe(self) -> str:
        """The awaited batch, for the watchdog: its positions, the plan, the workers."""
        positions = self.source.positions(self.expected)  # type: ignore[union-attr]
        started = self.ring.started.tolist()
        return (
            f"the torchft loader's persistent DataLoader workers (pids {self.pids()}, started {started}) "
            f"were building micro-batch {self.expected} of plan {self.plan.generation} "  # type: ignore[union-attr]
            f"(stream positions {int(positions[0])}..{int(positions[-1])})"
        )

    def close(self) -> None:
        """Stop the workers (each is joined under torch's bound, then terminated)."""
        iterator, self.iterator = self.iterator, None
        if iterator is not None:
            stop_workers(iterator, [])
