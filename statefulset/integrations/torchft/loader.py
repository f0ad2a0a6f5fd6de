"""A torchft replica group's loader: the quorum places each step's batch, so the stream stays exactly once.

torchft (``torchft.Manager``) keeps training while replica groups fail and come back. Its
manager already agrees, for each step, on what the data needs: ``num_participants()`` and
``participating_rank()`` of the current quorum, and ``batches_committed()``, the number of
replica-batches committed so far (it grows by ``num_participants()`` at each committed step,
travels to healing replicas with the manager's state and is saved in its checkpoints).

A *replica-batch* is the batch of a whole replica group: ``W`` ranks of ``B`` rows each. Replica-batch
``n`` is micro-batch ``n`` of the contract's layout with DP size ``W``: rank ``r`` of the group holds
global positions ``(n·W + r)·B + j``. At each step the participant of rank ``i`` gets replica-batch
``batches_committed() + i``; so a committed step consumes replica-batches ``C .. C+k-1`` and moves
``C`` to ``C+k``, and every replica-batch below the committed frontier was consumed by exactly one
committed step. A step that no participant commits leaves ``C`` where it was: its replica-batches
go to whoever participates next time. A replica that does not participate (healing) gets
replica-batch ``C + k``, which its gradients (zeroed by torchft) never count.

Prefetch: with ``k`` participants and rank ``i`` the replica's next steps are ``C+i, C+i+k,
C+i+2k, ...`` as long as the quorum holds and every step commits: that is DP rank ``r`` of a
layout of DP size ``k·W`` placed at ``(C+i)·W·B`` (a *plan*), which persistent worker processes
build ahead (:mod:`statefulset.integrations.torchft.pool`). When a step asks for another
replica-batch (the quorum changed, a commit failed, the replica healed), it is built at once in the
trainer process (on its own thread, watched, when it reads local files only); when the plan no
longer holds for the step after (the quorum changed), the same workers are re-targeted in place to
the new plan, and what they prefetched for the old one is discarded, never served. No state of its
own: the manager's is the cursor.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, NamedTuple

import numpy
import torch

from statefulset.errors import StatefulsetError
from statefulset.integrations.torchft.pool import Options, PlanWorkers
from statefulset.loading.batches import BatchSource
from statefulset.loading.datasets import StreamDataset
from statefulset.loading.encoded import pin
from statefulset.loading.loader import get_savable_loader
from statefulset.loading.receive import receive
from statefulset.loading.state import Cursor
from statefulset.loading.watchdog import CallerWatch, InProcessSource
from statefulset.streams.documents import gather_fields

_log = logging.getLogger("statefulset")

MANAGER_METHODS = (
    "start_quorum",
    "participating_rank",
    "is_participating",
    "num_participants",
    "batches_committed",
    "current_step",
)


class Served(NamedTuple):
    """What one ``next()`` handed out, read from the manager when it was called.

    ``replica_batch`` is the number of the replica-batch (``n``); ``counted`` is False when torchft
    zeroes this replica's gradients (``is_participating()`` is False: it is healing);
    ``committed_before`` and ``participants`` are ``batches_committed()`` and ``num_participants()``.
    """

    step: int
    replica_batch: int
    rank: int | None
    participants: int
    committed_before: int
    counted: bool


# Served(...) runs NamedTuple's __new__, a Python function (~1.5 us a step on this machine, loaded);
# tuple.__new__ makes the same object in C, for the one made every step.
_new_served = tuple.__new__


class _Builder:
    """Replica-batches built in the trainer process, one per request (no worker to wait for).

    With workers, local files and no task encoder, on the trainer's own thread under a
    :class:`~statefulset.loading.watchdog.CallerWatch` (no thread to wake: a change's first step);
    else, while the watchdog is on, on a helper thread
    (:class:`~statefulset.loading.watchdog.InProcessSource`), so that the wait for a stalled read or
    encoder stays bounded; it holds the dataset, not the loader, so that the thread ends when the
    loader is dropped. One source for the loader's life: replica-batch
    ``n`` is its batch ``n`` (DP rank ``r`` of a layout of DP size ``W`` placed at 0).
    """

    def __init__(self, dataset: StreamDataset) -> None:
        stream, wc, b = dataset.stream, dataset.worker_config, dataset.batch_size
        wrap = None if stream.unbounded or not dataset.repeat else len(stream)
        cursor = Cursor(0, 0, wc.rank, wc.world_size, b)
        self.source = BatchSource(stream, cursor, None, wrap, None, dataset.document_boundaries, dataset.encoder)
        self.wanted: list[int] = []
        self.checked = False

    def build(self, n: int) -> Any:
        source = self.source
        if not self.checked:
            # The .bin files are still the ones opened: checked once, as each persistent worker does
            # (a stat per shard, or a metadata request per remote object, at every change cost the
            # changed step 0.03 ms locally); every read checks its file was not rewritten in place.
            source.stream.check_unchanged()
            self.checked = True
        if source.encoder is not None:
            return receive(source, ("local", n, source.encoded(n, None)), n)[0]
        return receive(source, (n, gather_fields(source.stream, source.positions(n), source.boundaries)), n)[0]

    def __iter__(self) -> _Builder:
        return self

    def __next__(self) -> tuple[int, Any]:
        n = self.wanted.pop()
        return n, self.build(n)  # tagged: a build the trainer gave up on is never taken for another


class FaultTolerantLoader:
    """This rank's batches under a torchft ``Manager``: call ``next()`` once per step, after ``start_quorum()``.

    ``dataset`` comes from ``get_train_dataset(spec, batch_size=B, worker_config=WorkerConfig(rank=r,
    world_size=W, num_workers=N))`` where ``r`` and ``W`` are this rank's place in its replica group
    (``W = 1`` for a replica group of one process). Every replica group must use the same spec, ``B``
    and ``W``. ``loader_options`` go to :func:`~statefulset.loading.loader.get_savable_loader` for
    each plan (``prefetch_factor``, ``multiprocessing_context``, the watchdog keywords, ...).

    ``next()`` waits for the quorum ``start_quorum()`` began (torchft bounds that wait by the
    manager's ``quorum_timeout``), then for its batch under the watchdog's bounds, as the savable
    loader does.
    """

    def __init__(self, dataset: StreamDataset, manager: Any, **loader_options: Any) -> None:
        if not isinstance(dataset, StreamDataset):
            raise StatefulsetError(
                f"FaultTolerantLoader: expected a dataset from get_train_dataset, got {type(dataset).__name__}"
            )
        missing = [name for name in MANAGER_METHODS if not callable(getattr(manager, name, None))]
        if missing:
            raise StatefulsetError(
                f"FaultTolerantLoader: the manager ({type(manager).__name__}) lacks {', '.join(missing)}: "
                "pass a torchft.Manager (torchft 0.2)"
            )
        if "worker_config" in loader_options:
            raise StatefulsetError("FaultTolerantLoader: the worker_config is the dataset's; do not pass one")
        self.dataset = dataset
        self.manager = manager
        self.loader_options = dict(loader_options)
        get_savable_loader(dataset, **self.loader_options)  # refuse bad options now
        self._options = Options.of(self.loader_options)
        self._workers: PlanWorkers | None = None  # forked at the first plan, re-targeted after
        self._plan: tuple[int, int] | None = None  # (the replica-batch the plan's next batch holds, stride)
        self._builder = _Builder(dataset)
        watched = self._options.watchdog.timeout is not None
        # Off-plan builds (a change's first step) on the trainer's own thread, watched without a
        # hand-off (waking a helper thread cost the changed step more than its build), when the build
        # only reads local memory-mapped files: with workers, no task encoder (user code), no object
        # storage (a stalled request raises at the watchdog's period, not at the storage timeouts).
        # Else on a helper thread (num_workers=0: every step), whose wait the watchdog bounds.
        here = bool(dataset.worker_config.num_workers) and dataset.encoder is None and not dataset.stream.remote
        self._watch = CallerWatch(self._options.watchdog, "statefulset-torchft-watch") if watched and here else None
        self._in_process = InProcessSource(self._builder, "statefulset-torchft-build") if watched and not here else None
        # The first replica-batch past the end of a stream that does not repeat (none: it never ends).
        ends = not dataset.repeat and not dataset.stream.unbounded
        self._end = len(dataset.stream) // (self.group_size * dataset.batch_size) if ends else math.inf
        self.last: Served | None = None  # what the last next() handed out
        self.built_here = 0  # replica-batches built in the trainer process: the steps off the plan

    # -- the layout -----------------------------------------------------------------------------
    @property
    def group_rank(self) -> int:
        return self.dataset.worker_config.rank

    @property
    def group_size(self) -> int:
        return self.dataset.worker_config.world_size

    def positions(self, replica_batch: int) -> numpy.ndarray:
        """The global positions of this rank's rows of replica-batch ``replica_batch``."""
        b, w = self.dataset.batch_size, self.group_size
        first = (replica_batch * w + self.group_rank) * b
        return numpy.arange(first, first + b, dtype=numpy.int64)

    def _ask(self, n: int) -> None:
        """Start building replica-batch ``n`` here, in the trainer process (on the helper thread,
        watched): the thread wakes while the caller re-targets the workers; :meth:`_take` waits."""
        self._builder.wanted.append(n)
        if self._in_process is not None:
            self._in_process.ask()

    def _here(self, n: int) -> Any:
        """Replica-batch ``n`` built on this thread, under the watchdog's clocks (:class:`CallerWatch`)."""
        watch: CallerWatch = self._watch  # type: ignore[assignment]
        what = functools.partial(self._building, n, "the trainer's own thread")
        start = watch.arm(False, what)
        try:
            batch = self._builder.build(n)
        except BaseException:
            watch.disarm()
            raise
        watch.check(start, False, what)
        return pin(batch) if self._options.pin_memory and torch.cuda.is_available() else batch

    def _take(self, n: int) -> Any:
        """Replica-batch ``n``, asked for by :meth:`_ask`. A build that an earlier ``next()`` gave up
        on (its watchdog raised while the helper thread still built it) may come first: it is another
        replica-batch's and is dropped, never served as this one."""
        while True:
            if self._in_process is None:
                built, batch = next(self._builder)
            else:
                built, batch = self._options.watchdog.wait(self._in_process.get, False, lambda: self._building(n))
            if built == n:
                self._builder.wanted.clear()  # nothing is building now: no request is left to answer
                break
            _log.info("torchft: dropped replica-batch %d, built for a next() that gave up waiting for it", built)
        return pin(batch) if self._options.pin_memory and torch.cuda.is_available() else batch

    def _building(self, n: int, where: str = "the trainer process") -> str:
        return f"{where} was building replica-batch {n} (stream positions from {self.positions(n)[0]})"

    def _ended(self, n: int) -> bool:
        """Whether replica-batch ``n`` lies past the end of a stream that does not repeat."""
        return n >= self._end  # (n + 1)·W·B > len(stream)

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> FaultTolerantLoader:
        return self

    def __next__(self) -> Any:
        m = self.manager
        participants = m.num_participants()  # waits for the quorum start_quorum() began
        if participants < 1:
            raise StatefulsetError(
                "FaultTolerantLoader: next() before manager.start_quorum() (the manager has no quorum); "
                "call start_quorum() at the start of every step, then next()"
            )
        rank = m.participating_rank()
        committed = m.batches_committed()
        step = m.current_step()
        if rank is None:
            # Healing (behind the others): outside the quorum's count, so its batch never counts.
            n = committed + participants
            self.last = Served(step, n, None, participants, committed, False)
            _log.info("torchft step %d: this replica is not participating; replica-batch %d is not counted", step, n)
            if self._ended(n):
                raise StopIteration
            if self._watch is not None:
                return self._here(n)
            self._ask(n)
            return self._take(n)
        # Counted in num_participants() even when its gradients are zeroed (torchft's init_sync at step 0).
        n = committed + rank
        self.last = _new_served(Served, (step, n, rank, participants, committed, bool(m.is_participating())))
        if self._plan == (n, participants) and n < self._end:
            # Stable membership: the quorum and the commits went as the plan guessed; its next batch,
            # prefetched (the common step: nothing else is read or checked).
            batch = self._workers.next()  # type: ignore[union-attr]
            self._plan = (n + participants, participants)
            return batch
        return self._serve(n, participants)

    def _serve(self, n: int, stride: int) -> Any:
        if self._ended(n):
            raise StopIteration
        workers = self.dataset.worker_config.num_workers
        if self._plan is not None and self._plan[0] == n:
            # The plan's next batch: prefetched. Also when the quorum changed but left this replica
            # its batch (a group above it left or joined): the workers then take the new plan after it.
            batch = self._workers.next()  # type: ignore[union-attr]
            if self._plan[1] != stride:
                _log.info("torchft: the quorum changed to stride %d after replica-batch %d; re-planned", stride, n)
                self._retarget(n + stride, stride)
            self._plan = (n + stride, stride)
            return batch
        batch = self._received(n)
        if batch is not None:
            if self._plan[1] != stride:  # type: ignore[index]
                self._retarget(n + stride, stride)
            self._plan = (n + stride, stride)
            return batch
        # Another replica-batch than the plan guessed: built here now. The plan goes on when it still
        # holds for the next step (a failed commit: the same step again); else the workers are
        # re-targeted in place to the new plan and what they built for the old one is dropped. The
        # build starts first, so that the helper thread wakes while the workers are re-targeted; but
        # after the fork of the first plan's workers (a fork must not copy a thread mid-build).
        self.built_here += 1
        replan = bool(workers) and self._plan != (n + stride, stride)
        if self._watch is not None:  # built on this thread: the workers told first, so they stop sooner
            if replan:
                self._replan(n, stride)
            return self._here(n)
        early = not replan or self._workers is not None
        if early:
            self._ask(n)
        if replan:
            self._replan(n, stride)
        if not early:
            self._ask(n)
        return self._take(n)

    def _replan(self, n: int, stride: int) -> None:
        """The workers' plan from the step after replica-batch ``n``: what they built for the old one is dropped."""
        if self._plan is not None:
            _log.info(
                "torchft: the quorum moved this replica from replica-batch %d (stride %d) to %d (stride %d); "
                "prefetched batches dropped",
                *self._plan, n, stride,
            )  # fmt: skip
        self._retarget(n + stride, stride)
        self._plan = (n + stride, stride)

    def _received(self, n: int) -> Any | None:
        """Replica-batch ``n`` when it is a later batch of the plan that the trainer already received
        from the workers (the quorum moved this replica up by a multiple of the old stride: a group
        joined below a replica that was alone, say); the plan's batches before it are dropped. None
        when it is not there: nothing is waited for."""
        if self._plan is None or self._workers is None:
            return None
        first, stride = self._plan
        if n <= first or (n - first) % stride:
            return None
        return self._workers.received((n - first) // stride)

    def _retarget(self, first: int, stride: int) -> None:
        """The workers' plan from now on: replica-batches ``first, first+stride, ...`` (the first plan forks them)."""
        if self._workers is None:
            self._workers = PlanWorkers(self.dataset, self._options)
        b, w = self.dataset.batch_size, self.group_size
        self._workers.retarget(first * w * b, stride * w)

    @property
    def workers(self) -> PlanWorkers | None:
        """The persistent workers (None before the first plan or with ``num_workers=0``): their
        ``pids()``, the same for the loader's life, and ``discarded``, results of dropped plans."""
        return self._workers

    def worker_pids(self) -> list[int]:
        """The process ids of the DataLoader workers (the same for the loader's whole life)."""
        return self._workers.pids() if self._workers is not None else []

    def close(self) -> None:
        """Stop the workers now (dropping the loader does too)."""
        workers, self._workers, self._plan = self._workers, None, None
        if workers is not None:
            workers.close()

    def __repr__(self) -> str:
        return (
            f"FaultTolerantLoader(group rank {self.group_rank} of {self.group_size}, "
            f"batch_size={self.dataset.batch_size}, last={self.last})"
        )


__all__ = ["FaultTolerantLoader", "Served"]
