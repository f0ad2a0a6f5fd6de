"""One S3 object made of others by server-side copy: a merged ``.bin`` without its bytes passing here.

Merging the parts of a preprocessing job into one shard on object storage by downloading and
uploading moves the whole corpus through one machine twice and needs its size on local disk. S3's
multipart upload can instead take each part from an existing object (``UploadPartCopy``): the
store copies, this machine only says what goes where. The store's rules shape the plan:

* every part but the last holds at least 5 MiB and at most 5 GiB, so a source of 5 MiB or more is
  copied (in ranges of at most 5 GiB), while smaller sources, and the tail of a large one, are
  gathered here into parts of exactly 5 MiB and uploaded (memory: one such part per thread);
* an upload has at most 10,000 parts, so a longer plan is cut into groups, each assembled into an
  intermediate object, and the intermediates are assembled in turn (each level divides the number
  of parts by 10,000; the bytes are copied once more per level, on the store).

:func:`plan_parts` is pure (hypothesis-tested); :func:`assemble` runs a plan with an s3fs filesystem.
Every request is retried on transient faults (:func:`statefulset.shards.faults.with_retries`, bounded
and logged): an assembly of 10,000 parts must not end on one 503. Every request also waits a bounded
time (:func:`statefulset.shards.faults.bounded_call`, ``STATEFULSET_STORAGE_CALL_SECONDS`` plus a
second per 8 MiB it moves): an ``UploadPart`` whose body the store never takes is cut and retried.
Each is idempotent or made so: a part is sent again under its number, and a
``CompleteMultipartUpload`` whose answer was lost is recognised by the object's multipart ETag when
the retry finds the upload gone.
"""

from __future__ import annotations

import binascii
import contextlib
import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from statefulset.errors import StatefulsetError
from statefulset.shards.faults import bounded_call, with_retries

logger = logging.getLogger(__name__)

MIN_PART = 5 << 20  # S3: the smallest part but the last
MAX_PART = 5 << 30  # S3: the largest part
MAX_PARTS = 10_000  # S3: parts in one upload
THREADS = 16  # parts in flight: copies take the store's time, not ours


@dataclass(frozen=True)
class Range:
    path: str  # bucket/key
    start: int
    end: int


@dataclass(frozen=True)
class Part:
    """One part of an upload: a range copied by the store, or ranges gathered and uploaded from here."""

    copy: bool
    ranges: tuple[Range, ...]

    @property
    def size(self) -> int:
        return sum(r.end - r.start for r in self.ranges)


@dataclass
class Assembly:
    """What :func:`assemble` did: bytes the store copied, bytes that came through here, and levels."""

    copied: int = 0
    uploaded: int = 0
    levels: int = 0
    parts: list[int] = field(default_factory=list)  # parts per upload, level by level


def plan_parts(sources: list[tuple[str, int]], min_part: int = MIN_PART, max_part: int = MAX_PART) -> list[Part]:
    """The parts of one upload whose concatenation is the ``(path, size)`` sources in order: every part
    but the last holds ``min_part`` to ``max_part`` bytes; sources of ``min_part`` or more are copied."""
    if not 0 < min_part <= max_part:
        raise ValueError(f"need 0 < min_part <= max_part, got {min_part}, {max_part}")
    parts: list[Part] = []
    gathered: list[Range] = []
    held = 0
    for path, size in sources:
        pos = 0
        while pos < size:
            rest = size - pos
            if gathered:  # an upload part is filling up: it takes what it lacks first
                take = min(rest, min_part - held)
                gathered.append(Range(path, pos, pos + take))
                held, pos = held + take, pos + take
                if held == min_part:
                    parts.append(Part(False, tuple(gathered)))
                    gathered, held = [], 0
            elif rest >= min_part:
                take = min(rest, max_part)
                parts.append(Part(True, (Range(path, pos, pos + take),)))
                pos += take
            else:
                gathered, held, pos = [Range(path, pos, size)], rest, size
    if gathered:
        parts.append(Part(False, tuple(gathered)))
    return parts


def assemble(
    fs: Any,
    target: str,
    sources: list[tuple[str, int]],
    scratch: str,
    *,
    min_part: int = MIN_PART,
    max_part: int = MAX_PART,
    max_parts: int = MAX_PARTS,
) -> Assembly:
    """Write ``target`` (bucket/key on ``fs``, an s3fs filesystem) as the concatenation of ``sources``.
    Intermediate objects, if the plan needs more than ``max_parts`` parts, go under ``scratch`` and
    are removed. Nothing is written under ``target`` unless the whole object is."""
    report = Assembly()
    intermediates: list[str] = []
    try:
        while True:
            parts = plan_parts(sources, min_part, max_part)
            report.levels += 1
            if len(parts) <= max_parts:
                report.parts.append(len(parts))
                _upload(fs, target, parts, report)
                return report
            if report.parts and len(parts) >= report.parts[-1] * max_parts:  # a level that gains nothing
                total = sum(size for _, size in sources)
                raise StatefulsetError(
                    f"s3://{target}: {total} bytes do not fit {max_parts} parts of at most {max_part} bytes"
                )
            groups = [parts[i : i + max_parts] for i in range(0, len(parts), max_parts)]
            report.parts.append(len(groups))
            sources = []
            for number, group in enumerate(groups):
                name = f"{scratch}/assembly-{report.levels}-{number:06d}"
                intermediates.append(name)
                _upload(fs, name, group, report)
                sources.append((name, sum(p.size for p in group)))
    finally:
        for name in intermediates:
            try:
                with_retries(
                    f"s3://{name}", lambda n=name: bounded_call(f"s3://{n}", "remove", fs, "rm_file", n), "remove"
                )
            except (OSError, StatefulsetError) as exc:  # left for the bucket's lifecycle rules; the shard is fine
                logger.warning("statefulset: could not remove the intermediate object %s: %s", name, exc)


def _s3(fs: Any, url: str, what: str, method: str, nbytes: int = 0, **kwargs: Any) -> Any:
    """``fs.call_s3(method, **kwargs)``, retried on transient faults, each attempt bounded in time."""
    return with_retries(url, lambda: bounded_call(url, what, fs, "call_s3", method, nbytes=nbytes, **kwargs), what)


def _split(path: str) -> tuple[str, str]:
    bucket, _, key = path.partition("/")
    return bucket, key


def multipart_etag(part_etags: list[str]) -> str:
    """The ETag S3 gives an object completed from parts with these ETags: the MD5 of their MD5s, ``-N``."""
    digests = b"".join(binascii.unhexlify(e.strip('"')) for e in part_etags)
    return f'"{hashlib.md5(digests).hexdigest()}-{len(part_etags)}"'


def _complete(fs: Any, target: str, upload_id: str, done: list[dict[str, Any]]) -> None:
    """``CompleteMultipartUpload``, retried. A retry that finds the upload gone (``NoSuchUpload``) after an
    attempt whose answer was lost accepts the object only if its ETag is the one these parts make."""
    bucket, key = _split(target)
    url, attempts = f"s3://{target}", 0

    def complete() -> None:
        nonlocal attempts
        attempts += 1
        try:
            bounded_call(url, "completion of the upload", fs, "call_s3", "complete_multipart_upload",
                         Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done})  # fmt: skip
        except Exception as exc:
            if attempts == 1 or "NoSuchUpload" not in f"{type(exc).__name__}: {exc}":
                raise
            fs.invalidate_cache(target)
            found = bounded_call(url, "info", fs, "call_s3", "head_object", Bucket=bucket, Key=key).get("ETag")
            if found != multipart_etag([p["ETag"] for p in done]):
                raise

    with_retries(url, complete, "completion of the upload")


def _send_part(fs: Any, target: str, upload_id: str, number: int, part: Part) -> str:
    """Part ``number``'s ETag: copied by the store, or gathered here and uploaded; each request retried."""
    bucket, key = _split(target)
    url = f"s3://{target}"
    args = {"Bucket": bucket, "Key": key, "UploadId": upload_id, "PartNumber": number}
    if part.copy:
        (r,) = part.ranges
        source_bucket, source_key = _split(r.path)
        done = _s3(fs, url, f"copy of part {number}", "upload_part_copy", nbytes=part.size, **args,
                   CopySource={"Bucket": source_bucket, "Key": source_key},
                   CopySourceRange=f"bytes={r.start}-{r.end - 1}")  # fmt: skip
        return str(done["CopyPartResult"]["ETag"])
    body = b"".join(
        with_retries(
            f"s3://{r.path}",
            lambda r=r: bounded_call(
                f"s3://{r.path}", "read", fs, "cat_file", r.path, start=r.start, end=r.end, nbytes=r.end - r.start
            ),
            "read",
        )
        for r in part.ranges
    )
    if len(body) != part.size:
        raise StatefulsetError(f"read {len(body)} bytes of its sources, expected {part.size}")
    sent = _s3(fs, url, f"upload of part {number}", "upload_part", nbytes=len(body), **args, Body=body)
    return str(sent["ETag"])


def _upload(fs: Any, target: str, parts: list[Part], report: Assembly) -> None:
    bucket, key = _split(target)
    url = f"s3://{target}"
    if not parts:  # an empty shard: multipart needs a part
        with_retries(url, lambda: bounded_call(url, "write", fs, "pipe_file", target, b""), "write")
        return
    try:
        upload_id = _s3(fs, url, "start of the upload", "create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    except Exception as exc:  # botocore's errors do not share a base with OSError
        raise StatefulsetError(f"s3://{target}: cannot start a multipart upload: {exc}") from exc

    def send(number: int, part: Part) -> dict[str, Any]:
        try:
            return {"PartNumber": number, "ETag": _send_part(fs, target, upload_id, number, part)}
        except Exception as exc:  # botocore's errors, and with_retries' StatefulsetError naming only the URL
            sources = ", ".join(f"s3://{r.path} [{r.start}, {r.end})" for r in part.ranges[:3])
            where = f"s3://{target}: part {number} of {len(parts)}"
            raise StatefulsetError(f"{where} (from {sources}) failed: {exc}") from exc

    try:
        pool = ThreadPoolExecutor(THREADS, thread_name_prefix="statefulset-assembly")
        try:
            futures = [pool.submit(send, number, part) for number, part in enumerate(parts, 1)]
            done = [future.result() for future in futures]
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # after a failure, the rest are not sent
        _complete(fs, target, upload_id, done)
    except BaseException as exc:
        with contextlib.suppress(Exception):  # the first error is the one to report
            _s3(fs, url, "abort of the upload", "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        if isinstance(exc, StatefulsetError) or not isinstance(exc, Exception):
            raise
        raise StatefulsetError(f"s3://{target}: cannot complete the multipart upload: {exc}") from exc
    fs.invalidate_cache(target)
    for part in parts:
        if part.copy:
            report.copied += part.size
        else:
            report.uploaded += part.size
