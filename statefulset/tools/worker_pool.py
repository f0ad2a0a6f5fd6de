"""A small process pool that notices a dead worker: results in input order, every wait bounded.

``concurrent.futures.ProcessPoolExecutor`` was measured to hang here when its workers are killed
(SIGKILL of both workers of ``statefulset preprocess --workers 2``: the main process waits forever
beside two zombies), and ``multiprocessing.Pool`` silently replaces a killed worker and never
delivers the lost result.

Each worker has two one-way pipes, one for tasks and one for results
(:mod:`statefulset.tools.pipe_messages`). The main process never blocks on either: it writes what
a task pipe accepts and reads what a result pipe holds, in one ``poll`` that also watches the
workers' sentinels, so a task of 1 MiB and a result of several MB never wait on each other (5cf6a81
shared one duplex socket per worker and deadlocked on gzip input). At most ``depth`` tasks per
worker are in flight, and at most ``workers * depth`` results wait to be handed on in order.

A worker that dies (OOM killer, SIGKILL) ends the run at once with an error naming the task it
held; a wait without news logs what it waits for every ``STATEFULSET_POOL_LOG_SECONDS``, and one
of ``STATEFULSET_TASK_TIMEOUT`` seconds (default an hour; a unit is ~1 MiB of input, seconds of
work) stops the run naming the units still held and what each waits for (its worker, or the pipe
to it): a worker alive but stuck never makes the run wait forever.

Workers die with the main process: each closes the main process's ends of every pipe it inherited
(so a sibling's pipes see end-of-file when the main process goes), asks Linux for SIGKILL when its
parent dies (``PR_SET_PDEATHSIG``), and watches its parent's pid elsewhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import pickle
import select
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from statefulset import settings
from statefulset.errors import StatefulsetError
from statefulset.tools import pipe_messages
from statefulset.tools.pipe_messages import Receiver, Sender

logger = logging.getLogger("statefulset")
PR_SET_PDEATHSIG = 1
PARENT_WATCH_SECONDS = 1.0
JOIN_SECONDS = 5.0


class WorkerDied(StatefulsetError):
    """A worker process ended while it held a task."""


class WorkerStuck(StatefulsetError):
    """No worker delivered anything for ``STATEFULSET_TASK_TIMEOUT`` seconds."""


def no_news_limit() -> float:
    """Seconds a run waits for any unit of work to finish before it stops with an error."""
    return settings.TASK_TIMEOUT.get()


# -- worker side ----------------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` ends: prctl on Linux, and a thread watching the parent's pid."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_WATCH_SECONDS)
        os.kill(os.getpid(), signal.SIGKILL)

    if os.getppid() != parent:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="statefulset-parent-watch", daemon=True).start()


def _reply(number: Any, ok: bool, value: Any) -> bytes:
    try:
        payload = pipe_messages.dumps((number, ok, value))
        if not ok:
            pickle.loads(payload)  # an exception class that pickles but does not unpickle
        return payload
    except Exception as exc:  # an exception (or result) that does not pickle: its text still reaches the user
        error = value if not ok else exc
        return pipe_messages.dumps((number, False, StatefulsetError(f"{type(error).__name__}: {error}")))


def _serve(
    tasks: int, results: int, inherited: list[int], parent: int,
    function: Callable[[Any], Any], initializer: Callable[..., None], initargs: tuple,
) -> None:  # fmt: skip
    _die_with_parent(parent)
    for fd in inherited:  # the main process's ends of our pipes and of earlier workers' pipes
        with contextlib.suppress(OSError):
            os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to act on; it stops us
    try:
        try:
            initializer(*initargs)
        except BaseException as exc:
            pipe_messages.write_blocking(results, _reply(None, False, exc))
            return
        while (message := pipe_messages.read_blocking(tasks)) is not None:
            number, item = pickle.loads(message)
            try:
                reply = _reply(number, True, function(item))
            except BaseException as exc:  # handed to the main process, which raises it
                reply = _reply(number, False, exc)
            pipe_messages.write_blocking(results, reply)
    except BrokenPipeError:  # the main process stopped reading: it is ending the run, or gone
        return


# -- main process side ----------------------------------------------------------------------


def _how(process: Any) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        with_name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        return f"killed by {with_name}"
    return f"exited with code {code}"


@dataclass
class _Worker:
    process: Any
    tasks: Sender
    results: Receiver
    held: deque[int] = field(default_factory=deque)


class _Pool:
    """The workers, their pipes and the tasks each holds; :meth:`wait` is the one place that waits."""

    def __init__(
        self, workers: int, function: Callable, initializer: Callable, initargs: tuple, describe: Callable[[Any], str]
    ) -> None:
        self.describe = describe
        context = multiprocessing.get_context("fork")
        self.workers: list[_Worker] = []
        self.items: dict[int, Any] = {}  # number -> item, for every task sent and not yet answered
        self.last_news = time.monotonic()
        ours: list[int] = []  # the main process's pipe ends so far: no worker may keep them open
        try:
            for _ in range(workers):
                task_r, task_w = pipe_messages.pipe()
                result_r, result_w = pipe_messages.pipe()
                ours += [task_w, result_r]
                args = (task_r, result_w, list(ours), os.getpid(), function, initializer, initargs)
                process = context.Process(target=_serve, args=args, daemon=True)
                try:
                    process.start()
                finally:
                    os.close(task_r)
                    os.close(result_w)
                self.workers.append(_Worker(process, Sender(task_w), Receiver(result_r)))
        except BaseException:
            self.close(failed=True)
            raise

    def idle(self, depth: int) -> _Worker | None:
        worker = min(self.workers, key=lambda w: len(w.held))
        return worker if len(worker.held) < depth else None

    def submit(self, worker: _Worker, number: int, item: Any) -> None:
        self.items[number] = item
        worker.held.append(number)
        worker.tasks.put(pipe_messages.dumps((number, item)))
        self._flush(worker)

    def _flush(self, worker: _Worker) -> None:
        try:
            worker.tasks.flush()
        except BrokenPipeError:  # its process is gone; the sentinel says how
            self._died(worker)

    def _died(self, worker: _Worker) -> None:
        worker.process.join(JOIN_SECONDS)  # the pipe closed: the process is ending, or has
        raise WorkerDied(f"{self._lost_at(worker)}: a worker process {_how(worker.process)} (out of memory? killed?)")

    def _lost_at(self, worker: _Worker) -> str:
        """The unit a dead worker held; where it held none (it had answered all and waited for more),
        the earliest unit the run still waits on, so the error names the input all the same."""
        if worker.held:
            return self.describe(self.items[worker.held[0]])
        waiting = sorted(number for other in self.workers for number in other.held)
        if not waiting:
            return "between tasks"
        return f"{self.describe(self.items[waiting[0]])} (the run's next unit; the worker held none)"

    def held_by(self, worker: _Worker) -> str:
        full = ", not taking its next unit" if worker.tasks.waiting else ""
        return f"{self.describe(self.items[worker.held[0]])} (worker {worker.process.pid}{full})"

    def wait(self, timeout: float, limit: float) -> list[tuple[int, bool, Any]]:
        """Answers that arrived within ``timeout`` seconds; WorkerStuck after ``limit`` s without any."""
        poller, owner = select.poll(), {}
        for worker in self.workers:
            for fd, events in ((worker.results.fd, select.POLLIN), (worker.process.sentinel, select.POLLIN),
                               (worker.tasks.fd, select.POLLOUT if worker.tasks.waiting else 0)):  # fmt: skip
                if events:
                    poller.register(fd, events)
                    owner[fd] = worker
        ready = poller.poll(timeout * 1000)
        answers: list[tuple[int, bool, Any]] = []
        for fd, _ in ready:
            worker = owner[fd]
            if fd == worker.tasks.fd:
                self._flush(worker)
            elif fd == worker.results.fd:
                answers += self._receive(worker)
            elif not worker.process.is_alive():
                answers += self._receive(worker)  # what it sent before it died is still to be read
                self._died(worker)
        if answers:
            self.last_news = time.monotonic()
        elif not ready:
            self._no_news(limit)
        return answers

    def _receive(self, worker: _Worker) -> list[tuple[int, bool, Any]]:
        try:
            payloads = worker.results.pump()
        except EOFError:
            payloads = []
            self._died(worker)
        answers = []
        for payload in payloads:
            number, ok, value = pickle.loads(payload)
            if number is None:  # the initializer failed
                raise value
            worker.held.remove(number)
            answers.append((number, ok, value))
        return answers

    def _no_news(self, limit: float) -> None:
        waiting = [self.held_by(w) for w in self.workers if w.held]
        if time.monotonic() - self.last_news >= limit:
            raise WorkerStuck(
                f"no worker finished a unit in {limit:g} s (STATEFULSET_TASK_TIMEOUT); still held: "
                + "; ".join(waiting)
            )
        logger.info("statefulset: still waiting for %d worker(s), on %s", len(waiting), "; ".join(waiting))

    def close(self, failed: bool) -> None:
        """Ends every worker within a bound: end-of-file on its task pipe when all went well, SIGTERM
        (then SIGKILL) at once after a failure; never leaves a process behind that did not end.

        Each step is sent to every worker still alive before the pool waits, and the wait is one
        JOIN_SECONDS for all of them: workers that cannot act on SIGTERM (stopped, stuck) cost one
        bound, not one each (three stopped workers took 15 s to end one after another)."""
        for worker in self.workers:
            worker.tasks.close()
            worker.results.close()
        processes = [worker.process for worker in self.workers]
        if not failed:
            _join_all(processes, JOIN_SECONDS)
        for stop in ("terminate", "kill"):
            alive = [process for process in processes if process.is_alive()]
            for process in alive:
                getattr(process, stop)()
            _join_all(alive, JOIN_SECONDS)
        for process in processes:
            if process.is_alive():  # not even SIGKILL in JOIN_SECONDS: stuck in the kernel (D state)
                logger.warning("statefulset: worker process %d did not end after SIGKILL", process.pid)


def _join_all(processes: list[Any], seconds: float) -> None:
    """Join each of ``processes``, all within one bound of ``seconds`` (those still alive then are left alive)."""
    deadline = time.monotonic() + seconds
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))


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
    """``(item, function(item))`` in input order, computed by ``workers`` forked processes (in this
    process, with a WARNING, where fork is missing)."""
    period = settings.POOL_LOG_SECONDS.get()
    limit = no_news_limit()
    if "fork" not in multiprocessing.get_all_start_methods():
        logger.warning("statefulset: no fork on this platform: the %d workers asked for run as one, here", workers)
        initializer(*initargs)
        yield from ((item, function(item)) for item in items)
        return
    pool = _Pool(workers, function, initializer, initargs, describe)
    done: dict[int, tuple[bool, Any]] = {}
    source = iter(enumerate(items))
    exhausted, following, sent = False, 0, 0
    failed = True
    try:
        while True:
            while not exhausted and sent - following < workers * depth and (worker := pool.idle(depth)):
                try:
                    number, item = next(source)
                except StopIteration:
                    exhausted = True
                    break
                pool.submit(worker, number, item)
                sent += 1
            while following in done:
                ok, value = done.pop(following)
                item = pool.items.pop(following)
                if not ok:
                    raise value
                yield item, value
                following += 1
            if exhausted and following == sent:
                failed = False
                return
            if following == sent:
                # Every answer is handed on and no task is in flight (the head of the window answered
                # last): send the next units before waiting for news that cannot come.
                continue
            for number, ok, value in pool.wait(min(period, limit), limit):
                done[number] = (ok, value)
    finally:
        pool.close(failed)
