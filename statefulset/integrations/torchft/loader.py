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
layout of DP size ``k·W`` placed at ``(C+i)·W·B``, so an ordinary :class:`~statefulset.loading.loader.SavableLoader`
over it builds them ahead in its workers (a *plan*). When the step asks for another replica-batch
(the quorum changed, a commit failed, the replica healed), the trainer process builds it at once and,
unless the plan still holds for the step after, a new plan starts after it (its workers forked now)
and the old plan's workers are stopped on a thread of their own. No state of its own: the
manager's is the cursor.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any, NamedTuple

import numpy

from statefulset.errors import StatefulsetError
from statefulset.loading.datasets import StreamDataset
from statefulset.loading.loader import SavableLoader, get_savable_loader
from statefulset.loading.worker_config import WorkerConfig

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


class _Plan(NamedTuple):
    loader: SavableLoader
    next_batch: int  # the replica-batch its next item holds
    stride: int


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
        get_savable_loader(self._dataset(0, 1, 0), **self.loader_options)  # refuse bad options now
        self._plan: _Plan | None = None
        self.last: Served | None = None  # what the last next() handed out

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

    def _dataset(self, rank: int, world_size: int, workers: int) -> StreamDataset:
        """The dataset with another layout (the stream, encoder and options shared)."""
        wc = self.dataset.worker_config
        other = copy.copy(self.dataset)
        other.worker_config = WorkerConfig(
            rank=rank, world_size=world_size, num_workers=workers,
            data_parallel_group=None, seed_offset=wc.seed_offset,
        )  # fmt: skip
        return other

    def _loader(self, first: int, stride: int, workers: int) -> SavableLoader:
        """Replica-batches ``first, first+stride, ...`` of this rank: DP rank r of DP size stride·W at first·W·B."""
        w, b = self.group_size, self.dataset.batch_size
        loader = get_savable_loader(self._dataset(self.group_rank, stride * w, workers), **self.loader_options)
        loader.restore_consumed_samples(first * w * b)
        return loader

    def _build(self, replica_batch: int) -> Any:
        """One replica-batch built here, in the trainer process (no worker to wait for)."""
        return next(iter(self._loader(replica_batch, 1, 0)))

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
            return self._build(n)
        # Counted in num_participants() even when its gradients are zeroed (torchft's init_sync at step 0).
        n = committed + rank
        self.last = Served(step, n, rank, participants, committed, bool(m.is_participating()))
        return self._serve(n, participants)

    def _serve(self, n: int, stride: int) -> Any:
        plan = self._plan
        if plan is not None and plan.next_batch == n and plan.stride == stride:
            batch = next(plan.loader)
            self._plan = plan._replace(next_batch=n + stride)
            return batch
        # Another replica-batch than the plan guessed: built here now. The plan goes on when it
        # still holds for the next step (a failed commit: the same step again); else a new plan's
        # workers start building the next steps, and the old plan's stop.
        if plan is None or plan.next_batch != n + stride or plan.stride != stride:
            if plan is not None:
                _log.info(
                    "torchft: the quorum moved this replica from replica-batch %d (stride %d) to %d (stride %d); "
                    "prefetched batches dropped",
                    plan.next_batch, plan.stride, n, stride,
                )  # fmt: skip
            # The old plan is dropped on a thread of its own: its workers finish the batch in hand and
            # are joined there (torch bounds each join), off the trainer's way to this batch.
            box = [plan] if plan is not None else []
            self._plan = None
            del plan
            if box:
                threading.Thread(target=box.clear, name="statefulset-torchft-release", daemon=True).start()
            loader = self._loader(n + stride, stride, self.dataset.worker_config.num_workers)
            iter(loader)  # starts the workers
            self._plan = _Plan(loader, n + stride, stride)
        return self._build(n)

    def __repr__(self) -> str:
        return (
            f"FaultTolerantLoader(group rank {self.group_rank} of {self.group_size}, "
            f"batch_size={self.dataset.batch_size}, last={self.last})"
        )


__all__ = ["FaultTolerantLoader", "Served"]
