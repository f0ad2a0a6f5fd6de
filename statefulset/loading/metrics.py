"""``loader.metrics()``: is the data loader the bottleneck, and is the mixture what was asked for?

Everything is counted in the trainer process, once per batch, or derived when asked:

- ``data_wait_seconds``, ``batches``: a :class:`Meter` that the loader's deliveries
  (:mod:`statefulset.loading.delivery`) add to around each ``next()`` (two clock reads a batch).
- ``tokens``: ``batches x batch_size x seq_length`` (the tokens trained on; bestfit padding included).
- ``source/{prefix}/samples|weight|epoch``: derived from the blend tree at the rank's place
  (``stream.source_positions``: O(stages x log sources) when the place moved, cached otherwise;
  the weights of :mod:`statefulset.streams.standing`).
- ``storage/*`` and ``read_ahead/*``: every process's counters (:mod:`statefulset.shards.storage_stats`)
  live in a row of shared memory per DataLoader worker (the batch ring's ``stats``) plus the trainer's
  own; reading them sums a few small arrays, with no message to any worker, so it works while a
  worker is stuck too.
- ``workers/ready_batches``: batches built ahead and waiting, from the ring's slot stamps (a queue
  depth of 0 while the trainer waits says the workers are the bottleneck).

``across_ranks=True`` adds one all-gather of a float per DP rank (:func:`across_ranks`), after the
ranks met within the loader's ``collective_timeout``. docs/observability.md says how to read them.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from statefulset.errors import StatefulsetError
from statefulset.parallel.arrival import meet
from statefulset.parallel.exchange import all_gather_floats
from statefulset.shards import storage_stats
from statefulset.streams.standing import weights_at

_CUMULATIVE = [
    storage_stats.REQUESTS, storage_stats.BYTES, storage_stats.RETRIES, storage_stats.FAILURES,
    storage_stats.AHEAD_TAKEN, storage_stats.AHEAD_READY, *range(storage_stats.FIRST_BUCKET, storage_stats.WIDTH),
]  # fmt: skip


class Meter:
    """The trainer's counts for one loader, over all its passes and worker restarts."""

    def __init__(self) -> None:
        self.wait = 0.0  # seconds inside next()
        self.batches = 0
        self.restarts = 0  # DataLoader workers started again (statefulset.loading.worker_start)
        self.stalls = 0  # stall warnings logged (statefulset.loading.watchdog)
        self.ring: Any = None  # the current pass's batch ring (its workers' storage rows)
        self.delivery: Any = None  # a weak reference to the current pass (loading.delivery.Delivery)
        self._place: int | None = None
        self._sources: dict[str, float] = {}
        self._keys: list[tuple[str, ...]] | None = None  # each source's three keys, made once
        self._per_epoch: list[int] = []
        self._weights: dict[int, list[float]] = {}  # normalised weights by stage
        self._storage_key = b""
        self._storage: dict[str, float] = {}
        # The trainer's own row counts for the whole process (other loaders, earlier ones): this
        # loader reports what was counted since it was made (in-flight and oldest are instantaneous).
        self._base = storage_stats.row().copy()

    def sources(self, stream: Any, position: int) -> dict[str, float]:
        """``source/{prefix}/...`` at ``position``, recomputed only when the position moved."""
        if position == self._place or not hasattr(stream, "source_positions"):
            return self._sources
        counts = stream.source_positions(position)
        if self._keys is None:
            self._keys = [tuple(f"source/{p}/{what}" for what in ("samples", "weight", "epoch")) for p in counts]
            self._per_epoch = [int(source.windows) for source in stream.sources]
        stage, raw = weights_at(stream, position)
        weights = self._weights.get(stage)
        if weights is None:
            total = sum(raw) or 1.0
            weights = self._weights[stage] = [w / total for w in raw]
        out: dict[str, float] = {}
        for (samples, weight, epoch), count, w, per_epoch in zip(
            self._keys, counts.values(), weights, self._per_epoch, strict=True
        ):
            out[samples], out[weight], out[epoch] = float(count), w, count / per_epoch if per_epoch else 0.0
        self._place, self._sources = position, out
        return out

    def storage(self) -> dict[str, float]:
        """The storage counters of the trainer and the current pass's workers, summed (cached while unchanged)."""
        total = storage_stats.row().copy()
        total[_CUMULATIVE] -= self._base[_CUMULATIVE]
        if self.ring is not None:
            total += self.ring.stats.numpy().sum(axis=0)
        key = total.tobytes()
        if key != self._storage_key:
            self._storage_key, self._storage = key, storage_stats.summary(total)
        return self._storage

    def storage_rows(self) -> list[Any]:
        rows = [storage_stats.row()]
        if self.ring is not None:
            rows.extend(self.ring.stats.numpy())
        return rows


def rank_metrics(meter: Meter, dataset: Any, position: int | None) -> dict[str, float]:
    """This rank's metrics; ``position``: the global position below which the stream counts as drawn."""
    out: dict[str, float] = {
        "data_wait_seconds": meter.wait,
        "batches": float(meter.batches),
        "tokens": float(meter.batches * dataset.batch_size * dataset.stream.seq_length),
        "worker_restarts": float(meter.restarts),
        "stall_warnings": float(meter.stalls),
    }
    delivery = meter.delivery() if meter.delivery is not None else None
    if delivery is not None:
        out["workers/ready_batches"] = float(delivery.ready_batches())
    if position is not None:
        out["position"] = float(position)
        out.update(meter.sources(dataset.stream, position))
    out.update(meter.storage())
    return out


def across_ranks(values: dict[str, float], worker_config: Any, timeout: float | None) -> dict[str, float]:
    """``values`` plus ``data_wait_seconds/max|min|mean`` and ``data_wait_seconds/max_rank`` over the DP group.

    A collective: every DP rank calls it. The ranks first meet (bounded by ``timeout``, naming
    the ranks that did not come), then all-gather one float each.
    """
    out = dict(values)
    size = worker_config.world_size
    if size == 1:
        waits = torch.tensor([values["data_wait_seconds"]], dtype=torch.float64)
    else:
        if not (dist.is_available() and dist.is_initialized()):
            raise StatefulsetError(
                f"metrics(across_ranks=True): WorkerConfig says world_size {size} but torch.distributed is not "
                "initialised"
            )
        group = worker_config.data_parallel_group
        meet("metrics", group, timeout)
        waits = all_gather_floats([values["data_wait_seconds"]], group, "metrics(across_ranks=True)")[:, 0]
    out["data_wait_seconds/max"] = float(waits.max())
    out["data_wait_seconds/min"] = float(waits.min())
    out["data_wait_seconds/mean"] = float(waits.mean())
    out["data_wait_seconds/max_rank"] = float(int(waits.argmax()))
    return out


def log_metrics(values: dict[str, float], writer: Any, step: int, prefix: str = "data/") -> None:
    """``writer.add_scalar(prefix + name, value, step)`` for each metric (a SummaryWriter-like object)."""
    add = getattr(writer, "add_scalar", None)
    if not callable(add):
        raise StatefulsetError(f"log_metrics: the writer {type(writer).__name__} has no add_scalar(tag, value, step)")
    for name, value in values.items():
        add(prefix + name, value, step)


class Timer:
    """``with Timer(meter):`` around one ``next()``: adds the seconds to ``meter.wait``."""

    __slots__ = ("meter", "start")

    def __init__(self, meter: Meter) -> None:
        self.meter = meter

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.meter.wait += time.perf_counter() - self.start
