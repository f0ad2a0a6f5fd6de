"""Identifying a split's shards while its open goes on: each ``.idx`` new to this machine is hashed in a thread.

The first open of a shard version hashes its whole ``.idx`` (:func:`statefulset.shards.digests.shard_digest`;
afterwards the facts remember the digest). ``hashlib`` lets go of the GIL while it hashes, so a thread
hashes while the opening process goes on with what needs no digest: the ``.idx`` files of the other
sources (side by side, up to :data:`THREADS` at a time) and a packing's index build
(:func:`statefulset.streams.megatron.build_ahead`).

Nothing uses a digest before it is complete: :meth:`Identifications.results` waits for every hash
(bounded by ``STATEFULSET_CACHE_WAIT``), reads each ``.bin`` sample and runs the same checks as
:func:`statefulset.shards.digests.identify`; no cache entry is looked up or written, and no identity
computed, before it returns. A shard whose digest the facts already hold starts no thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from statefulset import settings
from statefulset.errors import StatefulsetError
from statefulset.shards import facts
from statefulset.shards.digests import ShardDigest, identify, shard_digest

logger = logging.getLogger("statefulset")

THREADS = 4  # at most this many .idx files hashed at once (each thread holds a 1 MiB buffer)


class _Hash:
    """One ``.idx`` to hash: its digest or the error, once ``done`` is set."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.digest: str | None = None
        self.error: BaseException | None = None
        self.begun = False  # taken by a thread (under the lock): hashed, not dropped, when the open ends
        self.done = threading.Event()


class Identifications:
    """The identities of a list of opened shards (:class:`~statefulset.shards.reader.IndexedDataset`), in order.

    Use it as a context manager: leaving the block waits for the hashes under way and drops those
    not begun, so that no thread outlives the open (not even a failed one). The wait is bounded by
    ``STATEFULSET_CACHE_WAIT`` in all; a hash still running then is named in a WARNING and left to
    its (daemon) thread.
    """

    def __init__(self, memo_dir: str | None) -> None:
        self._memo = memo_dir
        self._jobs: list[tuple[Any, _Hash | None]] = []
        self._queue: list[_Hash] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._working = 0  # threads taking jobs from the queue

    def __enter__(self) -> Identifications:
        return self

    def __exit__(self, *_: object) -> None:
        with self._lock:
            self._queue.clear()
        bound = settings.CACHE_WAIT.get()
        deadline = time.monotonic() + bound
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:  # a thread past its last hash ends at once: only those still hashing are named
            held = [f"{job.prefix}.idx" for _, job in self._jobs if job and job.begun and not job.done.is_set()]
        if held:
            logger.warning(
                "statefulset: %s: still being hashed after %g s (STATEFULSET_CACHE_WAIT) when its open ended; "
                "left to its thread, which ends when the hash does", ", ".join(held), bound,
            )  # fmt: skip

    def start(self, dataset: Any) -> None:
        """Begin identifying ``dataset``: its ``.idx`` hashed in a thread unless its digest is known."""
        job = None
        path = dataset.path_prefix + ".idx"
        if dataset.known_digest is None and facts.recall("digest", path, directory=self._memo) is None:
            job = _Hash(dataset.path_prefix)
            with self._lock:
                self._queue.append(job)
                more = self._working < max(1, min(THREADS, os.cpu_count() or 1))
                self._working += 1 if more else 0
            if more:
                thread = threading.Thread(target=self._work, name="statefulset-digest", daemon=True)
                self._threads.append(thread)
                thread.start()
        self._jobs.append((dataset, job))

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._working -= 1  # under the lock that start() takes: a job queued later starts a thread
                    return
                job = self._queue.pop(0)
                job.begun = True
            try:
                job.digest = shard_digest(job.prefix, self._memo)
            except BaseException as exc:  # handed to the caller by results()
                job.error = exc
            finally:
                job.done.set()

    @property
    def hashing(self) -> bool:
        """Whether this open hashes an ``.idx`` (one whose digest the facts did not hold: a version new to them)."""
        return any(job is not None for _, job in self._jobs)

    def results(self) -> list[ShardDigest]:
        """Every shard's digest (:func:`statefulset.shards.digests.identify`), in the order started."""
        bound = settings.CACHE_WAIT.get()
        found = []
        for dataset, job in self._jobs:
            if job is not None:
                if not job.done.wait(bound):
                    raise StatefulsetError(
                        f"{job.prefix}.idx: still being hashed after {bound:g} s (STATEFULSET_CACHE_WAIT)"
                    )
                if job.error is not None:
                    raise job.error
            found.append(identify(dataset, self._memo, job.digest if job is not None else None))
        return found
