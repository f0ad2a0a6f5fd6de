"""Forked DataLoader workers that never start: noticed within seconds, started again.

A forked child can deadlock before it runs a line of Python: if another thread of the trainer
held one of CPython's internal locks at the instant of the fork (a thread being created or
ending, or a C++ thread taking the GIL), the child waits for that lock
forever (CPython gh-112275, in ``PyOS_AfterFork_Child``). Measured here on Python 3.11.7: 3 of 46
runs of ``tests/test_dcp.py`` (4 gloo ranks, each forking 3 workers after a checkpoint) had a
worker stuck so; the trainer then waited for its first batch until the watchdog's 10 minutes.

Each worker raises its flag in the batch ring as its first act (:mod:`statefulset.loading.batches`),
milliseconds after the fork. While a flag is down the loader looks every second; a worker still
silent ``STATEFULSET_WORKER_START_TIMEOUT`` seconds (default 30) after the fork is taken for dead:
the workers are stopped and started again from the next undelivered micro-batch, which gives the
same batches (they are a function of the batch number). After ``MAX_STARTS`` tries the loader
raises a ``StatefulsetError`` naming the workers and what to do. Workers made by ``spawn`` or
``forkserver`` start from a fresh interpreter and cannot hit this; they are not watched (they
may take many seconds to import torch).

Two more hazards of a fork, shared by every loader that forks workers (the savable loader's
:mod:`statefulset.loading.delivery` and torchft's :mod:`statefulset.integrations.torchft.pool`):

- an object the trainer dropped but has not collected yet (a torchft ``ManagerServer``, anything
  whose finaliser joins a thread or talks to a server) would be collected, and finalised, in a
  worker, where the threads it waits for do not exist: the worker hangs. The fork happens under
  :func:`frozen_for_fork`, and what is frozen then is never collected in the children;
- torch's worker reads the pid of the parent it watches only after its start, so a trainer killed
  while a worker was starting left the worker adopted by init and watching init, alive for good.
  :class:`ParentCheck`, the worker's first act, exits at once when its parent is no longer the
  trainer that forked it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from statefulset import settings
from statefulset.errors import StatefulsetError
from statefulset.index import compiled
from statefulset.loading import torch_internals

log = logging.getLogger("statefulset")
MAX_STARTS = 4
POLL_SECONDS = 1.0


def start_timeout() -> float:
    return settings.WORKER_START_TIMEOUT.get()


def forks(context: Any) -> bool:
    """Whether a DataLoader given ``multiprocessing_context=context`` forks its workers."""
    if context is None:
        return multiprocessing.get_start_method() == "fork"
    if isinstance(context, str):
        return context == "fork"
    return context.get_start_method() == "fork"


class StartWatch:
    """Watches one DataLoader iterator's workers until every one has raised its start flag."""

    def __init__(self, context: Any) -> None:
        self.forking = forks(context)
        self.timeout = start_timeout() if self.forking else 0.0
        self.starts = 0
        self.active = False

    def watch(self, flags: Any) -> None:
        """Watch a new set of workers (``flags``: their shared int8 start flags), just forked."""
        self.flags, self.since, self.active = flags, time.monotonic(), self.forking
        self.starts += 1

    def pending(self) -> bool:
        if self.active and bool(self.flags.all()):
            self.active = False
        return self.active

    def unstarted(self, iterator: Any) -> list[tuple[int, int | None]]:
        """``(worker, pid)`` of the workers whose flag is down, once the start timeout has passed."""
        if not self.pending() or time.monotonic() - self.since < self.timeout:
            return []
        workers = torch_internals.worker_processes(iterator)
        return [(w, workers[w].pid if w < len(workers) else None) for w in range(len(self.flags)) if not self.flags[w]]

    def restarted(self, stuck: list[tuple[int, int | None]], next_t: int) -> None:
        """Say that the workers start again (after :func:`stop_workers`), or raise after ``MAX_STARTS``."""
        named = ", ".join(f"{w} (pid {pid})" for w, pid in stuck)
        if self.starts >= MAX_STARTS:
            raise StatefulsetError(
                f"DataLoader worker(s) {named} did not start within {self.timeout:g} s of being forked, "
                f"{self.starts} times in a row: a forked worker deadlocks at birth when another thread of "
                "the trainer holds one of CPython's internal locks at the fork (CPython gh-112275). Pass "
                "multiprocessing_context='forkserver' to the loader, or raise "
                "STATEFULSET_WORKER_START_TIMEOUT if your workers are only slow to start"
            )
        log.warning(
            "statefulset: DataLoader worker(s) %s did not start within %g s of being forked (a fork "
            "deadlock, CPython gh-112275); starting the workers again from micro-batch %d (try %d of %d)",
            named,
            self.timeout,
            next_t,
            self.starts + 1,
            MAX_STARTS,
        )


def stop_workers(iterator: Any, stuck: list[tuple[int, int | None]]) -> None:
    """Stop a DataLoader iterator's workers, the ``stuck`` ones (running no Python) by SIGKILL."""
    torch_internals.stop_workers(iterator, [w for w, _ in stuck])


@contextlib.contextmanager
def frozen_for_fork() -> Iterator[None]:
    """Fork workers inside this block: every object the trainer tracks now is frozen (``gc.freeze``),
    so no forked child ever collects one, and thawed in the trainer afterwards.

    A trainer that froze objects itself (``gc.freeze`` before forking, as Python's docs advise
    for memory sharing) keeps them frozen: then nothing is thawed.

    The compiled kernels are loaded first, here: a worker would otherwise load them at its first
    batch, importing ``numpy.ctypeslib``, and a fork while another thread of the trainer held that
    module's import lock (another rank's thread loading them) left the child waiting on it forever.
    Loaded here, the fork waits for that thread's import instead, and no worker imports anything.
    """
    compiled.library()
    thaw = gc.get_freeze_count() == 0
    gc.freeze()
    try:
        yield
    finally:
        if thaw:
            gc.unfreeze()


def exit_if_orphaned(parent: int | None) -> None:
    """In a worker, before torch's watch on its parent begins: exit at once when the process that
    forked it (``parent``; None: not forked, nothing to check) has died meanwhile, and from then on
    whenever it dies (a daemon thread looks every ``POLL_SECONDS``).

    torch's watch takes the parent it sees when it starts for the trainer: the parent it sees after
    the trainer died is init (or a subreaper), and the worker would wait for requests forever. This
    check runs a moment before torch's watch starts, so a trainer killed in between left the worker
    behind (seen: tests/test_torchft.py's SIGKILL test under load, a worker with parent 1 still
    polling for requests 20 minutes on); the thread closes that gap."""
    if parent is None:
        return
    if os.getppid() != parent:
        os._exit(0)
    threading.Thread(target=_exit_with, args=(parent,), name="statefulset-parent-watch", daemon=True).start()


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_SECONDS)
    os._exit(0)


class ParentCheck:
    """A DataLoader ``worker_init_fn`` that is :func:`exit_if_orphaned` (picklable, for any start method).

    ``parent``: the trainer's pid when the workers are forked (:func:`forks`), else None.
    """

    def __init__(self, parent: int | None) -> None:
        self.parent = parent

    def __call__(self, worker_id: int) -> None:
        exit_if_orphaned(self.parent)


def named_worker_death(exc: RuntimeError, where: str) -> StatefulsetError | None:
    """torch's error for a DataLoader worker that died, as a ``StatefulsetError`` saying ``where``
    (the awaited batch); None for any other error.

    torch's SIGCHLD handler raises it in the trainer's main thread wherever that is when a worker
    dies: inside torch's own wait (``exited unexpectedly``), or anywhere else in ``next()``, such as
    while a bundle is copied out of the ring (``is killed by signal``).
    """
    text = str(exc)
    return StatefulsetError(f"{where}: {text}") if "DataLoader worker (pid" in text else None
