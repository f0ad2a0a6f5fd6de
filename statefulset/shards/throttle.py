"""How many object-storage requests a process has in flight: a limit that backs off when the store does.

A store that is overwhelmed answers slowly, refuses connections, or says so (503 ``SlowDown``).
Every reader of a process (all its shards, all its read-ahead threads) takes a slot here for each
ranged GET, so the process as a whole slows down instead of each request retrying on its own
until it gives up (issue 24: four DataLoader workers, each with eight batches read ahead, sent
hundreds of requests at once to a store that answers a hundred a second, and connections timed out).

The limit is AIMD, as TCP's congestion window: each request that succeeds raises it by
``1 / limit`` (about one more request in flight per round of answers), each transient failure
halves it (at most once per round: only a request sent after the last cut may cut again) and
pauses every reader of the process for a backoff that doubles while failures go on, with jitter,
up to ``MAX_PAUSE``. When the limit falls, a reader merges ranges across larger gaps
(:meth:`Limiter.merge_gap`), so the same bytes need fewer requests.

A limiter lives in one asyncio event loop (the one its requests run in) and is used only from it;
:func:`limiter` gives each loop of each process its own.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import random
import time
from typing import Any

from statefulset import settings

log = logging.getLogger("statefulset")

LOG_EVERY = 30.0  # seconds: the warning about cuts is logged at most this often per process
FIRST_PAUSE = 0.05  # seconds: the shared pause after the first failure of a run of them
MAX_PAUSE = 5.0  # seconds: the longest shared pause


class Limiter:
    """An AIMD limit on requests in flight, with a shared pause after transient failures."""

    def __init__(self, most: int, start: int | None = None) -> None:
        self.most = max(1, most)
        self.limit = float(min(self.most, start or self.most))
        self.inflight = 0
        self.epoch = 0  # bumped at every cut: requests sent before it cannot cut again
        self.pause_until = 0.0
        self.failures_in_a_row = 0
        self.cuts = 0  # how many times the limit was cut (reported by benchmarks)
        self.lowest = self.limit
        self._logged_at = -LOG_EVERY
        self._cuts_logged = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def _free(self) -> int:
        return max(1, int(self.limit)) - self.inflight

    async def acquire(self) -> int:
        """Wait for a slot (and for the shared pause to end); returns the epoch to hand to :meth:`release`.

        A reader woken by a release competes again for the slot; one that finds none waits for the
        next release, which must come, since a slot is taken only by a request in flight."""
        while True:
            delay = self.pause_until - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
                continue
            if self._free() > 0:
                self.inflight += 1
                return self.epoch
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if not waiter.done():  # cancelled while waiting
                    waiter.cancel()

    def release(self, epoch: int, failed: bool, cause: str = "") -> None:
        """A request ended: ``failed`` when transiently (throttled, timed out, 5xx)."""
        self.inflight -= 1
        if not failed:
            self.failures_in_a_row = 0
            self.limit = min(float(self.most), self.limit + 1.0 / self.limit)
        elif epoch == self.epoch:
            self.epoch += 1
            self.cuts += 1
            self.limit = max(1.0, self.limit / 2)
            self.lowest = min(self.lowest, self.limit)
            pause = min(MAX_PAUSE, FIRST_PAUSE * 2**self.failures_in_a_row)
            self.failures_in_a_row += 1
            pause = random.uniform(pause / 2, pause)
            now = time.monotonic()
            self.pause_until = max(self.pause_until, now + pause)
            if now - self._logged_at >= LOG_EVERY:
                log.warning(
                    "statefulset: the object store is failing transiently (%s; %d cuts since the last report): this "
                    "process slows down to at most %d requests in flight (lowest yet %d), pausing them all %.2f s",
                    cause, self.cuts - self._cuts_logged, max(1, int(self.limit)), max(1, int(self.lowest)), pause,
                )  # fmt: skip
                self._logged_at, self._cuts_logged = now, self.cuts
        self._wake()

    def _wake(self) -> None:
        free = self._free()
        while self._waiters and free > 0:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                free -= 1

    def merge_gap(self, gap: int, most: int) -> int:
        """``gap`` scaled up as the limit falls below its ceiling (fewer, larger requests), at most ``most``."""
        return int(min(most, gap * self.most / max(1.0, self.limit)))


_LIMITERS: dict[tuple[int, int], Limiter] = {}


def limiter(loop: Any) -> Limiter:
    """This process's limiter for requests run in ``loop``."""
    key = (os.getpid(), id(loop))
    found = _LIMITERS.get(key)
    if found is None:
        if len(_LIMITERS) > 64:  # limiters of forked parents or closed loops
            _LIMITERS.clear()
        found = _LIMITERS[key] = Limiter(settings.STORAGE_MAX_REQUESTS.get())
    return found
