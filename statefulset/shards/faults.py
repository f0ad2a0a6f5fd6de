"""Failures of object-storage requests: which ones a retry can fix, and what to tell the user.

Object stores fail transiently all the time at scale (throttling, 5xx, reset connections,
timeouts). Those are retried with exponential backoff and jitter, within a bound on attempts
and on total time; everything else (a missing object, refused credentials, an endpoint that
stays unreachable) becomes a :class:`StatefulsetError` naming the URL and the cause.

Settings (environment, read per call so tests and launchers can set them):

- ``STATEFULSET_STORAGE_RETRIES``: attempts after the first (default 6);
- ``STATEFULSET_STORAGE_RETRY_SECONDS``: the whole budget for one request's retries (default 120);
- ``STATEFULSET_STORAGE_CALL_SECONDS``: the longest one call to an fsspec filesystem waits
  (:func:`bounded_call`; default 60, plus a second per 8 MiB an upload or download moves).
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from statefulset import settings
from statefulset.errors import StatefulsetError

log = logging.getLogger("statefulset")
T = TypeVar("T")

_FIRST_BACKOFF = 0.1
# A call that moves data gets one more second of its bound per this many bytes (a slow link, not a stall).
_BYTES_PER_EXTRA_SECOND = 8 * 1024 * 1024
_MAX_BACKOFF = 10.0

# Exception classes named by name: botocore, aiohttp and urllib3 are optional imports.
_TRANSIENT_NAMES = {
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "ConnectionClosedError",
    "ResponseStreamingError",
    "IncompleteReadError",
    "IncompleteRead",
    "ProtocolError",
    "ServerDisconnectedError",
    "ClientPayloadError",
    "ClientOSError",
    "ServerTimeoutError",
    "EndpointConnectionError",
}
_CREDENTIALS_NAMES = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "ProfileNotFound"}
# obstore's exception classes (statefulset.shards.obstore_client).
_MISSING_NAMES = {"NotFoundError"}
_REFUSED_NAMES = {"PermissionDeniedError", "UnauthenticatedError"}
# What obstore's GenericError says for failures a retry can fix.
_TRANSIENT_TEXT = (
    "SlowDown", "ServiceUnavailable", "InternalError", "503", "500 ", "502", "504",
    "error sending request", "connection closed", "Connection reset", "timed out", "operation timed out",
    "dispatch failure", "IncompleteBody", "end of file before message length reached",
)  # fmt: skip
# errno values s3fs gives 5xx and throttling answers (InternalError, SlowDown, ServiceUnavailable).
_TRANSIENT_ERRNOS = {errno.EBUSY, getattr(errno, "EREMOTEIO", errno.EIO), errno.EAGAIN, errno.ETIMEDOUT}


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def is_transient(exc: BaseException) -> bool:
    """True for failures a later attempt may not meet: timeouts, resets, throttling, 5xx."""
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
        return False
    names = _names(exc)
    if names & (_CREDENTIALS_NAMES | _MISSING_NAMES | _REFUSED_NAMES):
        return False
    if names & _TRANSIENT_NAMES or isinstance(exc, TimeoutError | ConnectionError):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    text = str(exc)
    return any(code in text for code in _TRANSIENT_TEXT)


def describe(url: str, exc: BaseException, attempts: int = 1) -> StatefulsetError:
    """The error a user reads: the URL, what went wrong in words, the library's own message."""
    names = _names(exc)
    cause = f"{type(exc).__name__}: {exc}".rstrip(": ")
    tried = f" (after {attempts} attempts)" if attempts > 1 else ""
    if isinstance(exc, FileNotFoundError) or names & _MISSING_NAMES or "NoSuchKey" in str(exc):
        what = "no such object (or no such bucket)"
    elif names & _CREDENTIALS_NAMES or "get_credentials" in str(exc):
        what = (
            "no usable credentials: set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or give "
            "storage_options (key, secret, profile) in the spec"
        )
    elif isinstance(exc, PermissionError) or names & _REFUSED_NAMES:
        what = "access refused: the credentials are wrong or lack permission for this object"
    elif "EndpointConnectionError" in names or isinstance(exc, ConnectionRefusedError):
        what = "the endpoint is unreachable: check endpoint_url / AWS_ENDPOINT_URL and the network"
    elif is_transient(exc):
        what = "the storage kept failing transiently"
    else:
        what = "the request failed"
    return StatefulsetError(f"{url}: {what}{tried}; cause: {cause}")


def changed_error(url: str, opened: str, now: str = "") -> StatefulsetError:
    """The error for an object or file that is no longer the version a job opened (review C4)."""
    found = f", now {now}" if now else ""
    return StatefulsetError(
        f"{url}: changed since it was opened (opened as {opened}{found}); its tokens would differ from the ones "
        "already read, so the job stops: restore the original, or restart the job to read the new version"
    )


def retry_policy() -> tuple[int, float]:
    """(retries after the first attempt, total seconds) from the environment."""
    return settings.STORAGE_RETRIES.get(), settings.STORAGE_RETRY_SECONDS.get()


def with_retries(url: str, call: Callable[[], T], what: str = "read") -> T:
    """``call()``, retried on transient failures with capped exponential backoff and full jitter."""
    retries, budget = retry_policy()
    started = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return call()
        except StatefulsetError:
            raise
        except Exception as exc:
            elapsed = time.monotonic() - started
            if not is_transient(exc) or attempt > retries or elapsed >= budget:
                raise describe(url, exc, attempt) from exc
            pause = min(_MAX_BACKOFF, _FIRST_BACKOFF * 2 ** (attempt - 1), max(0.0, budget - elapsed))
            pause = random.uniform(pause / 2, pause)
            log.warning(
                "statefulset: %s of %s failed (%s: %s); retry %d of %d in %.2f s",
                what, url, type(exc).__name__, exc, attempt, retries, pause,
            )  # fmt: skip
            time.sleep(pause)


def bounded_call(
    url: str, what: str, fs: object, method: str, *args: object, nbytes: int = 0, **kwargs: object
) -> object:
    """``fs.<method>(*args)``, waiting at most ``STATEFULSET_STORAGE_CALL_SECONDS`` (plus a second per
    8 MiB of ``nbytes``) on an async fsspec filesystem (s3fs, gcsfs): the call is cancelled on its I/O
    loop and a ``TimeoutError`` naming the operation, the URL and the bound is raised, which
    :func:`with_retries` retries. Found by the reliability campaign (seeds 166, 100017): an upload on a
    connection that never answered left ``fs.put_file`` waiting past any bound. Synchronous
    filesystems (``memory://``, local) are called as they are."""
    seconds = settings.STORAGE_CALL_SECONDS.get() + nbytes / _BYTES_PER_EXTRA_SECOND
    coroutine = getattr(fs, "_" + method, None)
    loop = getattr(fs, "loop", None)
    if coroutine is None or loop is None or getattr(fs, "asynchronous", False):
        return getattr(fs, method)(*args, **kwargs)
    from fsspec.asyn import FSTimeoutError, sync

    try:
        return sync(loop, coroutine, *args, timeout=seconds, **kwargs)
    except FSTimeoutError as exc:
        raise TimeoutError(
            f"{what} of {url}: no answer within {seconds:.1f} s (STATEFULSET_STORAGE_CALL_SECONDS)"
        ) from exc
