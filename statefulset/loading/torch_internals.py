"""Every use of ``torch.utils.data.DataLoader``'s private parts, in one place, checked before use.

The loader leans on a few attributes torch does not promise to keep:

- ``_MultiProcessingDataLoaderIter._timeout``: read for each batch, so a wait can be bounded
  per call (the watchdog's period) without tearing the iterator down;
- ``._workers`` (the worker processes), ``._worker_pids_set``, ``._shutdown_workers()`` and
  ``torch.utils.data._utils.signal_handling._remove_worker_pids``: to stop workers that never
  started (:mod:`statefulset.loading.worker_start`);
- the prefetch policy (``_try_put_index`` keeps at most ``prefetch_factor`` requests per worker
  outstanding), on which the batch ring's slot count rests (:mod:`statefulset.loading.batches`).
  The ring does not trust it blindly: each slot carries sequence stamps that the trainer checks
  after copying, so a torch that prefetched more would raise, never hand over a torn batch.

:func:`check_iterator` runs on every new multi-process iterator: if torch renamed or removed
any of these, the loader stops with a ``StatefulsetError`` that names them and the tested torch
versions, instead of an ``AttributeError`` deep in a wait, or a silent change of behaviour.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from statefulset.errors import StatefulsetError

_log = logging.getLogger(__name__)
TERM_GRACE_SECONDS = 2.0  # after torch's shutdown: how long terminated workers get to end before SIGKILL
KILL_WAIT_SECONDS = 5.0  # how long a SIGKILLed worker may take to be reaped
TESTED = "torch 2.4.1 and 2.13.0"  # the floor (pyproject.toml) and what CI runs
ITERATOR_ATTRIBUTES = ("_timeout", "_workers", "_worker_pids_set", "_shutdown_workers", "_try_put_index")


def _changed(what: list[str]) -> StatefulsetError:
    return StatefulsetError(
        f"torch {torch.__version__} changed DataLoader internals that statefulset relies on "
        f"(missing: {', '.join(what)}); statefulset was tested with {TESTED}. Install a tested torch, "
        "or run with num_workers=0 (which uses none of them) until statefulset supports this one"
    )


def check_iterator(iterator: Any) -> None:
    """Raise a ``StatefulsetError`` if a multi-process DataLoader iterator lacks what we use."""
    missing = [name for name in ITERATOR_ATTRIBUTES if not hasattr(iterator, name)]
    try:
        from torch.utils.data._utils import signal_handling

        if not hasattr(signal_handling, "_remove_worker_pids"):
            missing.append("torch.utils.data._utils.signal_handling._remove_worker_pids")
    except ImportError:
        missing.append("torch.utils.data._utils.signal_handling")
    if missing:
        raise _changed(missing)


def set_wait_timeout(iterator: Any, seconds: float) -> None:
    """How long the iterator's next ``next()`` waits for a worker (0: no bound); it raises on expiry."""
    iterator._timeout = seconds


def worker_processes(iterator: Any) -> list[Any]:
    """The iterator's worker processes (``multiprocessing.Process``), in worker order."""
    return list(getattr(iterator, "_workers", []))


def stop_workers(iterator: Any, kill: list[int]) -> None:
    """Stop every worker of ``iterator``; the ``kill`` ones (running no Python) by SIGKILL first."""
    from torch.utils.data._utils import signal_handling

    # Off torch's SIGCHLD watch first: a watched worker that dies by a signal makes the trainer raise.
    if iterator._worker_pids_set:
        signal_handling._remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False
    workers = worker_processes(iterator)
    for w in kill:
        if w < len(workers) and workers[w].is_alive():
            workers[w].kill()  # not SIGTERM: the child may have inherited a handler it never runs
            workers[w].join(timeout=5)
    iterator._shutdown_workers()  # the started ones leave on their done event; torch SIGTERMs the rest
    _end_survivors(workers)


def _end_survivors(workers: list[Any]) -> None:
    """Wait (bounded) for every worker to end; SIGKILL the ones that still run and reap them.

    torch's shutdown joins each worker for a few seconds, SIGTERMs those still alive and moves on
    without waiting: a worker that cannot act on SIGTERM (stopped, or blocked where its inherited
    handler never runs) would outlive its loader. A full CI run left such a worker waiting on a
    futex after the torchft pool closed.
    """
    deadline = time.monotonic() + TERM_GRACE_SECONDS
    for w in workers:
        w.join(timeout=max(deadline - time.monotonic(), 0.0))
    for w in workers:
        if w.is_alive():
            _log.warning("DataLoader worker (pid %s) did not end on torch's shutdown or SIGTERM: killing it", w.pid)
            w.kill()
            w.join(timeout=KILL_WAIT_SECONDS)
            if w.is_alive():
                _log.warning(
                    "DataLoader worker (pid %s) still runs %.0f s after SIGKILL (uninterruptible I/O?)",
                    w.pid, KILL_WAIT_SECONDS,
                )  # fmt: skip
