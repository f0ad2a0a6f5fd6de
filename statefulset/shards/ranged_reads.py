"""Ranged GETs of one S3 object, pinned to the version that was opened, through the process's request limit.

- **Pinned**: every GET carries ``If-Match: <ETag recorded at open>``. An object overwritten
  while a job runs answers 412, which becomes a :class:`StatefulsetError` saying the object
  changed since it was opened: never tokens of another version (review C4).
- **Limited**: each request holds a slot of the process's :class:`statefulset.shards.throttle.Limiter`
  while in flight, so a store that slows down makes the whole process slow down.
- **Retried one by one**: a request that fails transiently is sent again (the others are not),
  after the limiter's shared pause, up to ``STATEFULSET_STORAGE_RETRIES`` times within
  ``STATEFULSET_STORAGE_RETRY_SECONDS`` of its first failure. A store that says it is overloaded
  (503 SlowDown, 429, timeouts) is not failing but asking for fewer requests: those answers cut
  the limit, and a request may meet ``OVERLOAD_TRIES`` times as many of them, within the same
  time budget, while the process slows down to what the store serves. Each attempt
  is bounded by the client's connect and read timeouts, and the whole call by :func:`deadline`.

Both clients run here, in the event loop of the s3fs filesystem (fsspec's I/O thread): s3fs through
its aiobotocore client, obstore through its awaitables, so that one limiter sees every request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from statefulset import settings
from statefulset.errors import StatefulsetError
from statefulset.shards import storage_stats
from statefulset.shards.faults import changed_error, describe, is_transient, retry_policy
from statefulset.shards.throttle import limiter

log = logging.getLogger("statefulset")

# What a 412 answer looks like from each client (s3fs passes botocore's error code through).
_CHANGED_NAMES = {"PreconditionError"}
_CHANGED_TEXT = ("PreconditionFailed", "Precondition Failed", "pre-conditions you specified did not hold")


OVERLOAD_TRIES = 4
_OVERLOAD_NAMES = {"ConnectTimeoutError", "ReadTimeoutError", "ServerTimeoutError", "TimeoutError"}
_OVERLOAD_TEXT = ("SlowDown", "reduce your request rate", "ServiceUnavailable", "Service Unavailable", "503",
                  "TooManyRequests", "429", "timed out")  # fmt: skip


def is_overload(exc: BaseException) -> bool:
    """True for the answers of a store that serves fewer requests than it is sent: throttling, timeouts."""
    if {cls.__name__ for cls in type(exc).__mro__} & _OVERLOAD_NAMES:
        return True
    text = f"{type(exc).__name__}: {exc}"
    return any(t in text for t in _OVERLOAD_TEXT)


def is_changed(exc: BaseException) -> bool:
    """True when the store refused a GET because the object's ETag is no longer the one sent."""
    if {cls.__name__ for cls in type(exc).__mro__} & _CHANGED_NAMES:
        return True
    text = f"{type(exc).__name__}: {exc}"
    return any(t in text for t in _CHANGED_TEXT)


def deadline(requests: int) -> float:
    """Seconds one call of :func:`read` may take in all: queueing behind the limit, attempts, pauses."""
    return 600.0 + 2 * settings.STORAGE_RETRY_SECONDS.get() + 0.5 * requests


async def _one(url: str, etag: str, get: Callable[[], Awaitable[bytes]], lim: Any, policy: tuple[int, float]) -> bytes:
    retries, budget = policy
    attempt, first_failure = 0, None
    while True:
        attempt += 1
        epoch = await lim.acquire()
        ticket = storage_stats.request_started(url)
        try:
            data = await get()
        except asyncio.CancelledError:
            lim.release(epoch, failed=False)
            storage_stats.request_ended(ticket, None, False)
            raise
        except Exception as exc:
            transient = is_transient(exc) and not is_changed(exc)
            lim.release(epoch, failed=transient, cause=type(exc).__name__)
            now = time.monotonic()
            first_failure = first_failure if first_failure is not None else now
            allowed = retries * OVERLOAD_TRIES if is_overload(exc) else retries
            final = is_changed(exc) or not transient or attempt > allowed or now - first_failure >= budget
            storage_stats.request_ended(ticket, None, not final)
            if is_changed(exc):
                raise changed_error(url, f"ETag {etag}") from exc
            if final:
                raise describe(url, exc, attempt) from exc
            continue
        lim.release(epoch, failed=False)
        storage_stats.request_ended(ticket, len(data), False)
        return data


async def _all(url: str, etag: str, gets: list[Callable[[], Awaitable[bytes]]]) -> list[bytes]:
    lim = limiter(asyncio.get_running_loop())
    # The retry settings, read once per call: per request, reading the environment took a seventh of
    # the event loop thread's time at 32 requests in flight (issue 26, py-spy).
    policy = retry_policy()
    tasks = [asyncio.ensure_future(_one(url, etag, get, lim, policy)) for get in gets]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:  # after one failed: stop the others, and collect their outcomes
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def run(loop: Any, url: str, etag: str, gets: list[Callable[[], Awaitable[bytes]]]) -> list[bytes]:
    """Run ``gets`` (coroutine factories, one per request) in ``loop``; their bytes in order."""
    future = asyncio.run_coroutine_threadsafe(_all(url, etag, gets), loop)
    limit = deadline(len(gets))
    try:
        return future.result(limit)
    except TimeoutError:
        future.cancel()
        raise StatefulsetError(
            f"{url}: {len(gets)} ranged reads did not finish within {limit:.0f} s (the store answers too slowly; "
            "see STATEFULSET_STORAGE_RETRY_SECONDS and STATEFULSET_STORAGE_MAX_REQUESTS)"
        ) from None


Get = Callable[[], Awaitable[bytes]]


def s3fs_gets(fs: Any, path: str, etag: str, starts: list[int], ends: list[int]) -> list[Get]:
    """One pinned ranged GET per ``[start, end)`` through s3fs's aiobotocore client."""
    bucket, key, version = fs.split_path(path)
    pin = {"IfMatch": etag} if etag else {}
    if version:
        pin["VersionId"] = version

    def make(start: int, end: int) -> Callable[[], Awaitable[bytes]]:
        async def get() -> bytes:
            if end <= start:
                return b""
            answer = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **pin)
            body = answer["Body"]
            try:
                return bytes(await body.read())
            finally:
                body.close()

        return get

    return [make(s, e) for s, e in zip(starts, ends, strict=True)]
