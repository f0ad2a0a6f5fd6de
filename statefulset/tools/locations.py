"""Where preprocessing reads and writes: local paths, or any fsspec URL (``s3://``, ``gs://``, ``memory://``).

Local paths keep the plain ``open``/``os`` calls (no fsspec layer on the hot path). A URL goes
through fsspec, a filesystem per process (fsspec forgets its instances after a fork, so worker
processes and Ray tasks make their own clients); credentials and endpoints come from the
environment as s3fs reads them (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID`` ...).

Shards are written with a local rename (atomic), so an output on object storage is written to a
local staging folder and uploaded, ``.bin`` first and ``.idx`` last: a reader never sees an index
without its data. One object ``put`` is atomic on object stores, which is what a committed part
(:mod:`statefulset.tools.part_tasks`) relies on.

Every request to a store goes through :func:`statefulset.shards.faults.with_retries` (bounded in
attempts and seconds, each retry logged with what it was and the URL): the clients' own retries are
off (:func:`statefulset.shards.remote.open_filesystem`), so without it one 503 ``SlowDown`` would end
a run of hours. Reads of an opened object are retried from the position the read began at.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO, Any

from statefulset.errors import StatefulsetError
from statefulset.shards.faults import bounded_call, with_retries
from statefulset.shards.names import natural_key
from statefulset.shards.remote import object_version, open_filesystem


def is_url(path: str) -> bool:
    """True for anything fsspec must open (``file://`` URLs are plain local paths)."""
    return "://" in path and not path.startswith("file://")


def _local(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def _fs(url: str) -> tuple[Any, str]:
    return open_filesystem(url, None)


def _protocol(url: str) -> str:
    return url.split("://", 1)[0]


def _unstrip(url: str, path: str) -> str:
    """fsspec's paths drop the protocol; put it back so that the path opens anywhere."""
    return path if "://" in path else f"{_protocol(url)}://{path}"


class RetryingFile(io.RawIOBase):
    """An opened object whose reads are retried (bounded) on transient faults: each attempt starts
    again from the position the read began at, so a retried read returns exactly the bytes it
    would have returned the first time."""

    def __init__(self, url: str, raw: Any) -> None:
        super().__init__()
        self.url = url
        self._raw = raw

    def _retried(self, what: str, call: Any) -> Any:
        start = self._raw.tell()

        def attempt() -> Any:
            self._raw.seek(start)
            return call()

        return with_retries(self.url, attempt, what)

    def read(self, size: int | None = -1) -> bytes:
        return self._retried("read", lambda: self._raw.read(-1 if size is None else size))

    def readinto(self, buffer: Any) -> int:
        data = self.read(memoryview(buffer).nbytes)
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)

    def readline(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:  # fsspec's readline takes no size
            return self._retried("read", lambda: self._raw.readline())
        return self._retried("read", lambda: self._raw.readline(size))

    def seek(self, offset: int, whence: int = 0) -> int:
        return int(self._raw.seek(offset, whence))

    def tell(self) -> int:
        return int(self._raw.tell())

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    @property
    def size(self) -> int:
        return int(self._raw.size)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._raw.close()
        super().close()


def open_read(path: str) -> IO[bytes]:
    """A seekable binary file object, naming the path when it cannot be opened."""
    try:
        if not is_url(path):
            return open(_local(path), "rb")
        fs, fs_path = _fs(path)
        return RetryingFile(path, with_retries(path, lambda: fs.open(fs_path, "rb"), "open"))  # type: ignore[return-value]
    except (OSError, ValueError) as exc:
        raise StatefulsetError(f"{path}: cannot read: {exc}") from exc


def size(path: str) -> int:
    try:
        if not is_url(path):
            return os.path.getsize(_local(path))
        fs, fs_path = _fs(path)
        return int(with_retries(path, lambda: bounded_call(path, "size", fs, "size", fs_path), "size"))
    except (OSError, ValueError) as exc:
        raise StatefulsetError(f"{path}: cannot read its size: {exc}") from exc


def version(path: str) -> list[Any]:
    """What changes when the file changes: size and mtime locally, ETag (or the store's equivalent) remotely."""
    if not is_url(path):
        st = os.stat(_local(path))
        return [os.path.abspath(_local(path)), st.st_size, st.st_mtime_ns]
    fs, fs_path = _fs(path)
    return [path, object_version(with_retries(path, lambda: bounded_call(path, "info", fs, "info", fs_path), "info"))]


def expand(inputs: list[str] | tuple[str, ...]) -> list[str]:
    """Files and glob patterns (local or URLs), each pattern's matches in natural order."""
    paths: list[str] = []
    for item in inputs:
        pattern = any(c in item for c in "*?[")
        if not is_url(item):
            if pattern:
                matches = sorted(glob.glob(_local(item)), key=natural_key)
                if not matches:
                    raise StatefulsetError(f"{item}: the pattern matches no file")
                paths += matches
            elif os.path.isfile(_local(item)):
                paths.append(item)
            else:
                raise StatefulsetError(f"{item}: no such input file")
            continue
        fs, fs_path = _fs(item)
        try:
            if pattern:
                listed = with_retries(
                    item, lambda f=fs, p=fs_path, u=item: bounded_call(u, "list", f, "glob", p), "list"
                )
                found = sorted(listed, key=natural_key)
                if not found:
                    raise StatefulsetError(f"{item}: the pattern matches no object")
                paths += [_unstrip(item, p) for p in found]
            elif _is_file(with_retries(item, lambda f=fs, p=fs_path, u=item: _info_or_none(u, f, p), "info")):
                paths.append(item)
            else:
                raise StatefulsetError(f"{item}: no such input object")
        except OSError as exc:
            raise StatefulsetError(f"{item}: cannot list: {exc}") from exc
    return paths


def _info_or_none(url: str, fs: Any, path: str) -> dict[str, Any] | None:
    """The object's info, None when it does not exist. Not ``fs.isfile``: fsspec's answers False to any
    error, so a dropped connection made an existing input "no such input object" with no retry."""
    try:
        return bounded_call(url, "info", fs, "info", path)
    except FileNotFoundError:
        return None


def _is_file(info: dict[str, Any] | None) -> bool:
    return info is not None and info.get("type") == "file"


class Folder:
    """A folder of small files and shards (the parts of a Ray run): local or on object storage."""

    def __init__(self, path: str) -> None:
        self.path = path.rstrip("/")
        self.remote = is_url(path)
        if self.remote:
            self._fs, self._fs_path = _fs(self.path)

    def _fresh(self) -> None:
        """Forget fsspec's listings: other processes (Ray tasks) add files to this folder."""
        self._fs.invalidate_cache(self._fs_path)

    def join(self, name: str) -> str:
        return f"{self.path}/{name}"

    def make(self) -> None:
        if not self.remote:
            os.makedirs(_local(self.path), exist_ok=True)

    def names(self) -> list[str]:
        """The file names in the folder ([] when it does not exist)."""
        if not self.remote:
            local = _local(self.path)
            return os.listdir(local) if os.path.isdir(local) else []
        self._fresh()

        def listing() -> list[str]:
            try:
                return list(bounded_call(self.path, "list", self._fs, "ls", self._fs_path, False))
            except FileNotFoundError:
                return []

        return [p.rstrip("/").rsplit("/", 1)[-1] for p in with_retries(self.path, listing, "list")]

    def read_text(self, name: str) -> str:
        if not self.remote:
            with open(_local(self.join(name))) as f:
                return f.read()
        self._fresh()
        return with_retries(
            self.join(name),
            lambda: bounded_call(self.join(name), "read", self._fs, "cat_file", f"{self._fs_path}/{name}"),
            "read",
        ).decode()

    def exists(self, name: str) -> bool:
        if not self.remote:
            return os.path.exists(_local(self.join(name)))
        self._fresh()
        return bool(
            with_retries(
                self.join(name),
                lambda: bounded_call(self.join(name), "info", self._fs, "exists", f"{self._fs_path}/{name}"),
                "info",
            )
        )

    def write_text(self, name: str, text: str) -> None:
        """Atomic: a rename locally, one ``put`` of the whole object remotely."""
        if not self.remote:
            target = _local(self.join(name))
            with open(target + ".tmp", "w") as f:
                f.write(text)
            os.replace(target + ".tmp", target)
            return
        with_retries(
            self.join(name),
            lambda: bounded_call(
                self.join(name), "write", self._fs, "pipe_file", f"{self._fs_path}/{name}", text.encode()
            ),
            "write",
        )

    @contextlib.contextmanager
    def local_shard(self, name: str, exts: tuple[str, ...] = (".bin", ".idx")) -> Iterator[str]:
        """The shard ``name`` (a prefix in this folder) as a local prefix: itself, or a download of its
        ``exts`` removed after use (so merging remote parts needs the local room of one part, and leaves
        no copies behind)."""
        if not self.remote:
            yield _local(self.join(name))
            return
        folder = tempfile.mkdtemp(prefix="statefulset-part-")
        try:
            for ext in exts:
                source, local = f"{self._fs_path}/{name}{ext}", os.path.join(folder, name + ext)
                with_retries(
                    self.join(name + ext), lambda s=source, d=local, n=name + ext: self._download(n, s, d), "download"
                )
            yield os.path.join(folder, name)
        except OSError as exc:
            raise StatefulsetError(f"{self.join(name)}: cannot download the part: {exc}") from exc
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _download(self, name: str, source: str, local: str) -> None:
        size = int(bounded_call(self.join(name), "size", self._fs, "size", source) or 0)
        bounded_call(self.join(name), "download", self._fs, "get_file", source, local, nbytes=size)

    def fs_path(self, name: str) -> str:
        """``name``'s path on the folder's filesystem (remote folders only)."""
        return f"{self._fs_path}/{name}"

    def remove(self) -> None:
        if not self.remote:
            shutil.rmtree(_local(self.path), ignore_errors=True)
            return

        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                bounded_call(self.path, "remove", self._fs, "rm", self._fs_path, True)

        with_retries(self.path, remove, "remove")


def copying_store(prefix: str) -> tuple[Any, str] | None:
    """The filesystem and path of ``prefix`` when its store copies objects into a new one itself (S3's
    multipart ``UploadPartCopy``, :mod:`statefulset.shards.object_assembly`), else None."""
    if not is_url(prefix) or _protocol(prefix) not in ("s3", "s3a"):
        return None
    fs, fs_path = _fs(prefix)
    return (fs, fs_path) if hasattr(fs, "call_s3") else None


class StagedOutput:
    """A shard prefix to write with :class:`IndexedDatasetWriter`: the prefix itself when local,
    else a local staging prefix that :meth:`publish` uploads (``.bin``, then ``.idx``)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.remote = is_url(prefix)
        self._folder = tempfile.mkdtemp(prefix="statefulset-stage-") if self.remote else None
        base = prefix.rstrip("/").rsplit("/", 1)[-1]
        self.local = os.path.join(self._folder, base) if self._folder else _local(prefix)

    def publish(self, exts: tuple[str, ...] = (".bin", ".idx")) -> None:
        """Upload the staged files (only ``exts``: a ``.bin`` assembled on the store is not staged here)."""
        if not self.remote:
            return
        fs, fs_path = _fs(self.prefix)
        try:
            for ext in exts:
                with_retries(self.prefix + ext, lambda e=ext: self._upload(fs, e, fs_path + e), "upload")
        except OSError as exc:
            raise StatefulsetError(f"{self.prefix}: cannot upload the shard: {exc}") from exc
        finally:
            self.discard()

    def _upload(self, fs: Any, ext: str, target: str) -> None:
        source = self.local + ext
        bounded_call(self.prefix + ext, "upload", fs, "put_file", source, target, nbytes=os.path.getsize(source))

    def discard(self) -> None:
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)


def discard_all(writers: dict[str, Any], staged: dict[str, StagedOutput]) -> None:
    """Drop every key's output: the writers' temporaries and the local staging of remote outputs."""
    for key, writer in writers.items():
        writer.abort()  # nothing to do for a writer already closed
        staged[key].discard()


def publish_all(writers: dict[str, Any], staged: dict[str, StagedOutput]) -> None:
    """Close each key's writer and publish its output; when one fails, every key's staging goes, not
    only the failed one's (5cf6a81 left the later keys' staged corpora on local disk), then it raises."""
    try:
        for key, writer in writers.items():
            writer.close()
            staged[key].publish()
    except BaseException:
        discard_all(writers, staged)
        raise
