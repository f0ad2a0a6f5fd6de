"""Where shard bytes come from: a local memory map, or ranged reads from object storage.

Plain paths and ``file://`` URLs are memory-mapped (zero-copy, shared page cache across
worker processes). Any other fsspec URL (``s3://``, ``gs://``, ``memory://`` ...) is a
:class:`~statefulset.shards.remote.RemoteFile`: batched, concurrent ranged reads, retried on
transient faults, and a client per process. A remote ``.idx`` is used through its local copy
(:mod:`statefulset.shards.index_copies`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from typing import IO, Any

from statefulset.errors import StatefulsetError
from statefulset.shards.faults import changed_error
from statefulset.shards.remote import RemoteFile, open_filesystem


def local_path(path: str) -> str | None:
    """The local file behind ``path`` (a plain path or a ``file://`` URL), or None for object storage."""
    if "://" not in path:
        return path
    if not path.startswith(("file://", "local://")):
        return None
    from fsspec.implementations.local import LocalFileSystem

    fs, fs_path = open_filesystem(path, None)
    return fs_path if isinstance(fs, LocalFileSystem) else None


def map_file(path: str) -> mmap.mmap | bytes:
    """A local file as a read-only buffer (an mmap; ``b""`` when empty, which mmap refuses).

    The mmap is never closed explicitly: numpy views keep it alive, so arrays handed to users
    stay valid after the dataset object is gone.
    """
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return b""
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise StatefulsetError(f"{path}: cannot map: {exc}") from exc


def _file_version(info: os.stat_result) -> str:
    """What changes when a local file is replaced or rewritten."""
    return f"inode={info.st_dev}:{info.st_ino}:size={info.st_size}:mtime_ns={info.st_mtime_ns}"


def local_version(path: str) -> str | None:
    """The version :class:`ShardFile` would give the local file ``path`` now; None for object storage
    or a file that cannot be read."""
    local = local_path(path)
    try:
        return None if local is None else _file_version(os.stat(local))
    except OSError:
        return None


class ShardFile:
    """One read-only file, local or remote; sizes and reads never go through Python loops."""

    def __init__(self, path: str, storage_options: dict[str, Any] | None = None) -> None:
        self.path = path
        self._local = local_path(path)
        self.remote: RemoteFile | None = None
        if self._local is None:
            self.remote = RemoteFile(path, storage_options)
            self.size = self.remote.size
            self.version = self.remote.ukey
            return
        info = self._stat()
        if not stat.S_ISREG(info.st_mode):
            raise StatefulsetError(f"{path}: not a regular file")
        self.size = info.st_size
        self.version = _file_version(info)
        self._opened = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)

    def _stat(self) -> os.stat_result:
        try:
            return os.stat(self._local)  # type: ignore[arg-type]
        except FileNotFoundError:
            raise StatefulsetError(f"{self.path}: no such file") from None
        except OSError as exc:
            raise StatefulsetError(f"{self.path}: cannot read: {exc}") from exc

    def check_unchanged(self) -> None:
        """A StatefulsetError naming the file when it is no longer the version opened: locally a new
        inode, size or modification time (one ``stat``); remotely what :meth:`RemoteFile.check_unchanged`
        compares, for objects whose reads are not pinned by ETag (S3's are, request by request)."""
        if self.remote is not None:
            if not self.remote.etag:
                self.remote.check_unchanged()
            return
        now = _file_version(self._stat())
        if now != self.version:
            raise changed_error(self.path, self.version, now)

    def check_read(self) -> None:
        """After tokens were copied out of this local file's memory map: a StatefulsetError naming it
        when the file mapped was rewritten in place since it was opened (same inode, another size or
        modification time), so that no row holding its new bytes is handed out. A write updates the
        modification time before it changes the bytes, so a copy that saw new bytes is always caught
        by this ``stat`` after it. A file renamed over or deleted leaves the mapped inode, the version
        opened, in place: reads go on (a worker or pass that starts later is refused by
        :meth:`check_unchanged`). Remote reads are pinned request by request, so nothing to do."""
        if self._local is None:
            return
        try:
            info = os.stat(self._local)
        except OSError:
            return  # deleted or unreadable now: the mapped inode is still the version opened
        dev, ino, size, mtime_ns = self._opened
        if (info.st_dev, info.st_ino) == (dev, ino) and (info.st_size, info.st_mtime_ns) != (size, mtime_ns):
            raise changed_error(self.path, self.version, _file_version(info))

    @property
    def is_local(self) -> bool:
        return self._local is not None

    def map(self) -> mmap.mmap | bytes:
        """The whole file as a buffer: a read-only mmap when local, bytes when remote."""
        if self._local is None:
            return self.read(0, self.size)
        return map_file(self._local)

    def open(self) -> IO[bytes]:
        """A binary file object for streaming the whole file."""
        if self.remote is not None:
            return self.remote.open()
        try:
            return open(self._local, "rb")  # type: ignore[arg-type]
        except OSError as exc:
            raise StatefulsetError(f"{self.path}: cannot open: {exc}") from exc

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.read_ranges([offset], [nbytes])[0] if nbytes else b""

    def read_ranges(self, offsets: list[int], sizes: list[int], fork_safe: bool = False) -> list[bytes]:
        """The bytes of each range (remote: coalesced, concurrent requests; ``fork_safe``: see
        :meth:`statefulset.shards.remote.RemoteFile.read_ranges`)."""
        if self.remote is not None:
            return self.remote.read_ranges(offsets, sizes, fork_safe)
        out = []
        try:
            with open(self._local, "rb") as f:  # type: ignore[arg-type]
                _read_ahead(f.fileno(), offsets, sizes)
                for offset, nbytes in zip(offsets, sizes, strict=True):
                    f.seek(offset)
                    out.append(f.read(nbytes))
        except OSError as exc:
            raise StatefulsetError(f"{self.path}: read failed: {exc}") from exc
        for data, offset, nbytes in zip(out, offsets, sizes, strict=True):
            if len(data) != nbytes:
                raise StatefulsetError(
                    f"{self.path}: read of {nbytes} bytes at {offset} returned {len(data)}: file truncated?"
                )
        return out


def _read_ahead(fd: int, offsets: list[int], sizes: list[int]) -> None:
    """Ask the kernel for every range at once before reading them one by one (``POSIX_FADV_WILLNEED``): on
    a cold page cache the reads of scattered blocks (a ``.bin``'s keyed sample) then overlap on the disk
    instead of waiting for one another. Nothing where the platform has no ``posix_fadvise``."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None or len(offsets) < 2:
        return
    for offset, nbytes in zip(offsets, sizes, strict=True):
        with contextlib.suppress(OSError):
            advise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
