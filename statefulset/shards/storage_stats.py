"""Counters of this process's object-storage requests, in one small float64 row a trainer can read.

Every S3 ranged GET (:mod:`statefulset.shards.ranged_reads`, both clients) counts here: requests
that succeeded, bytes, retries, failures, a latency histogram (powers of two from 1 ms) and the
requests in flight with the oldest one's start. The row is process-local by default; a DataLoader
worker :func:`attach`-es it to its own row of the batch ring's shared memory
(:mod:`statefulset.loading.batches`), so the trainer reads every worker's counters at any moment,
stalled or not, without a message (:mod:`statefulset.loading.metrics`). One writer per row: the
requests run in the event loop of fsspec's I/O thread. Read-ahead (:mod:`statefulset.loading.read_ahead`)
counts its hits (a batch ready when the consumer wanted it) here too.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

import numpy

# Slots of a row.
REQUESTS, BYTES, RETRIES, FAILURES, IN_FLIGHT, OLDEST_START, OLDEST_SOURCE, AHEAD_TAKEN, AHEAD_READY = range(9)
BUCKETS = 16  # latency bucket k counts requests that took < 2**k ms (the last one: any longer)
FIRST_BUCKET = 9
WIDTH = FIRST_BUCKET + BUCKETS

_row = numpy.zeros(WIDTH, dtype=numpy.float64)
_names: list[str] = []  # source prefixes, for OLDEST_SOURCE (an index into them; -1 unknown)
_which: dict[str, int] = {}
_flight: dict[int, tuple[float, str]] = {}
_tickets = itertools.count()


def attach(row: Any, names: list[str]) -> None:
    """Count into ``row`` (a float64 array of WIDTH, e.g. shared memory) from now on; ``names``: the
    source prefixes an oldest request's URL is matched against."""
    global _row, _names
    _row = row
    _row[:] = 0.0
    _row[OLDEST_SOURCE] = -1.0
    _names = list(names)
    _which.clear()
    _flight.clear()


def row() -> numpy.ndarray:
    """This process's row (live: read it, never write it)."""
    return _row


def _source(url: str) -> int:
    found = _which.get(url)
    if found is None:
        found = next((i for i, name in enumerate(_names) if url.startswith(name + ".")), -1)
        _which[url] = found
    return found


def _oldest() -> None:
    if _flight:
        start, url = min(_flight.values())
        _row[OLDEST_START], _row[OLDEST_SOURCE] = start, _source(url)
    else:
        _row[OLDEST_START], _row[OLDEST_SOURCE] = 0.0, -1.0
    _row[IN_FLIGHT] = len(_flight)


def request_started(url: str) -> tuple[int, float]:
    """A GET of ``url`` goes out; pass the ticket to :func:`request_ended`."""
    ticket, now = next(_tickets), time.time()
    _flight[ticket] = (now, url)
    if len(_flight) == 1:
        _row[OLDEST_START], _row[OLDEST_SOURCE] = now, _source(url)
    _row[IN_FLIGHT] = len(_flight)
    return ticket, time.monotonic()


def request_ended(ticket: tuple[int, float], size: int | None, retried: bool) -> None:
    """The GET ended: ``size`` bytes, or None when it failed (``retried``: it will be sent again)."""
    _flight.pop(ticket[0], None)
    _oldest()
    if size is None:
        _row[RETRIES if retried else FAILURES] += 1
        return
    _row[REQUESTS] += 1
    _row[BYTES] += size
    ms = (time.monotonic() - ticket[1]) * 1000.0
    k = 0 if ms < 1.0 else min(BUCKETS - 1, int(math.log2(ms)) + 1)
    _row[FIRST_BUCKET + k] += 1


def read_ahead_taken(ready: bool) -> None:
    """Read-ahead handed over a batch; ``ready``: it was built before it was asked for."""
    _row[AHEAD_TAKEN] += 1
    _row[AHEAD_READY] += ready


def percentile(histogram: list[float], q: float) -> float:
    """Seconds below which a share ``q`` of the requests took (a bucket's upper bound: within 2x)."""
    total = sum(histogram)
    if total <= 0:
        return 0.0
    seen = 0.0
    for k, n in enumerate(histogram):
        seen += n
        if seen >= q * total:
            return 2.0**k / 1000.0
    return 2.0 ** (BUCKETS - 1) / 1000.0


def summary(total: numpy.ndarray) -> dict[str, float]:
    """The storage metrics of a row (or the sum of several: a trainer's and its workers')."""
    values = total.tolist()
    histogram = values[FIRST_BUCKET:]
    return {
        "storage/requests": values[REQUESTS],
        "storage/bytes": values[BYTES],
        "storage/retries": values[RETRIES],
        "storage/failures": values[FAILURES],
        "storage/in_flight": values[IN_FLIGHT],
        "storage/latency_p50_seconds": percentile(histogram, 0.5),
        "storage/latency_p90_seconds": percentile(histogram, 0.9),
        "storage/latency_p99_seconds": percentile(histogram, 0.99),
        "read_ahead/batches": values[AHEAD_TAKEN],
        "read_ahead/ready": values[AHEAD_READY],
    }


def oldest(rows: list[numpy.ndarray], names: list[str]) -> tuple[float, str | None] | None:
    """``(age in seconds, source prefix or None)`` of the oldest request in flight in ``rows``, if any."""
    starts = [(r[OLDEST_START], int(r[OLDEST_SOURCE])) for r in rows if r[IN_FLIGHT] > 0 and r[OLDEST_START] > 0]
    if not starts:
        return None
    start, source = min(starts)
    return max(time.time() - start, 0.0), names[source] if 0 <= source < len(names) else None
