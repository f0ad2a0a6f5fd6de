"""Read-ahead for streams on object storage: the next batches are fetched while this one is used.

A batch from a remote corpus costs at least one round trip (10-100 ms), whatever its size, so a
worker that fetched one batch at a time would deliver a few dozen batches per second. Here a
small thread pool keeps ``depth`` batches in flight per process (threads suffice: the time is
spent waiting on sockets, without the GIL); memory stays bounded by ``depth`` batches.

``STATEFULSET_READ_AHEAD`` sets the depth (default 8 batches per process; 0 turns it off).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from statefulset import settings
from statefulset.shards import storage_stats

T = TypeVar("T")


def read_ahead_depth() -> int:
    return settings.READ_AHEAD.get()


def read_ahead(produce: Callable[[int], T], batches: Iterable[int], depth: int) -> Iterator[tuple[int, Future[T]]]:
    """``(t, future of produce(t))`` for each batch number, in order, with ``depth`` of them in flight."""
    pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="statefulset-read-ahead")
    pending: deque[tuple[int, Future[T]]] = deque()
    todo = iter(batches)
    try:
        while True:
            while len(pending) < depth:
                t = next(todo, None)
                if t is None:
                    break
                pending.append((t, pool.submit(produce, t)))
            if not pending:
                return
            t, future = pending.popleft()
            storage_stats.read_ahead_taken(future.done())
            yield t, future
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
