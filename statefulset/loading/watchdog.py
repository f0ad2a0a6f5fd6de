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
:class:`InProcessSource` builds them on one helper thread, one batch per request (no read-ahead:
the same batches, built at the same moments), and the trainer waits for each under the
watchdog's bound. A build that never returns is left behind on its (daemon) thread when the
watchdog raises. Measured cost: benchmarks/bench_watchdog_thread.py.
"""

from __future__ import annotations

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
        periods = 0
        due = self.period(first)  # when the current watchdog period ends (seconds since start)
        stall_at = self.stall
        while True:
            events = [x for x in (due, stall_at) if x is not None]
            step = max(min(events) - (time.monotonic() - start), 1e-3) if events else None
            try:
                return get(step)
            except TimedOut:
                pass
            now = time.monotonic() - start
            if stall_at is not None and now >= stall_at - 1e-3:
                log.warning(
                    "statefulset stall: next(loader) has waited %.1f s for a batch (stall_seconds=%g): %s",
                    now, self.stall, what(),
                )  # fmt: skip
                if meter is not None:
                    meter.stalls += 1
                stall_at = max(2 * stall_at, now + (self.stall or 0.0))
            if due is None or now < due - 1e-3:
                continue
            periods += 1
            text = f"no batch for {due:.0f} s: {what()}"
            if self.fail_on_timeout or periods >= HARD_PERIODS:
                raise StatefulsetError(
                    f"watchdog: {text}"
                    + ("" if self.fail_on_timeout else f" (gave up after {HARD_PERIODS} watchdog periods)")
                )
            log.warning("statefulset watchdog: %s; still waiting (fail_on_timeout=True raises instead)", text)
            due += self.period(False) or 0.0


def _serve(iterator: Iterator[Any], requests: queue.SimpleQueue, results: queue.SimpleQueue) -> None:
    while requests.get() is not None:
        try:
            results.put((True, next(iterator)))
        except BaseException as exc:  # StopIteration too: the trainer raises whatever the build raised
            results.put((False, exc))


class InProcessSource:
    """``next(iterator)`` on a helper thread, so that the trainer's wait for it can be bounded.

    :meth:`get` is a watchdog ``get`` callable: it asks for the next item (once), then waits up
    to ``period`` seconds for it, raising :class:`TimedOut` if it has not come (the request stays
    pending: the next call waits for the same item). The thread ends when this object is
    garbage-collected.
    """

    def __init__(self, iterator: Iterator[Any], name: str = "statefulset-batches") -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = False
        thread = threading.Thread(target=_serve, args=(iterator, self._requests, self._results), name=name)
        thread.daemon = True  # a build stuck in storage must not keep the trainer from exiting
        thread.start()
        weakref.finalize(self, self._requests.put, None)

    def ask(self) -> None:
        """Ask for the next item now (at most once before it is taken): the thread starts on it while
        the caller does something else, and :meth:`get` then only waits."""
        if not self._pending:
            self._requests.put(True)
            self._pending = True

    def get(self, period: float | None) -> Any:
        self.ask()
        try:
            ok, value = self._results.get(timeout=period)
        except queue.Empty:
            raise TimedOut from None
        self._pending = False
        if not ok:
            raise value
        return value
