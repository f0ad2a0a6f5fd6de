"""``loader.metrics()``: is the data loader the bottleneck, and is the mixture what was asked for?

Everything is counted in the trainer process, once per batch, or derived when asked:

- ``data_wait_seconds``, ``batches``: a :class:`Meter` that the loader's deliveries
  (:mod:`statefulset.loading.delivery`) add to around each ``next()`` (two clock reads a batch).
- ``tokens``: ``batches x batch_size x seq_length`` (the tokens trained on; bestfit padding included).
- ``source/{prefix}/samples|weight|epoch``: derived from the blend tree at the rank's place
  (``stream.source_counts``: O(stages x log sources) when the place moved, cached otherwise;
  the weights of :mod:`statefulset.streams.standing`).
- ``storage/*`` and ``read_ahead/*``: every process's counters (:mod:`statefulset.shards.storage_stats`)
  live in a row of shared memory per DataLoader worker (the batch ring's ``stats``) plus the trainer's
  own; reading them sums a few small arrays, with no message to any worker, so it works while a
  worker is stuck too.
- ``workers/ready_batches``: batches built ahead and waiting, from the ring's slot stamps (a queue
  depth of 0 while the trainer waits says the workers are the bottleneck); sorted again only when a
  worker wrote one (``Delivery.ready_batches``).

``across_ranks=True`` adds one all-gather of a float per DP rank (:func:`across_ranks`), after the
ranks met within the loader's ``collective_timeout``. docs/observability.md says how to read them.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy
import torch
import torch.distributed as dist

from statefulset.errors import StatefulsetError
from statefulset.loading.compiled_read import FIRST, CompiledRead
from statefulset.parallel.arrival import meet
from statefulset.parallel.exchange import all_gather_floats
from statefulset.shards import storage_stats
from statefulset.streams.standing import weights_at

_CUMULATIVE = [
    storage_stats.REQUESTS, storage_stats.BYTES, storage_stats.RETRIES, storage_stats.FAILURES,
    storage_stats.AHEAD_TAKEN, storage_stats.AHEAD_READY, *range(storage_stats.FIRST_BUCKET, storage_stats.WIDTH),
]  # fmt: skip
_AHEAD = 1024  # positions one walk of the blend tree covers ahead of the reads
_AHEAD_VALUES = 8192  # at most positions x sources kept (fewer positions ahead with many sources)


class Meter:
    """The trainer's counts for one loader, over all its passes and worker restarts.

    A read (:meth:`read`) costs a few µs, after every batch if need be: the metrics live in one dict
    whose keys are made once and whose values are updated in place (the per-source ones from one
    walk of the blend tree, none when the position did not move; the storage ones summed by one
    numpy call and summarised only when a counter changed), and the caller gets a copy of it.
    """

    def __init__(self) -> None:
        self.wait = 0.0  # seconds inside next()
        self.batches = 0
        self.restarts = 0.0  # DataLoader workers started again (statefulset.loading.worker_start)
        self.stalls = 0.0  # stall warnings logged (statefulset.loading.watchdog)
        self._ring: Any = None  # the current pass's batch ring (its workers' storage rows): see ring
        self._worker_rows: numpy.ndarray | None = None  # its stats as numpy, a view of its shared memory
        self.delivery: Any = None  # a weak reference to the current pass (loading.delivery.Delivery)
        self._values: dict[str, float] = {}  # every metric, in the order a read returns them
        self._parts = -1  # the keys _values has: 1 with the workers' queue, + 2 with a position
        self._dataset: Any = None  # the dataset of the last read, and its tokens a batch
        self._tokens = 0
        self._place: int | None = None  # the position the per-source values in _values are for
        # The per-source keys (samples then epochs; weights) and each source's epoch, made once.
        self._keys: tuple[list[str], list[str], numpy.ndarray] | None = None
        # The last blend-tree walk: (first position, step, positions x step, each position's per-source
        # values (samples, then epochs) as the bytes of contiguous float64 rows), every position in the
        # first one's stage (where the weights in _values hold): a read unpacks one row, one cache line.
        self._ahead: tuple[int, int, int, bytes] = (0, 1, 0, b"")
        self._unpack: Any = None  # struct's unpack_from of one such row
        self._row_bytes = 0
        self._step = 0  # how far the position moved between the last two reads that walked the tree
        self._last: int | None = None  # the position of the last read that moved
        self._stage: int | None = None  # the stage the weights in _values are for
        self._own_key = b""  # the trainer's storage row's bytes the storage values in _values are for
        self._rows_key = b""  # and the workers' rows' bytes
        # The trainer's own row counts for the whole process (other loaders, earlier ones): this
        # loader reports what was counted since it was made (in-flight and oldest are instantaneous).
        self._offset = numpy.zeros(storage_stats.WIDTH, dtype=numpy.float64)
        self._offset[_CUMULATIVE] = storage_stats.row()[_CUMULATIVE]
        self._total = numpy.zeros(storage_stats.WIDTH, dtype=numpy.float64)
        self._workers_total = numpy.zeros(storage_stats.WIDTH, dtype=numpy.float64)
        self._compiled = CompiledRead.made()  # None: every read in Python (no usable extension; logged)
        self._fast: tuple[Any, ...] | None = None  # what a compiled read is called with, once synced

    def __getstate__(self) -> dict[str, Any]:
        # The compiled read holds this process's addresses: a copy (copy.deepcopy of a loader) makes its own.
        return {**self.__dict__, "_compiled": None, "_fast": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._compiled = CompiledRead.made()
        if self._compiled is not None:
            self._compiled.ring(self._ring)

    @property
    def ring(self) -> Any:
        """The current pass's batch ring (None without workers); setting it makes the view of its rows once."""
        return self._ring

    @ring.setter
    def ring(self, ring: Any) -> None:
        self._ring = ring
        if self._compiled is not None:
            self._compiled.ring(ring)
        self._worker_rows = None if ring is None else ring.stats.numpy()
        self._rows_key = b""  # summed again at the next read

    def read(self, dataset: Any, position: int | None) -> dict[str, float]:
        """This rank's metrics, a new dict; ``position``: the global position below which the stream
        counts as drawn (None: no per-source values).

        Read after every batch if need be: with the compiled extension, one C call
        (:mod:`statefulset.loading.compiled_read`) serves every read but those that walk the blend
        tree or change the dict's parts, which run in Python (:meth:`_read`) and hand it their state."""
        delivery = self.delivery() if self.delivery is not None else None
        fast = self._fast
        parts = (delivery is not None) + 2 * (position is not None)
        if fast is not None and parts == self._parts and dataset is self._dataset and storage_stats.row() is fast[3]:
            found = fast[0](
                fast[1], fast[2], self.wait, self.batches, self.restarts, self.stalls,
                0 if position is None else position,
                0 if delivery is None else delivery.next_t, 0 if delivery is None else len(delivery.ready),
            )  # fmt: skip
            if found is not None:  # None: a position not walked ahead
                return found
        compiled = self._compiled
        if compiled is not None:
            self._last = compiled.place()  # the reads it served moved the place: the step is from there
        values = self._read(dataset, position, delivery)
        if compiled is not None:
            counted = self._keys[0] if position is not None and self._keys is not None else []
            self._fast = compiled.synced(values, position, (self._tokens, self._offset, counted, self._ahead))
        return values.copy()

    def _read(self, dataset: Any, position: int | None, delivery: Any) -> dict[str, float]:
        """The read in Python: the meter's dict of values, brought up to date.

        Read after every batch if need be, so the common case is inline and makes few calls (each
        costs more than the arithmetic here): the per-source values are one row unpacked from the
        positions walked ahead (contiguous bytes: a cache line, not a numpy row), the storage
        ones summed again only when a row's bytes changed (each path is the same computation as a
        read from scratch, tests/test_metrics_incremental.py)."""
        values = self._values
        parts = (delivery is not None) + 2 * (position is not None)
        if self._parts != parts:  # first read, or a part came or went
            values = self._fresh(delivery is not None, position is not None, parts)
        if dataset is not self._dataset:  # tokens a batch: batch_size x seq_length
            self._dataset, self._tokens = dataset, dataset.batch_size * dataset.stream.seq_length
        batches = self.batches
        values["data_wait_seconds"] = self.wait
        values["batches"] = float(batches)
        values["tokens"] = float(batches * self._tokens)
        values["worker_restarts"] = self.restarts  # floats: counted as the dict holds them
        values["stall_warnings"] = self.stalls
        if delivery is not None:
            values["workers/ready_batches"] = float(delivery.ready_batches())
        if position is not None and position != self._place:
            values["position"] = float(position)
            first, step, span, rows = self._ahead
            off = position - first
            if 0 <= off < span and not off % step:  # walked ahead, in the stage whose weights values has
                row = self._unpack(rows, off // step * self._row_bytes)
                for key, value in zip(self._keys[0], row, strict=False):  # the same length (strict costs 60%)
                    values[key] = value
                self._place = position
            else:
                self._sources(dataset.stream, position, values)
        own = storage_stats.row()
        rows = self._worker_rows
        if own.tobytes() != self._own_key or (rows is not None and rows.tobytes() != self._rows_key):
            self._storage(own, values)
        self._last = self._place
        return values

    def _fresh(self, workers: bool, moves: bool, parts: int) -> dict[str, float]:
        """The dict of values made again, its keys in the order a read returns them (values filled by the read)."""
        values = self._values = dict.fromkeys(_FIRST, 0.0)
        if workers:
            values["workers/ready_batches"] = 0.0
        if moves:
            values["position"] = 0.0
        self._parts, self._place, self._own_key, self._rows_key, self._stage = parts, None, b"", b"", None
        self._last = None
        self._ahead = (0, 1, 0, b"")  # its rows are for the weights of the stage the old dict held
        return values

    def _sources(self, stream: Any, position: int, values: dict[str, float]) -> None:
        """``source/{prefix}/samples|weight|epoch`` at ``position`` into ``values``, from a walk of the
        blend tree (:meth:`_look_ahead`); the weights only when the stage changed."""
        if self._keys is None:
            if not hasattr(stream, "source_counts"):  # megatron packing: no blend tree to ask
                self._place = position
                return
            prefixes = list(stream.source_positions(position))  # once: the keys, in the stream's order
            self._keys = (
                [f"source/{p}/samples" for p in prefixes] + [f"source/{p}/epoch" for p in prefixes],
                [f"source/{p}/weight" for p in prefixes],
                # An epoch's samples; a source without any reports epoch 0 (count / inf).
                numpy.array([float(source.windows) or numpy.inf for source in stream.sources]),
            )
            self._unpack = struct.Struct(f"={len(self._keys[0])}d").unpack_from  # native doubles, as numpy's
            self._row_bytes = 8 * len(self._keys[0])
            self._stage = None
        counted, weight_keys, _ = self._keys
        if self._stage is None:  # the dict was made again: the keys in their order, source by source
            half = len(weight_keys)
            ordered = zip(counted[:half], weight_keys, counted[half:], strict=True)
            values.update(dict.fromkeys(key for keys in ordered for key in keys))
        stage, numbers = self._look_ahead(stream, position)
        values.update(zip(counted, numbers, strict=True))
        if stage != self._stage:
            _, raw = weights_at(stream, position)
            total = sum(raw) or 1.0
            values.update(zip(weight_keys, [w / total for w in raw], strict=True))
            self._stage = stage
        self._place = position

    def _look_ahead(self, stream: Any, position: int) -> tuple[int, list[float]]:
        """The stage and the per-source samples and epochs at ``position``; when the reads move by a
        steady step (a rank reads every batch, or every n-th: the same step twice), also at the next
        positions that step apart within the same stage, in one vectorised walk of the blend tree,
        kept for the reads to come (:attr:`_ahead`)."""
        last = self._last  # the position of the last read that moved (whichever read served it)
        step = position - last if last is not None and position > last else 0
        # Ahead only once the same step was seen twice: a jump (reads resumed after a pause) walks once.
        steady, self._step = step and step == self._step, step
        ahead = max(1, min(_AHEAD, _AHEAD_VALUES // len(self._keys[1]))) if steady else 1  # type: ignore[index]
        positions = position + step * numpy.arange(ahead, dtype=numpy.int64)
        counts, stages = stream.source_counts_many(positions)
        same = int(numpy.count_nonzero(stages == stages[0]))  # stages only rise with the position
        counts = counts[:same]
        rows = numpy.concatenate([counts.astype(numpy.float64), counts / self._keys[2]], axis=1)  # type: ignore[index]
        self._ahead = (position, step or 1, same * (step or 1), rows.tobytes())
        return int(stages[0]), rows[0].tolist()

    def _storage(self, own: numpy.ndarray, values: dict[str, float]) -> None:
        """The storage counters of the trainer (``own``) and the current pass's workers, summed into
        ``values``; a read found their bytes changed since the last sum."""
        self._own_key = own.tobytes()
        total = numpy.subtract(own, self._offset, out=self._total)
        if self._worker_rows is not None:
            self._rows_key = self._worker_rows.tobytes()
            total += numpy.add.reduce(self._worker_rows, axis=0, out=self._workers_total)
        values.update(storage_stats.summary(total))

    def storage_rows(self) -> list[Any]:
        rows = [storage_stats.row()]
        if self._worker_rows is not None:
            rows.extend(self._worker_rows)
        return rows


_FIRST = FIRST


def rank_metrics(meter: Meter, dataset: Any, position: int | None) -> dict[str, float]:
    """This rank's metrics (a new dict); ``position``: the global position below which the stream counts as drawn."""
    return meter.read(dataset, position)


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
