"""Hidden temporary files of shards being written, and the sweep that removes those of dead writers.

A writer puts its data in ``.<base>.<ext>.<node>.<pid>.<start>.<random>.tmp`` next to the shard:
``<node>`` names its hostname and node (boot id and pid namespace, see ``liveness``), ``<pid>``
and ``<start>`` its process. While the file lives, a thread of the writer refreshes its mtime
every ``HEARTBEAT_S`` (its heartbeat). A writer killed by SIGKILL (or the OOM killer) cannot
remove its files, so every new writer for the same prefix removes the stale ones first. A file
is stale when

- it was made by a process of this node that no longer runs (pid and start time: a reused pid
  is not the writer; processes forked by the writer, such as tokeniser workers, do not keep it
  alive), or
- it was made on another node (or another container sharing this hostname) and its heartbeat is
  older than ``STALE_S`` on the filesystem's clock.

No ``flock`` is involved: on NFS mounted ``local_lock`` or Lustre ``localflock`` a lock is only
seen on its own node, so a lock probe would call another node's live writer dead.

Only the exact names of one prefix are considered: writers of other prefixes in the same folder,
and live writers of the same prefix (here or on another node sharing the folder), are left alone.
Names from before this scheme carry no owner; they count as stale after an hour untouched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import threading
import time

from statefulset.shards import liveness

logger = logging.getLogger("statefulset")

HEARTBEAT_S = 30.0
STALE_S = 300.0  # ten heartbeats missed: the writer is gone
_LEGACY_MAX_AGE = 3600.0
_held: set[str] = set()  # the temporaries this process writes, whose heartbeat it keeps
_guard = threading.Lock()
_beating: threading.Thread | None = None


def _forget_in_child() -> None:
    # A forked child (a tokeniser worker) must not keep its parent's files alive: it has no
    # heartbeat thread, and it starts its own if it writes files of its own.
    global _beating, _guard
    _held.clear()
    _beating, _guard = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def temp_path(folder: str, base: str, ext: str) -> str:
    """A fresh hidden name next to ``<folder>/<base>.<ext>`` that records this node and process."""
    pid = os.getpid()
    start = liveness.start_time(pid) or 0
    return os.path.join(folder, f".{base}.{ext}.{liveness.node_token()}.{pid}.{start}.{secrets.token_hex(6)}.tmp")


def hold(path: str) -> None:
    """Keep the heartbeat of ``path`` (just created by this process) for as long as it is written."""
    global _beating
    with _guard:
        _held.add(path)
        if _beating is None:
            _beating = threading.Thread(target=_beat, name="statefulset-temporaries-heartbeat", daemon=True)
            _beating.start()


def release(path: str | None) -> None:
    """Stop the heartbeat of ``path`` (after the file was renamed or removed)."""
    with _guard:
        _held.discard(path)


def _beat() -> None:
    """Touch every held temporary every HEARTBEAT_S; lives as long as the process (a daemon)."""
    while True:
        time.sleep(HEARTBEAT_S)
        with _guard:
            paths = list(_held)
        for path in paths:
            with contextlib.suppress(OSError):  # renamed or removed meanwhile
                os.utime(path)


def _pattern(base: str) -> re.Pattern[str]:
    return re.compile(
        rf"^\.{re.escape(base)}\.(?:bin|idx)\."
        rf"(?:(?P<node>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.(?:(?P<start>\d+)\.)?)?[0-9a-f]{{12}}\.tmp$"
    )


def _stale(path: str, match: re.Match[str]) -> bool:
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return False  # gone already
    if match["pid"] is None:
        return time.time() - mtime > _LEGACY_MAX_AGE
    if match["node"] == liveness.node_token() and match["start"] is not None:
        return not liveness.process_alive(int(match["pid"]), int(match["start"]) or None)
    return liveness.age(path, mtime) > STALE_S


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
        if match is None or not _stale(path, match):
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
