"""One object on object storage (any fsspec URL that is not local): sizes and ranged reads.

- **Per process**: the filesystem object is created lazily in the process that uses it and
  dropped when pickled. fsspec's async filesystems (s3fs, gcsfs) own an event-loop thread that
  does not survive ``fork``, so a worker never touches its parent's client.
- **Few, concurrent requests**: :meth:`RemoteFile.read_ranges` sorts a batch's byte ranges,
  merges those that touch or lie within ``MERGE_GAP`` bytes of each other, and issues the rest
  at once through ``cat_ranges`` (concurrent on async filesystems).
- **Faults**: every request is retried on transient faults, bounded
  (:func:`statefulset.shards.faults.with_retries`; S3 ranged reads one by one in
  :mod:`statefulset.shards.ranged_reads`).
- **One version**: S3 ranged reads carry ``If-Match`` with the ETag seen at open, so an object
  overwritten mid-run is a named error, never tokens of the new version; other schemes compare
  the object's version again when a process (a DataLoader worker) first reads it.
- **A store that slows down slows the reader down**: S3 ranged reads share the process's request
  limit (:mod:`statefulset.shards.throttle`), and merge ranges across wider gaps while it is cut.
"""

from __future__ import annotations

import os
import sys
from typing import IO, Any

from statefulset import settings
from statefulset.errors import StatefulsetError
from statefulset.shards import obstore_client, ranged_reads
from statefulset.shards.faults import changed_error, describe, with_retries
from statefulset.shards.throttle import limiter

# Ranges closer than this are read as one request: one round trip costs more than ~64 KiB of
# extra transfer on any object store (10-50 ms first-byte latency against 100+ MB/s).
MERGE_GAP = 64 * 1024
# A merged request never grows beyond this, so one range does not stall the others.
MAX_REQUEST = 16 * 1024 * 1024

_S3_SCHEMES = ("s3", "s3a", "s3n")


def missing_backend(url: str, exc: BaseException) -> StatefulsetError:
    """The message for a URL whose fsspec backend is not installed: name the pip extra."""
    scheme = url.split("://", 1)[0]
    if scheme in _S3_SCHEMES:
        hint = "install s3fs: pip install 'statefulset[s3]'"
    else:
        hint = f"install the fsspec backend for {scheme}:// (see fsspec's list of implementations)"
    return StatefulsetError(f"{url}: cannot open this URL: {hint} ({type(exc).__name__}: {exc})")


def client_options(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` with statefulset's defaults for S3 filled in where the user set nothing.

    statefulset retries (:mod:`statefulset.shards.faults`, bounded in attempts and seconds), so
    s3fs's own retries (5, up to 15 s apart) and botocore's (4 more under each of those) are
    switched off: stacked, they turned one persistent 503 into a two-minute wait. A connection
    attempt gives up after 10 s instead of botocore's 60 s, and an answer that stops coming after
    ``STATEFULSET_STORAGE_CALL_SECONDS`` (botocore's read timeout).
    """
    options = dict(storage_options or {})
    if url.split("://", 1)[0] in _S3_SCHEMES:
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1})
        config.setdefault("connect_timeout", 10)
        config.setdefault("read_timeout", settings.STORAGE_CALL_SECONDS.get())
        options["config_kwargs"] = config
        # The endpoint botocore would take from the environment, named in the options: fsspec keeps
        # one filesystem per set of options, and one made under another AWS_ENDPOINT_URL (an earlier
        # test's server, gone) was handed back for this one.
        client = dict(options.get("client_kwargs") or {})
        endpoint = obstore_client.endpoint(options)
        if endpoint and not options.get("endpoint_url") and not client.get("endpoint_url"):
            options["client_kwargs"] = {**client, "endpoint_url": endpoint}
    return options


# s3fs filesystems a forked process inherited from its parent (see _keep_inherited_clients).
_INHERITED: list[Any] = []


def _keep_inherited_clients() -> None:
    """In a forked child, hold on to the parent's s3fs filesystems so that they are never collected here.

    s3fs closes a collected filesystem's aiobotocore client by scheduling the close on the running
    loop of whichever thread collects it. In a forked child the parent's client belongs to a loop
    that does not run here: a collection that lands in the child's own I/O loop thread printed
    "Task exception was never retrieved ... attached to a different loop" (issue 24, seen many times
    per run with DataLoader workers). Forked DataLoader workers end with ``os._exit``, so the
    parent's clients are simply never touched here; the parent closes them itself.
    """
    s3fs = sys.modules.get("s3fs")
    if s3fs is not None:
        _INHERITED.extend(list(getattr(s3fs.S3FileSystem, "_cache", {}).values()))


os.register_at_fork(after_in_child=_keep_inherited_clients)


def open_filesystem(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """``(filesystem, path)`` for ``url``, or a StatefulsetError saying what to install or fix."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url, **client_options(url, storage_options))
    except ImportError as exc:
        raise missing_backend(url, exc) from exc
    except (ValueError, TypeError) as exc:
        raise StatefulsetError(f"{url}: cannot open this URL with fsspec (storage_options?): {exc}") from exc
    if url.split("://", 1)[0] in _S3_SCHEMES and hasattr(fs, "retries"):
        fs.retries = 1  # s3fs takes no constructor argument for it; see client_options
    return fs, path


def coalesce(offsets: list[int], sizes: list[int], gap: int = MERGE_GAP) -> tuple[list[tuple[int, int]], list[int]]:
    """Merge byte ranges into requests: ``(requests as (start, end), request index of each range)``.

    Ranges are merged when they overlap, touch or lie within ``gap`` bytes, as long as the
    request stays within ``MAX_REQUEST`` bytes.
    """
    order = sorted(range(len(offsets)), key=offsets.__getitem__)
    requests: list[tuple[int, int]] = []
    which = [0] * len(offsets)
    for i in order:
        start, end = offsets[i], offsets[i] + sizes[i]
        if requests:
            lo, hi = requests[-1]
            if start <= hi + gap and max(hi, end) - lo <= MAX_REQUEST:
                requests[-1] = (lo, max(hi, end))
                which[i] = len(requests) - 1
                continue
        requests.append((start, end))
        which[i] = len(requests) - 1
    return requests, which


def object_version(info: dict[str, Any]) -> str:
    """The object's version as the store reports it (ETag and size): what a local copy is keyed by."""
    for key in ("ETag", "etag", "md5", "checksum", "mtime", "LastModified", "created"):
        if info.get(key):
            return f"{key}={info[key]}:size={info['size']}"
    return f"size={info['size']}"


def limiter_gap(loop: Any) -> int:
    """The merge gap for requests run in ``loop``: ``MERGE_GAP``, wider while the store is throttling."""
    return limiter(loop).merge_gap(MERGE_GAP, MAX_REQUEST // 4)


class RemoteFile:
    """A read-only object: ``size``, ``read``, ``read_ranges``, ``open``; safe to pickle and fork."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.storage_options = storage_options
        self._fs: Any = None
        self._path = ""
        self._pid = -1
        self._fast = obstore_client.wanted(url, storage_options)  # ranged reads through obstore
        self._store: Any = None
        self._store_pid = -1
        self.requests = 0  # requests issued by this process (benchmarks report requests per sample)
        fs, path = self._filesystem()
        info = self._call(lambda: fs.info(path), "info")
        if info.get("type", "file") != "file":
            raise StatefulsetError(f"{url}: not an object (a folder or prefix)")
        self.size = int(info["size"])
        self.ukey = object_version(info)
        # S3: every ranged GET is pinned to this ETag (If-Match).
        self.etag = str(info.get("ETag") or "") if self._s3 else ""

    @property
    def _s3(self) -> bool:
        return self.url.split("://", 1)[0] in _S3_SCHEMES

    def _filesystem(self) -> tuple[Any, str]:
        if self._pid != os.getpid():
            inherited = self._pid != -1 or hasattr(self, "ukey")  # a worker's first use, not the opening
            self._fs, self._path = open_filesystem(self.url, self.storage_options)
            self._pid = os.getpid()
            if inherited and not self.etag:
                self.check_unchanged()
        return self._fs, self._path

    def check_unchanged(self) -> None:
        """A StatefulsetError when the object is no longer the version opened (one metadata request)."""
        fs, path = self._filesystem()
        fs.invalidate_cache(path)
        now = object_version(self._call(lambda: fs.info(path), "info"))
        if now != self.ukey:
            raise changed_error(self.url, self.ukey, now)

    def _object_store(self) -> Any:
        if self._store_pid != os.getpid():
            try:
                self._store, self._key = obstore_client.open_store(self.url, self.storage_options, self.etag)
            except ValueError as exc:  # the boto3 credential provider found no credentials
                raise describe(self.url, exc) from exc
            self._store_pid = os.getpid()
        return self._store

    def _call(self, call: Any, what: str) -> Any:
        def attempt() -> Any:
            try:
                return call()
            except ImportError as exc:  # a backend's optional dependency, found lazily
                raise missing_backend(self.url, exc) from exc

        return with_retries(self.url, attempt, what)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_fs=None, _path="", _pid=-1, requests=0, _store=None, _store_pid=-1)
        return state

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.read_ranges([offset], [nbytes])[0]

    def read_ranges(self, offsets: list[int], sizes: list[int], fork_safe: bool = False) -> list[bytes]:
        """The bytes of every range, with the fewest requests, all in flight at once. ``fork_safe``: a
        one-off read (a shard's identity at open) that must not start obstore's runtime in this process,
        which would leave every DataLoader worker forked from it on s3fs (see :mod:`obstore_client`)."""
        if not offsets:
            return []
        if self._s3:
            blocks, requests, which = self._read_s3(offsets, sizes, fork_safe)
        else:
            requests, which = coalesce(offsets, sizes)
            blocks = self._read_fsspec(requests)
        out = []
        for i, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
            block = blocks[which[i]]
            lo = requests[which[i]][0]
            data = block[offset - lo : offset - lo + size]
            if len(data) != size:
                raise StatefulsetError(
                    f"{self.url}: read of {size} bytes at {offset} returned {len(data)}: object truncated?"
                )
            out.append(data)
        return out

    def _read_s3(
        self, offsets: list[int], sizes: list[int], fork_safe: bool = False
    ) -> tuple[list[bytes], list[tuple[int, int]], list[int]]:
        """Pinned, limited, one-by-one retried GETs (:mod:`statefulset.shards.ranged_reads`)."""
        fast = self._fast and obstore_client.usable() and not (fork_safe and not obstore_client.started_here())
        if fast:
            import fsspec.asyn

            store, loop = self._object_store(), fsspec.asyn.get_loop()
        else:
            fs, path = self._filesystem()
            loop = fs.loop
        gap = limiter_gap(loop)
        requests, which = coalesce(offsets, sizes, gap)
        starts, ends = [r[0] for r in requests], [r[1] for r in requests]
        if fast:
            gets = obstore_client.gets(store, self._key, starts, ends)
        else:
            gets = ranged_reads.s3fs_gets(fs, path, self.etag, starts, ends)
        self.requests += len(gets)
        return ranged_reads.run(loop, self.url, self.etag, gets), requests, which

    def _read_fsspec(self, requests: list[tuple[int, int]]) -> list[bytes]:
        """Other schemes: fsspec's ``cat_ranges``, the failed requests sent again (bounded)."""
        fs, path = self._filesystem()
        pending = list(range(len(requests)))
        got: list[bytes] = [b""] * len(requests)

        def fetch() -> None:
            starts = [requests[k][0] for k in pending]
            ends = [requests[k][1] for k in pending]
            self.requests += len(pending)
            if len(pending) == 1:
                answers: list[Any] = [fs.cat_file(path, start=starts[0], end=ends[0])]
            else:
                answers = fs.cat_ranges([path] * len(pending), starts, ends, on_error="return")
            failed = []
            for k, answer in zip(list(pending), answers, strict=True):
                if isinstance(answer, BaseException):
                    failed.append((k, answer))
                else:
                    got[k] = answer
            pending[:] = [k for k, _ in failed]
            if failed:
                raise failed[0][1]

        self._call(fetch, "read")
        return got

    def download(self, local_path: str) -> None:
        """Copy the whole object to ``local_path`` (the caller makes that atomic)."""
        fs, path = self._filesystem()
        self._call(lambda: fs.get_file(path, local_path), "download")

    def open(self) -> IO[bytes]:
        fs, path = self._filesystem()
        try:
            return fs.open(path, "rb")
        except Exception as exc:
            raise describe(self.url, exc) from exc
