"""Where shard bytes come from: a local memory map, or ranged reads through fsspec.

Plain paths and ``file://`` URLs are memory-mapped (zero-copy, shared page cache across
worker processes). Any other fsspec URL (``memory://``, ``s3://``, ``gs://`` ...) is read
with ranged requests, so a reader never downloads a whole ``.bin``.
"""

from __future__ import annotations

import mmap
import os
import stat
from typing import IO, Any

from statefulset.errors import StatefulsetError


def _is_url(path: str) -> bool:
    return "://" in path


class ShardFile:
    """One read-only file, local or remote; sizes and reads never go through Python loops."""

    def __init__(self, path: str, storage_options: dict[str, Any] | None = None) -> None:
        self.path = path
        self._fs = None
        self._local: str | None = None
        if _is_url(path):
            import fsspec
            from fsspec.implementations.local import LocalFileSystem

            try:
                fs, fs_path = fsspec.core.url_to_fs(path, **(storage_options or {}))
            except (ValueError, ImportError) as exc:
                raise StatefulsetError(f"{path}: cannot open this URL with fsspec: {exc}") from exc
            if isinstance(fs, LocalFileSystem):
                self._local = fs_path
            else:
                self._fs, self._remote = fs, fs_path
        else:
            self._local = path
        try:
            if self._local is not None:
                info = os.stat(self._local)
                if not stat.S_ISREG(info.st_mode):
                    raise StatefulsetError(f"{path}: not a regular file")
                self.size = info.st_size
            else:
                self.size = int(self._fs.size(self._remote))
        except FileNotFoundError:
            raise StatefulsetError(f"{path}: no such file") from None
        except OSError as exc:
            raise StatefulsetError(f"{path}: cannot read: {exc}") from exc

    @property
    def is_local(self) -> bool:
        return self._local is not None

    def map(self) -> mmap.mmap | bytes:
        """The whole file as a buffer: a read-only mmap when local, bytes when remote.

        The mmap is never closed explicitly: numpy views keep it alive, so arrays handed to
        users stay valid after the dataset object is gone.
        """
        if self._local is None:
            return self.read(0, self.size)
        if self.size == 0:
            return b""  # mmap refuses empty files
        try:
            with open(self._local, "rb") as f:
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise StatefulsetError(f"{self.path}: cannot map: {exc}") from exc

    def open(self) -> IO[bytes]:
        """A binary file object for streaming the whole file."""
        try:
            if self._local is not None:
                return open(self._local, "rb")
            return self._fs.open(self._remote, "rb")
        except OSError as exc:
            raise StatefulsetError(f"{self.path}: cannot open: {exc}") from exc

    def read(self, offset: int, nbytes: int) -> bytes:
        if nbytes == 0:
            return b""
        try:
            if self._local is not None:
                with open(self._local, "rb") as f:
                    f.seek(offset)
                    data = f.read(nbytes)
            else:
                data = self._fs.cat_file(self._remote, start=offset, end=offset + nbytes)
        except OSError as exc:
            raise StatefulsetError(f"{self.path}: read of {nbytes} bytes at {offset} failed: {exc}") from exc
        if len(data) != nbytes:
            raise StatefulsetError(
                f"{self.path}: read of {nbytes} bytes at {offset} returned {len(data)}: file truncated?"
            )
        return data
