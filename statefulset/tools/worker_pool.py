"""A small process pool that notices a dead worker: results in input order, every wait bounded.

``concurrent.futures.ProcessPoolExecutor`` was measured to hang here when its workers are killed
(SIGKILL of both workers of ``statefulset preprocess --workers 2``: the main process waits forever
beside two zombies), and ``multiprocessing.Pool`` silently replaces a killed worker and never
delivers the lost result. This pool gives each worker its own pipe, keeps at most ``depth``
tasks per worker in flight, and waits on the pipes *and* the workers' sentinels together, so a
worker that dies (OOM killer, SIGKILL) ends the run at once with an error naming the task it
held; a wait without news logs what it waits for every ``STATEFULSET_POOL_LOG_SECONDS``, and
one of ``STATEFULSET_TASK_TIMEOUT`` seconds (default an hour; a unit is ~1 MiB of input, seconds
of work) stops the run naming the units still held: a worker alive but stuck (a hung read of a
network filesystem, a deadlocked tokenizer) never makes the run wait forever.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import wait
from typing import Any

from statefulset import settings
from statefulset.errors import StatefulsetError

logger = logging.getLogger("statefulset")


class WorkerDied(StatefulsetError):
    """A worker process ended while it held a task."""


class WorkerStuck(StatefulsetError):
    """No worker delivered anything for ``STATEFULSET_TASK_TIMEOUT`` seconds."""


def no_news_limit() -> float:
    """Seconds a run waits for any unit of work to finish before it stops with an error."""
    return settings.TASK_TIMEOUT.get()


def _serve(connection: Any, function: Callable[[Any], Any], initializer: Callable[..., None], initargs: tuple) -> None:
    initializer(*initargs)
    while True:
        message = connection.recv()
        if message is None:
            return
        number, item = message
        try:
            connection.send((number, True, function(item)))
        except BaseException as exc:  # handed to the main process, which raises it
            connection.send((number, False, exc))


def _how(process: Any) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        with_name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        return f"killed by {with_name}"
    return f"exited with code {code}"


def ordered_map(
    function: Callable[[Any], Any],
    items: Iterable[Any],
    *,
    workers: int,
    initializer: Callable[..., None],
    initargs: tuple = (),
    depth: int = 2,
    describe: Callable[[Any], str] = repr,
) -> Iterator[tuple[Any, Any]]:
    """``(item, function(item))`` in input order, computed by ``workers`` processes (fork where available)."""
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    context = multiprocessing.get_context(method)
    period = settings.POOL_LOG_SECONDS.get()
    limit = no_news_limit()
    processes, connections = [], []
    for _ in range(workers):
        mine, theirs = context.Pipe()
        process = context.Process(target=_serve, args=(theirs, function, initializer, initargs), daemon=True)
        process.start()
        theirs.close()
        processes.append(process)
        connections.append(mine)
    held: list[deque[int]] = [deque() for _ in range(workers)]
    pending: dict[int, Any] = {}  # number -> item, for every task not yet yielded
    done: dict[int, Any] = {}
    source = iter(enumerate(items))
    exhausted, following = False, 0
    last_news = time.monotonic()
    try:
        while True:
            while not exhausted:  # keep every worker at `depth` tasks
                k = min(range(workers), key=lambda w: len(held[w]))
                if len(held[k]) >= depth:
                    break
                try:
                    number, item = next(source)
                except StopIteration:
                    exhausted = True
                    break
                pending[number] = item
                held[k].append(number)
                try:
                    connections[k].send((number, item))
                except OSError:  # its process is gone
                    raise WorkerDied(
                        f"{describe(item)}: a worker process {_how(processes[k])} (out of memory? killed?)"
                    ) from None
            while following in done:
                yield pending.pop(following), done.pop(following)
                following += 1
            if exhausted and not pending:
                return
            ready = wait(connections + [p.sentinel for p in processes], timeout=min(period, limit))
            if not ready:
                waiting = [describe(pending[held[w][0]]) for w in range(workers) if held[w]]
                if time.monotonic() - last_news >= limit:
                    raise WorkerStuck(
                        f"no worker finished a unit in {limit:g} s (STATEFULSET_TASK_TIMEOUT); still held: "
                        + "; ".join(waiting)
                    )
                logger.info("statefulset: still waiting for %d worker(s), on %s", len(waiting), "; ".join(waiting))
                continue
            for k, connection in enumerate(connections):
                if connection in ready:
                    try:
                        number, ok, value = connection.recv()
                    except (EOFError, OSError):
                        continue  # the worker died: its sentinel says so below
                    held[k].remove(number)
                    last_news = time.monotonic()
                    if not ok:
                        raise value
                    done[number] = value
            for k, process in enumerate(processes):
                if process.sentinel in ready and not process.is_alive():
                    what = describe(pending[held[k][0]]) if held[k] else "between tasks"
                    raise WorkerDied(f"{what}: a worker process {_how(process)} (out of memory? killed?)")
    finally:
        for connection in connections:
            with contextlib.suppress(OSError, ValueError):  # a worker already gone
                connection.send(None)
        for process in processes:
            process.join(timeout=1)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():  # stuck where SIGTERM is not acted on
                process.kill()
                process.join(timeout=5)
        for connection in connections:
            connection.close()
