"""An exclusive lock on a file path that every process of a node (or of a shared filesystem) respects.

``flock`` is released by the kernel when its holder dies, so a waiter never waits for a dead
process. A waiter polls with growing pauses, logs what it waits for, and gives up after a
bound (``STATEFULSET_CACHE_WAIT`` seconds, default 3600) with a message naming the lock.
Filesystems without ``flock`` (Lustre mounted ``noflock`` answers ENOSYS, some NFS setups
ENOLCK) get no lock: callers publish by atomic rename, so at worst two processes do the same
work and one result wins.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
from collections.abc import Iterator

from statefulset.errors import StatefulsetError

logger = logging.getLogger("statefulset")

# A build of 10^9 sequences takes minutes, so an hour means the holder is stuck (a dead one's lock is gone).
DEFAULT_WAIT_S = 3600.0
REPORT_EVERY_S = 60.0
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


def wait_bound() -> float:
    text = os.environ.get("STATEFULSET_CACHE_WAIT", "")
    try:
        bound = float(text) if text.strip() else DEFAULT_WAIT_S
    except ValueError:
        raise StatefulsetError(f"STATEFULSET_CACHE_WAIT must be a number of seconds, got {text!r}") from None
    if not bound > 0:
        raise StatefulsetError(f"STATEFULSET_CACHE_WAIT must be positive, got {text!r}")
    return bound


@contextlib.contextmanager
def exclusive(path: str, subject: str, what: str) -> Iterator[bool]:
    """Hold the lock ``path`` while doing ``what`` to ``subject``; yields whether it is held.

    ``what`` completes the log lines and the error, e.g. "building this index" or "downloading
    this object"; the error starts with ``subject``.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield False  # a read-only folder: nobody can publish there either
        return
    try:
        try:
            _wait(fd, path, subject, what)
            held = True
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
            held = False
        yield held
    finally:
        os.close(fd)


def _wait(fd: int, path: str, subject: str, what: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    bound, start = wait_bound(), time.monotonic()
    logger.info("statefulset: waiting for another process %s: %s", what, subject)
    pause, reported = 0.01, start
    while True:
        time.sleep(pause)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        now = time.monotonic()
        if now - start >= bound:
            raise StatefulsetError(
                f"{subject}: waited {bound:g} s for another process {what} (it holds {path} and is alive: "
                "a dead one's lock is released); check that process, or raise STATEFULSET_CACHE_WAIT"
            )
        if now - reported >= REPORT_EVERY_S:
            reported = now
            logger.warning("statefulset: still waiting (%.0f s) for another process %s: %s", now - start, what, subject)
        pause = min(pause * 2, 1.0, max(bound - (now - start), 0.001))
