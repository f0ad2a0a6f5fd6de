"""Hidden temporary files of shards being written, and the sweep that removes those of dead writers.

A writer puts its data in ``.<base>.<ext>.<host>.<pid>.<random>.tmp`` next to the shard and
holds an exclusive ``flock`` on that file while it lives; the kernel drops the lock when the
process dies, however it dies. A writer killed by SIGKILL (or the OOM killer) cannot remove
its files, so every new writer for the same prefix removes the stale ones first. A file is
stale when

- nobody holds its lock (processes forked by the writer, such as tokeniser workers, close
  their copy of the lock at fork, so they never keep a dead writer's file alive), and
- it was made on another host, or by a process of this host that no longer exists (this
  also covers the instant between creating a file and locking it).

Only the exact names of one prefix are considered: writers of other prefixes in the same folder,
and live writers of the same prefix (here or on another host sharing the folder), are left alone.
Names from before this scheme carry no owner; they count as stale after an hour untouched.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import socket
import time

logger = logging.getLogger("statefulset")

_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"
_LEGACY_MAX_AGE = 3600.0
_held: dict[str, int] = {}  # path -> descriptor holding its lock, in this process


def _forget_locks_in_child() -> None:
    # The child's descriptors share the parent's lock; closing them leaves the parent's lock
    # alone but lets it die with the parent.
    for fd in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_locks_in_child)


def temp_path(folder: str, base: str, ext: str) -> str:
    """A fresh hidden name next to ``<folder>/<base>.<ext>`` that records this host and process."""
    return os.path.join(folder, f".{base}.{ext}.{_HOST}.{os.getpid()}.{secrets.token_hex(6)}.tmp")


def hold(path: str) -> None:
    """Lock ``path`` (just created by this process) for as long as this process writes it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a filesystem without locks: the host/pid rule alone protects the file
        os.close(fd)
        return
    _held[path] = fd


def release(path: str | None) -> None:
    """Drop the lock taken by :func:`hold` (after the file was renamed or removed)."""
    fd = _held.pop(path, None) if path is not None else None
    if fd is not None:
        os.close(fd)


def _pattern(base: str) -> re.Pattern[str]:
    return re.compile(
        rf"^\.{re.escape(base)}\.(?:bin|idx)\.(?:(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.)?[0-9a-f]{{12}}\.tmp$"
    )


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed process its parent has not reaped yet is a zombie: dead for us
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _locked(path: str) -> bool:
    """True when some process holds the lock on ``path`` (or it cannot be told, or it is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # also drops the lock we may just have taken
    return False


def _stale(path: str, host: str | None, pid: str | None) -> bool:
    if pid is None:
        try:
            return time.time() - os.stat(path).st_mtime > _LEGACY_MAX_AGE
        except OSError:
            return False
    if host == _HOST and _process_exists(int(pid)):
        return False
    return not _locked(path)


def sweep(folder: str, base: str) -> list[str]:
    """Remove the stale temporaries of prefix ``<folder>/<base>``; returns the paths removed."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    pattern = _pattern(base)
    removed = []
    for name in names:
        match = pattern.match(name)
        path = os.path.join(folder, name)
        if match is None or not _stale(path, match["host"], match["pid"]):
            continue
        try:
            os.remove(path)
        except FileNotFoundError:
            continue  # another writer swept it first
        except OSError as exc:
            logger.warning("statefulset: cannot remove stale temporary %s: %s", path, exc)
            continue
        removed.append(path)
    if removed:
        logger.info(
            "statefulset: removed %d temporary file(s) left by killed writers of %s: %s",
            len(removed),
            os.path.join(folder, base),
            ", ".join(os.path.basename(p) for p in removed),
        )
    return removed
