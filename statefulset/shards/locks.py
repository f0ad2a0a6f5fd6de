"""An exclusive lock on a file path that every process of a node (or of a shared filesystem) respects.

``flock`` is released by the kernel when its holder dies, so a waiter never waits for a dead
process. A waiter polls with growing pauses, logs what it waits for, and gives up after a
bound (``STATEFULSET_CACHE_WAIT`` seconds, default 3600) with a message naming the lock.
Filesystems without ``flock`` (Lustre mounted ``noflock`` answers ENOSYS, some NFS setups
ENOLCK) get a lock file instead. It appears with its owner record already in it (written to a
private draft, then hard-linked to the lock's name, which fails when the name exists), naming its
node (hostname, boot id, pid namespace) and process (pid and start time; see ``liveness``), and
a thread of the holder refreshes its mtime every ``HEARTBEAT_S``. A waiter takes over a lock file
whose holder is a dead process of its own node, or whose heartbeat is older than ``STALE_S`` on
the filesystem's clock (a holder on another node that died). Taking over and releasing remove
only the very file judged (set aside by rename, compared, put back if it is another), and drafts
of processes killed mid-way are swept. ``STATEFULSET_LOCK=file`` forces this fallback (tests, or
filesystems whose ``flock`` is local to a node). Callers publish by atomic rename, so even a
wrongly broken lock costs duplicate work, never a wrong result.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator

from statefulset import settings
from statefulset.errors import StatefulsetError
from statefulset.shards import liveness

logger = logging.getLogger("statefulset")

# A build of 10^9 sequences takes minutes, so an hour means the holder is stuck (a dead one's lock is gone).
REPORT_EVERY_S = 60.0
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)
HEARTBEAT_S = 10.0
STALE_S = 120.0
# Hard links unsupported (some FUSE and SMB mounts): lock files are then created by O_EXCL.
_NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK, errno.EXDEV)
_warned_no_links = False


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


def _stale(path: str) -> tuple[bool, bytes | None]:
    """Whether the lock file ``path`` was left by a holder that is gone, and what was judged (its
    content with its inode, for :func:`_remove_if`; None when there is no lock file any more).

    A holder of this node is gone when its process (pid and start time) no longer runs; one of
    another node (or one whose record cannot be read) when its heartbeat is older than STALE_S
    on the filesystem's clock. A lock file is written in full before it appears (see
    :func:`_create`), so an unreadable one is judged by its age too, never at once.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False, None
    try:
        status = os.fstat(fd)
        content = os.read(fd, 65536)
    finally:
        os.close(fd)
    try:
        record = json.loads(content)
    except ValueError:
        record = None
    alive = liveness.alive(record) if isinstance(record, dict) else None
    if alive is None:
        alive = liveness.age(path, status.st_mtime) <= STALE_S
    return not alive, _fingerprint(status, content)


def _fingerprint(status: os.stat_result, content: bytes) -> bytes:
    return f"{status.st_dev}:{status.st_ino}:".encode() + content


def _private_name(held_path: str, kind: str) -> str:
    return f"{held_path}.{liveness.node_token()}.{os.getpid()}.{secrets.token_hex(6)}.{kind}"


def _create(held_path: str) -> int | None:
    """Make ``held_path`` appear with this process's owner record already in it: written to a
    private draft, then hard-linked to the lock's name (link fails when the name exists). Returns a
    descriptor of the lock file (for its heartbeat), or None when another process holds it."""
    content = json.dumps({**liveness.owner(), "token": secrets.token_hex(8)}).encode()
    draft = _private_name(held_path, "draft")
    fd = os.open(draft, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        os.write(fd, content)
        try:
            os.link(draft, held_path)
        except OSError as exc:
            # NFS may answer an error for a link it made (a retransmitted request): the link count tells.
            if os.fstat(fd).st_nlink < 2:
                if exc.errno == errno.EEXIST:
                    os.close(fd)
                    return None
                if exc.errno not in _NO_LINKS:
                    raise
                os.close(fd)
                return _create_without_link(held_path, content)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(draft)
    return fd


def _create_without_link(held_path: str, content: bytes) -> int | None:
    """For filesystems without hard links: create with O_EXCL, then write (waiters judge a lock
    file they cannot read by its age, so the instant before the write breaks nothing)."""
    global _warned_no_links
    if not _warned_no_links:
        _warned_no_links = True
        logger.warning(
            "statefulset: %s does not support hard links; lock files are created empty and then filled",
            os.path.dirname(held_path) or ".",
        )
    try:
        fd = os.open(held_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return None
    os.write(fd, content)
    return fd


def _remove_if(held_path: str, fingerprint: bytes) -> bool:
    """Remove ``held_path`` if it is still the file ``fingerprint`` describes; True if it was.

    The file is first renamed to a private name (of two processes doing so, one gets it), then
    compared: a lock file that another process created meanwhile is put back, never removed.
    """
    aside = _private_name(held_path, "broken")
    try:
        os.rename(held_path, aside)
    except FileNotFoundError:
        return False
    try:
        with open(aside, "rb") as f:
            same = _fingerprint(os.fstat(f.fileno()), f.read(65536)) == fingerprint
        if not same:
            with contextlib.suppress(OSError):
                os.link(aside, held_path)
        return same
    finally:
        with contextlib.suppress(OSError):
            os.unlink(aside)


def _sweep_private_names(held_path: str) -> None:
    """Remove the drafts and set-aside files of ``held_path`` that processes killed mid-way left:
    those of a dead process of this node, or older than STALE_S."""
    folder, prefix = os.path.dirname(held_path) or ".", os.path.basename(held_path) + "."
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix) and n.endswith((".draft", ".broken"))]
    except OSError:
        return
    for name in names:
        path = os.path.join(folder, name)
        parts = name[len(prefix) :].split(".")  # <node token>.<pid>.<random>.<kind>
        token, pid = (parts[0], parts[1]) if len(parts) == 4 else ("", "")
        try:
            mine = token == liveness.node_token() and pid.isdigit()
            if mine and liveness.process_alive(int(pid), None):
                continue
            if not mine and liveness.age(path, os.stat(path).st_mtime) <= STALE_S:
                continue
            os.unlink(path)
            logger.info("statefulset: removed %s, left by a process killed while taking a lock", path)
        except OSError:
            continue


@contextlib.contextmanager
def _lock_file(path: str, subject: str, what: str) -> Iterator[bool]:
    held_path = path + ".held"
    fd: int | None = None

    def take() -> bool:
        nonlocal fd
        fd = _create(held_path)
        if fd is not None:
            return True
        stale, fingerprint = _stale(held_path)
        if fingerprint is not None:  # None: released meanwhile
            if not stale:
                return False
            if _remove_if(held_path, fingerprint):
                logger.warning("statefulset: removed the stale lock %s", held_path)
        fd = _create(held_path)
        return fd is not None

    try:
        _poll(
            take, subject, what,
            f"it holds {held_path}); check that process, remove the file if it is gone, or raise "
            "STATEFULSET_CACHE_WAIT",
        )  # fmt: skip
    except OSError:
        yield False  # a read-only folder
        return
    assert fd is not None
    with os.fdopen(fd, "rb") as mine:
        mine.seek(0)
        fingerprint = _fingerprint(os.fstat(fd), mine.read(65536))
        _sweep_private_names(held_path)
        try:
            with _heartbeat(fd):
                yield True
        finally:
            released = _remove_if(held_path, fingerprint)
        if not released:
            logger.warning(
                "statefulset: the lock %s was taken over by another process while this one held it "
                "(its heartbeat was judged stale); the work may have been done twice",
                held_path,
            )


@contextlib.contextmanager
def _heartbeat(fd: int) -> Iterator[None]:
    """Refresh the mtime of the lock file open as ``fd`` every HEARTBEAT_S (this file only: a
    lock file that replaced it is never touched) while the body runs."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(fd)

    thread = threading.Thread(target=beat, name="statefulset-lock-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


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
