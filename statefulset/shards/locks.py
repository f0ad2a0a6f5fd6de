"""An exclusive lock on a file path that every process of a node (or of a shared filesystem) respects.

``flock`` is released by the kernel when its holder dies, so a waiter never waits for a dead
process. A waiter polls with growing pauses, logs what it waits for, and gives up after a
bound (``STATEFULSET_CACHE_WAIT`` seconds, default 3600) with a message naming the lock.
Filesystems without ``flock`` (Lustre mounted ``noflock`` answers ENOSYS, some NFS setups
ENOLCK) get a lock file instead: created with ``O_EXCL`` (atomic on those filesystems too), naming
its host and pid, its mtime refreshed every ``HEARTBEAT_S`` by a thread of the holder. A waiter
takes over a lock file whose holder is a dead process of its own host, or whose heartbeat is
older than ``STALE_S`` (a holder on another node that died). ``STATEFULSET_LOCK=file`` forces
this fallback (tests, or filesystems whose ``flock`` is local to a node). Callers publish by
atomic rename, so even a wrongly broken lock costs duplicate work, never a wrong result.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

from statefulset import settings
from statefulset.errors import StatefulsetError

logger = logging.getLogger("statefulset")

# A build of 10^9 sequences takes minutes, so an hour means the holder is stuck (a dead one's lock is gone).
REPORT_EVERY_S = 60.0
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)
HEARTBEAT_S = 10.0
STALE_S = 120.0
_HOST = socket.gethostname()


def wait_bound() -> float:
    return settings.CACHE_WAIT.get()


@contextlib.contextmanager
def exclusive(path: str, subject: str, what: str) -> Iterator[bool]:
    """Hold the lock ``path`` while doing ``what`` to ``subject``; yields whether it is held.

    ``what`` completes the log lines and the error, e.g. "building this index" or "downloading
    this object"; the error starts with ``subject``.
    """
    if settings.LOCK.get() == "file":
        with _lock_file(path, subject, what) as held:
            yield held
        return
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
        if held:
            yield True
            return
    finally:
        os.close(fd)
    logger.info("statefulset: %s does not support flock; using a lock file", os.path.dirname(path) or ".")
    with _lock_file(path, subject, what) as held:
        yield held


def _stale(path: str) -> bool:
    """A lock file whose holder is gone: a dead process of this host, or no heartbeat for STALE_S."""
    try:
        with open(path, encoding="utf-8") as f:
            owner = json.load(f)
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True  # unreadable: half-written by a holder that died at once
    if owner.get("host") == _HOST:
        try:
            os.kill(int(owner.get("pid", -1)), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, ValueError, OverflowError):
            pass
    return age > STALE_S


@contextlib.contextmanager
def _lock_file(path: str, subject: str, what: str) -> Iterator[bool]:
    held_path = path + ".held"
    fd = -1

    def create() -> bool:
        nonlocal fd
        try:
            fd = os.open(held_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            return True
        except FileExistsError:
            if not _stale(held_path):
                return False
        logger.warning("statefulset: removing the stale lock %s", held_path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(held_path)
        return create()

    try:
        _poll(
            create, subject, what,
            f"it holds {held_path}); check that process, remove the file if it is gone, or raise "
            "STATEFULSET_CACHE_WAIT",
        )  # fmt: skip
    except OSError:
        yield False  # a read-only folder
        return
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"host": _HOST, "pid": os.getpid(), "since": time.time()}, f)
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(held_path)

    beat = threading.Thread(target=heartbeat, name="statefulset-lock-heartbeat", daemon=True)
    beat.start()
    try:
        yield True
    finally:
        stop.set()
        beat.join()
        with contextlib.suppress(OSError):
            os.unlink(held_path)


def _wait(fd: int, path: str, subject: str, what: str) -> None:
    def take() -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    _poll(
        take, subject, what,
        f"it holds {path} and is alive: a dead one's lock is released); check that process, or raise "
        "STATEFULSET_CACHE_WAIT",
    )  # fmt: skip


def _poll(take: Callable[[], bool], subject: str, what: str, holder: str) -> None:
    """``take()`` until it gets the lock: at once, then with pauses doubling to 1 s; logged, bounded.

    ``holder`` ends the error after "(": who holds the lock, then the advice.
    """
    if take():
        return
    bound, start = wait_bound(), time.monotonic()
    logger.info("statefulset: waiting for another process %s: %s", what, subject)
    pause, reported = 0.01, start
    while True:
        time.sleep(pause)
        if take():
            return
        now = time.monotonic()
        if now - start >= bound:
            raise StatefulsetError(f"{subject}: waited {bound:g} s for another process {what} ({holder}")
        if now - reported >= REPORT_EVERY_S:
            reported = now
            logger.warning("statefulset: still waiting (%.0f s) for another process %s: %s", now - start, what, subject)
        pause = min(pause * 2, 1.0, max(bound - (now - start), 0.001))
