"""Facts remembered per file *version*: a shard's content digest, "its index passed every check".

Checking a 1 GB ``.idx`` in full, or hashing it, costs seconds and a pass over the file; both
results depend only on the file's bytes, so they are remembered under a token of the file
version, in memory for this process and as small JSON files in a folder: the spec's
``path_to_cache/facts`` when it has one (shared by every node that mounts it), else
``$XDG_CACHE_HOME/statefulset/memo``.

The token is what every node sees alike: the real path, size, mtime in nanoseconds and inode
number (stable for one file on NFS and Lustre). Never the device number, which differs from node
to node. A fact is recorded for the version that was actually read: the token is taken before
the work and the fact dropped if the file changed meanwhile.

A file rewritten in place keeps its size and inode and, within the filesystem's timestamp
granularity (milliseconds on ext4), even its mtime. So, like git's "racy clean" rule, a fact
about a file is only remembered once its mtime is a few seconds old: a file changed after that
gets a newer mtime and a new token.

:func:`once` makes concurrent processes share the work: one computes under a lock in the facts
folder, the others wait for it (bounded, logged) and read its result.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from statefulset import settings
from statefulset.shards.locks import exclusive

__all__ = ["file_token", "once", "recall", "remember", "versions", "write_json"]

logger = logging.getLogger("statefulset")

# A file modified less than this long ago may still change without a visible mtime change.
SETTLE_SECONDS = 3.0
_in_process: dict[tuple[str, str], tuple[tuple[str, ...], Any]] = {}
# Facts this process computed (not recalled), by kind: what prepare's summary and tests count.
computed: dict[str, int] = {}


def file_token(path: str) -> tuple[str, str] | None:
    """(where, version) of a local file, or None when it cannot be identified or has not settled."""
    if "://" in path:
        return None  # remote objects: their local copies carry the facts (shards.index_copies)
    try:
        st = os.stat(path)
    except OSError:
        return None
    if time.time() - st.st_mtime < SETTLE_SECONDS:
        return None
    return _realpath(path), f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def memo_dir() -> str:
    return os.path.join(settings.user_cache_dir(), "memo")


def versions(*paths: str) -> tuple[str, ...] | None:
    """The current version tokens of ``paths`` (take them *before* reading), or None."""
    tokens = [file_token(p) for p in paths]
    if any(t is None for t in tokens):
        return None
    return tuple(t[1] for t in tokens)  # type: ignore[index]


def _where(path: str) -> str:
    return _realpath(path) if "://" not in path else path


@functools.lru_cache(maxsize=8192)
def _realpath(path: str) -> str:
    # A realpath walks every component with lstat (~25 µs); an open of 50 sources asks for it
    # hundreds of times. A version is told apart by stat (size, mtime_ns, inode), not by this name.
    return os.path.realpath(path)


def _memo_file(kind: str, where: str, directory: str | None) -> str:
    name = hashlib.blake2b(f"{kind}\0{where}".encode(), digest_size=16).hexdigest()
    return os.path.join(directory or memo_dir(), f"{name}.json")


def recall(kind: str, *paths: str, directory: str | None = None) -> Any:
    """The value remembered as ``kind`` for exactly the current versions of ``paths``, or None."""
    current = versions(*paths)
    if current is None:
        return None
    key = (kind, _where(paths[0]))
    hit = _in_process.get(key)
    if hit is not None and hit[0] == current:
        return hit[1]
    memo = _memo_file(kind, key[1], directory)
    try:
        with open(memo, encoding="utf-8") as f:
            saved = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("statefulset: ignoring the damaged fact file %s (%s); it is recomputed", memo, exc)
        return None
    if isinstance(saved, dict) and tuple(saved.get("versions", ())) == current and "value" in saved:
        _in_process[key] = (current, saved["value"])
        return saved["value"]
    return None


def remember(
    kind: str, *paths: str, value: Any, directory: str | None = None, read: tuple[str, ...] | None = None
) -> bool:
    """Remember ``value`` (JSON) as ``kind`` for the versions of ``paths``; best effort.

    ``read``: the versions taken before the value was computed; when given, nothing is remembered
    unless the files are still those versions (a file replaced during a long check is not the
    file that was checked). Returns whether the fact was recorded.
    """
    current = versions(*paths)
    if current is None or (read is not None and read != current):
        return False
    where = _where(paths[0])
    _in_process[(kind, where)] = (current, value)
    path = _memo_file(kind, where, directory)
    write_json(path, {"paths": [_where(p) for p in paths], "versions": current, "value": value})
    return True


def write_json(path: str, value: Any) -> None:
    """Write ``value`` as JSON to ``path`` atomically (a temporary file renamed); best effort."""
    data = json.dumps(value).encode()
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def once(kind: str, paths: tuple[str, ...], compute: Callable[[], Any], what: str, directory: str | None = None) -> Any:
    """The remembered ``kind`` of ``paths``, computed by one process while the others wait for it.

    ``what`` says what the work is, for the wait's log line ("checking this index in full").
    """
    found = recall(kind, *paths, directory=directory)
    if found is not None:
        return found
    if versions(*paths) is None:
        computed[kind] = computed.get(kind, 0) + 1
        return compute()  # a file that has not settled (or is remote) is not remembered, so not shared
    folder = directory or memo_dir()
    lock = _memo_file(kind, _where(paths[0]), folder) + ".lock"
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        lock = ""  # a read-only folder: compute without sharing
    with exclusive(lock, paths[0], what) if lock else contextlib.nullcontext(False):
        found = recall(kind, *paths, directory=directory)
        if found is not None:
            return found
        read = versions(*paths)
        computed[kind] = computed.get(kind, 0) + 1
        logger.info(
            "statefulset: %s %s: this version is new to %s (changed, or not prepared; `statefulset prepare SPEC` "
            "does this once for every rank)", what, paths[0], folder,
        )  # fmt: skip
        value = compute()
        remember(kind, *paths, value=value, directory=directory, read=read)
        return value
