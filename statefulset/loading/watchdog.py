"""Energon's watchdog keywords, honoured: a loader that delivers no batch for too long says so.

``watchdog_timeout_seconds`` (default 60): after that long without a batch, a warning names
the worker, the micro-batch it was building and the files it reads; it repeats every period.
``fail_on_timeout=True`` raises a ``StatefulsetError`` with the same text at the first period
instead. Either way the wait is bounded: after ``HARD_PERIODS`` periods (10 minutes at the
default) the loader raises, since a worker silent that long is stuck, not slow.
``watchdog_initial_timeout_seconds`` is the period for the first batch of an iterator (worker
start-up, cold caches); None means the same as ``watchdog_timeout_seconds``. A timeout of None
turns the watchdog off (the wait is then bounded only by storage timeouts and retries).

The stall report comes earlier and only informs: when one ``next()`` has waited ``stall_seconds``
(default 10; None: off) a WARNING names the same (worker, micro-batch, positions, files) plus the
oldest storage request in flight, repeated at doubling waits (docs/observability.md). With
``num_workers=0`` it needs the watchdog's helper thread below, so it is off there when the watchdog is.

With ``num_workers=0`` the batches are built in the trainer process, where a stalled read would
block the very thread that has to notice it. So while the watchdog is on, an
:class:`InProcessSource` builds them on one helper thread and the trainer waits for each under the
watchdog's bound. Without a task encoder the thread builds ``STATEFULSET_READ_AHEAD`` batches (8)
a request: the hand-off between the threads (a wake-up each way) is paid once a request, and the
batches after the first are built while the trainer works. With one, a batch a request, built
only while the trainer waits for it (an encoder may seed the global RNGs the trainer's thread
draws from). A build that never returns is left behind on its (daemon) thread when the watchdog
raises. Measured cost: benchmarks/bench_watchdog_thread.py and bench_loader.py's 0-worker rows.

Work that the caller does on its own thread and that reads only local memory-mapped files (the
first step after a torchft quorum change) is watched by a :class:`CallerWatch` instead: the caller
arms a deadline without waking anything, a polling guard thread logs the same reports while the
work overruns, and the caller raises the watchdog's error when the work returns too late.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from statefulset.errors import StatefulsetError

log = logging.getLogger("statefulset")
T = TypeVar("T")
HARD_PERIODS = 10
STALL_SECONDS = 10.0  # get_savable_loader's stall_seconds default


class TimedOut(Exception):
    """Raised by a ``wait`` callable when its period passed without a result."""


def _positive(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise StatefulsetError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return float(value)


class Watchdog:
    def __init__(
        self,
        timeout: float | None,
        initial_timeout: float | None = None,
        fail_on_timeout: bool = False,
        stall_seconds: float | None = STALL_SECONDS,
    ) -> None:
        self.timeout = _positive("watchdog_timeout_seconds", timeout)
        self.initial_timeout = _positive("watchdog_initial_timeout_seconds", initial_timeout)
        self.fail_on_timeout = bool(fail_on_timeout)
        self.stall = _positive("stall_seconds", stall_seconds)

    def period(self, first: bool) -> float | None:
        if self.timeout is None:
            return None
        return self.initial_timeout if first and self.initial_timeout is not None else self.timeout

    def wait(self, get: Callable[[float | None], T], first: bool, what: Callable[[], str], meter: Any = None) -> T:
        """``get(seconds)`` until it returns; ``what()`` describes the awaited batch for the reports.

        Two clocks run from the call: the stall report's (a WARNING at ``stall_seconds``, then at
        twice the wait before, so at most log2 of the wait in all; counted in ``meter.stalls``) and
        the watchdog's periods (a WARNING each, or the error).
        """
        start = time.monotonic()
        clocks = Clocks(self, first, what, meter)
        while True:
            due = clocks.next_event()
            step = max(due - (time.monotonic() - start), 1e-3) if due is not None else None
            try:
                return get(step)
            except TimedOut:
                pass
            error = clocks.report(time.monotonic() - start)
            if error is not None:
                raise StatefulsetError(error)

    def limit(self, first: bool) -> float | None:
        """How long one wait may last before the watchdog raises (seconds; None: no limit)."""
        period = self.period(first)
        if period is None:
            return None
        return period if self.fail_on_timeout else period + (HARD_PERIODS - 1) * (self.period(False) or 0.0)


class Clocks:
    """The reports of one wait, from its start: the stall report's clock and the watchdog's periods."""

    def __init__(self, watchdog: Watchdog, first: bool, what: Callable[[], str], meter: Any = None) -> None:
        self.watchdog, self.what, self.meter = watchdog, what, meter
        self.periods = 0
        self.due = watchdog.period(first)  # when the current watchdog period ends (seconds since start)
        self.stall_at = watchdog.stall

    def next_event(self) -> float | None:
        """When the next report is due (seconds since the start), None if never."""
        events = [x for x in (self.due, self.stall_at) if x is not None]
        return min(events) if events else None

    def report(self, now: float) -> str | None:
        """Log the reports due at ``now`` (seconds since the start); the watchdog's error text when it gives up."""
        w = self.watchdog
        if self.stall_at is not None and now >= self.stall_at - 1e-3:
            log.warning(
                "statefulset stall: next(loader) has waited %.1f s for a batch (stall_seconds=%g): %s",
                now, w.stall, self.what(),
            )  # fmt: skip
            if self.meter is not None:
                self.meter.stalls += 1
            self.stall_at = max(2 * self.stall_at, now + (w.stall or 0.0))
        if self.due is None or now < self.due - 1e-3:
            return None
        self.periods += 1
        text = f"no batch for {self.due:.0f} s: {self.what()}"
        if w.fail_on_timeout or self.periods >= HARD_PERIODS:
            extra = "" if w.fail_on_timeout else f" (gave up after {HARD_PERIODS} watchdog periods)"
            return f"watchdog: {text}{extra}"
        log.warning("statefulset watchdog: %s; still waiting (fail_on_timeout=True raises instead)", text)
        self.due += w.period(False) or 0.0
        return None


EXIT_JOIN_SECONDS = 5.0
# Every live helper thread and its request queue, for _stop_helpers at interpreter exit.
_helpers: weakref.WeakKeyDictionary[threading.Thread, queue.SimpleQueue] = weakref.WeakKeyDictionary()
_exiting = threading.Event()


def _stop_helpers() -> None:
    """At interpreter exit: each helper thread ends after the item it is building (bounded in all by
    EXIT_JOIN_SECONDS). A daemon thread still inside torch's C++ code (the DataLoader iterator's
    ``next``) while the interpreter finalises aborted the process ("terminate called without an
    active exception"), seen once in 80 exits right after a batch once the thread built ahead."""
    _exiting.set()
    helpers = list(_helpers.items())
    for _, requests in helpers:
        requests.put(None)
    deadline = time.monotonic() + EXIT_JOIN_SECONDS
    for thread, _ in helpers:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            log.warning("statefulset: at exit, helper thread %s was still building after %g s", thread.name,
                        EXIT_JOIN_SECONDS)  # fmt: skip


atexit.register(_stop_helpers)


def _serve(iterator: Iterator[Any], requests: queue.SimpleQueue, results: queue.SimpleQueue) -> None:
    while (count := requests.get()) is not None:
        for _ in range(count):
            if _exiting.is_set():
                return
            try:
                results.put((True, next(iterator)))
            except BaseException as exc:  # StopIteration too: the trainer raises whatever the build raised
                results.put((False, exc))
                break  # the request ends with its error (the trainer's count of items asked for says so)


class InProcessSource:
    """``next(iterator)`` on a helper thread, so that the trainer's wait for it can be bounded.

    :meth:`get` is a watchdog ``get`` callable: it asks for the next ``per_request`` items when none
    is asked for (one request at a time), then waits up to ``period`` seconds for the next one,
    raising :class:`TimedOut` if it has not come (the request stays pending: the next call waits
    for the same item). With ``per_request`` > 1 the thread builds that many items ahead of the
    caller, and the hand-off between the threads (a wake-up each way) is paid once a request, not
    once an item. The thread ends when this object is garbage-collected.
    """

    def __init__(self, iterator: Iterator[Any], name: str = "statefulset-batches", per_request: int = 1) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._per_request = per_request
        self._asked = 0  # items asked for and not taken yet
        thread = threading.Thread(target=_serve, args=(iterator, self._requests, self._results), name=name)
        thread.daemon = True  # a build stuck in storage must not keep the trainer from exiting
        thread.start()
        _helpers[thread] = self._requests
        weakref.finalize(self, self._requests.put, None)

    def ask(self) -> None:
        """Ask for the next items now (unless some are asked for already): the thread starts on them
        while the caller does something else, and :meth:`get` then only waits."""
        if not self._asked:
            self._requests.put(self._per_request)
            self._asked = self._per_request

    def get(self, period: float | None) -> Any:
        self.ask()
        try:
            ok, value = self._results.get(timeout=period)
        except queue.Empty:
            raise TimedOut from None
        self._asked -= 1
        if not ok:
            self._asked = 0  # the thread ended the request at this error
            raise value
        return value


class _Armed:
    """What :class:`CallerWatch`'s guard thread reads: the work in progress and the stop flag."""

    def __init__(self) -> None:
        self.work: tuple[float, Clocks] | None = None  # (its start, its clocks), written by the caller
        self.stop = threading.Event()


def _guard(armed: _Armed, poll: float) -> None:
    wait = poll
    while not armed.stop.wait(wait):  # a bounded sleep: the poll, or until the next report is due
        work = armed.work
        if work is None:
            wait = poll
            continue
        start, clocks = work
        now = time.monotonic() - start
        error = clocks.report(now)
        if error is not None:
            log.error("statefulset %s; on the caller's own thread, which raises when the work returns", error)
            clocks.due = clocks.stall_at = None  # said once; the caller raises
        due = clocks.next_event()
        wait = poll if due is None else min(max(due - now, 1e-3), poll)


class CallerWatch:
    """The watchdog for work the caller does on its own thread: no hand-off, no thread to wake.

    Waking a helper thread and waiting for it costs a loaded machine's scheduler latency twice (a
    torchft change step measured 0.5 ms on the caller's thread against 0.8-3 ms through
    :class:`InProcessSource`, load 9 on 2 cores). Here the caller :meth:`arm`\\ s a deadline (a
    store, nothing woken), does the work and :meth:`check`\\ s it: a guard thread that polls
    (every ``poll`` seconds, a tenth of the shortest period, between 5 ms and 1 s) logs the stall
    report and the watchdog's warnings while the work overruns, naming ``what()`` as
    :meth:`Watchdog.wait` does, and :meth:`check` raises the watchdog's error when the work outlasted
    what the watchdog allows. Work that never returns is reported, and stays stuck: use this only
    for work whose own waits are bounded (storage calls) or local (memory-mapped reads), never for
    user code. The thread ends when this object is garbage-collected.
    """

    def __init__(self, watchdog: Watchdog, name: str = "statefulset-watch") -> None:
        self.watchdog = watchdog
        shortest = min(x for x in (watchdog.period(True), watchdog.period(False), watchdog.stall, 10.0) if x)
        self._armed = _Armed()
        thread = threading.Thread(target=_guard, args=(self._armed, min(max(shortest / 10, 0.005), 1.0)), name=name)
        thread.daemon = True
        thread.start()
        weakref.finalize(self, self._armed.stop.set)

    def arm(self, first: bool, what: Callable[[], str]) -> float:
        """Start the clocks of one piece of work; returns its start (for :meth:`check`)."""
        start = time.monotonic()
        self._armed.work = (start, Clocks(self.watchdog, first, what))
        return start

    def disarm(self) -> None:
        """The work raised: its clocks stop, nothing more is reported."""
        self._armed.work = None

    def check(self, start: float, first: bool, what: Callable[[], str]) -> None:
        """The work begun at ``start`` returned: its clocks stop; raises the watchdog's error when it
        took longer than the watchdog allows (its result is then not used)."""
        self._armed.work = None
        limit = self.watchdog.limit(first)
        took = time.monotonic() - start
        if limit is not None and took >= limit - 1e-3:
            extra = "" if self.watchdog.fail_on_timeout else f" (gave up after {HARD_PERIODS} watchdog periods)"
            raise StatefulsetError(f"watchdog: no batch for {took:.0f} s: {what()}{extra}")
