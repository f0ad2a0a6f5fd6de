"""Facts remembered per file *version*: a shard's content digest, "its index passed every check".

Checking a 20 MB ``.idx`` in full, or hashing it, costs tens of milliseconds on every open, which
is most of a stream's open time. Both results depend only on the file's bytes, so they are
remembered under a token of the file version (real path, size, mtime, inode, device), in memory
for this process and as small JSON files under ``$XDG_CACHE_HOME/statefulset`` for later ones.

A file rewritten in place keeps its size and inode and, within the filesystem's timestamp
granularity (milliseconds on ext4), even its mtime. So, like git's "racy clean" rule, a fact
about a file is only remembered once its mtime is a few seconds old: a file changed after that
gets a newer mtime and a new token. Remote (fsspec) files use the filesystem's ``ukey``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from typing import Any

__all__ = ["file_token", "recall", "remember"]

# A file modified less than this long ago may still change without a visible mtime change.
SETTLE_SECONDS = 3.0
_in_process: dict[tuple[str, str], tuple[tuple[str, ...], Any]] = {}


def file_token(path: str) -> tuple[str, str] | None:
    """(where, version) of a file, or None when the file cannot be identified or has not settled."""
    if "://" in path:
        try:
            import fsspec

            fs, fs_path = fsspec.core.url_to_fs(path)
            return path, str(fs.ukey(fs_path))
        except (ImportError, OSError, ValueError, NotImplementedError):
            return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    if time.time() - st.st_mtime < SETTLE_SECONDS:
        return None
    return os.path.realpath(path), f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_dev}"


def user_cache_dir() -> str:
    """This user's statefulset folder: ``$XDG_CACHE_HOME/statefulset``, else ``~/.cache/statefulset``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "statefulset")


def memo_dir() -> str:
    return os.path.join(user_cache_dir(), "memo")


def _tokens(paths: tuple[str, ...]) -> tuple[tuple[str, str], ...] | None:
    tokens = tuple(file_token(p) for p in paths)
    return None if any(t is None for t in tokens) else tokens  # type: ignore[return-value]


def _memo_file(kind: str, where: str, directory: str | None) -> str:
    name = hashlib.blake2b(f"{kind}\0{where}".encode(), digest_size=16).hexdigest()
    return os.path.join(directory or memo_dir(), f"{name}.json")


def recall(kind: str, *paths: str, directory: str | None = None) -> Any:
    """The value remembered as ``kind`` for exactly these file versions, or None."""
    tokens = _tokens(paths)
    if tokens is None:
        return None
    versions = tuple(v for _, v in tokens)
    key = (kind, tokens[0][0])
    hit = _in_process.get(key)
    if hit is not None and hit[0] == versions:
        return hit[1]
    with contextlib.suppress(OSError, ValueError, TypeError):
        with open(_memo_file(kind, tokens[0][0], directory), encoding="utf-8") as f:
            saved = json.load(f)
        if tuple(saved.get("versions", ())) == versions and "value" in saved:
            _in_process[key] = (versions, saved["value"])
            return saved["value"]
    return None


def remember(kind: str, *paths: str, value: Any, directory: str | None = None) -> None:
    """Remember ``value`` (JSON) as ``kind`` for the current versions of ``paths``; best effort."""
    tokens = _tokens(paths)
    if tokens is None:
        return
    versions = tuple(v for _, v in tokens)
    _in_process[(kind, tokens[0][0])] = (versions, value)
    path = _memo_file(kind, tokens[0][0], directory)
    data = json.dumps({"paths": [w for w, _ in tokens], "versions": versions, "value": value}).encode()
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
