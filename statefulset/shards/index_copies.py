"""Local copies of remote ``.idx`` files: one download per node, checked once, shared by every process.

A remote shard's index is read at random by every sample lookup, so it must be local. The copy
lives in ``$STATEFULSET_REMOTE_CACHE`` (default: ``<user cache>/remote-idx``), named by a hash of
the URL and the object's version as the store reports it (ETag and size), so a replaced object
gets a new copy and an unchanged one is never fetched again. Beside it, a small JSON record holds
the content digest (computed while downloading: no second read to identify the shard) and
whether the copy passed the full index check.

Processes of a node that open the same shard at once take turns on a lock: one downloads, the
others wait for it (bounded, logged) and map its copy. A copy appears by atomic rename, and
its record after it, so a crash never leaves a record without its file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from statefulset import settings
from statefulset.errors import StatefulsetError
from statefulset.shards.faults import with_retries
from statefulset.shards.locks import exclusive
from statefulset.shards.remote import RemoteFile

_CHUNK = 8 << 20
# Bumped when the record's meaning changes, so old records are ignored rather than misread.
_RECORD_VERSION = 1


def copies_dir() -> str:
    return settings.REMOTE_CACHE.get() or os.path.join(settings.user_cache_dir(), "remote-idx")


@dataclass
class IndexCopy:
    """A local, complete copy of one version of a remote ``.idx``."""

    url: str
    path: str
    digest: str
    verified: bool
    downloaded: bool  # this process fetched it (else it was already on this node)

    def mark_verified(self) -> None:
        """Record that the copy passed the full check (best effort: a read-only cache just rechecks)."""
        self.verified = True
        with contextlib.suppress(OSError):
            _write_record(self)


def _record_path(path: str) -> str:
    return path + ".json"


def _write_record(copy: IndexCopy) -> None:
    record = {"version": _RECORD_VERSION, "url": copy.url, "digest": copy.digest, "verified": copy.verified}
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(copy.path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, _record_path(copy.path))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read_record(url: str, path: str, size: int) -> IndexCopy | None:
    try:
        with open(_record_path(path), encoding="utf-8") as f:
            record = json.load(f)
        if record.get("version") != _RECORD_VERSION or os.path.getsize(path) != size:
            return None
        return IndexCopy(url, path, str(record["digest"]), bool(record.get("verified")), downloaded=False)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _download(remote: RemoteFile, path: str) -> str:
    """Stream the object into ``path`` atomically; returns its content digest."""
    folder = os.path.dirname(path)

    def attempt() -> str:
        digest = hashlib.blake2b(digest_size=16)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out, remote.open() as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
            if os.path.getsize(tmp) != remote.size:
                raise ConnectionError(f"got {os.path.getsize(tmp)} of {remote.size} bytes")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return digest.hexdigest()

    return with_retries(remote.url, attempt, "download")


def index_copy(url: str, storage_options: dict[str, Any] | None = None, remote: RemoteFile | None = None) -> IndexCopy:
    """The local copy of the remote ``.idx`` at ``url``, downloaded if this node has none of its version."""
    remote = remote or RemoteFile(url, storage_options)
    folder = copies_dir()
    name = hashlib.blake2b(f"{url}\0{remote.ukey}".encode(), digest_size=16).hexdigest()
    path = os.path.join(folder, name + ".idx")
    found = _read_record(url, path, remote.size)
    if found is not None:
        return found
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise StatefulsetError(
            f"{url}: cannot create {folder} for the local copy of this index ({exc}); set STATEFULSET_REMOTE_CACHE"
        ) from exc
    with exclusive(path + ".lock", url, "downloading this index"):
        found = _read_record(url, path, remote.size)
        if found is not None:
            return found
        copy = IndexCopy(url, path, _download(remote, path), verified=False, downloaded=True)
        _write_record(copy)
        return copy
