"""The compiled ``loader.metrics()`` read: one C call that fills the values and builds the dict.

Read after every batch, a read costs more inside a training loop than alone: everything it touches
(the meter's attributes, the dict and its keys, the ring's stamps, the storage rows, the rows walked
ahead) has left the CPU caches during the batch between (docs/observability.md, Cost). So the common
read is one call of ``metrics_read`` (``statefulset/index/kernels_module.c``): the values live in one
float64 array in the keys' order, and the call writes the per-batch counts, the per-source row
looked up among the positions walked ahead, the workers' queue (a scan of the ring's end stamps)
and the storage sums (the trainer's row less its offset plus the workers' shared rows) into it, then
builds a new dict from a tuple of the keys made once. The addresses and indices it needs sit in one
int64 control array (:data:`CONTROL`). Whatever it cannot serve (the first read, a position not
walked ahead, a stage change, the parts of the dict changing) :class:`statefulset.loading.metrics.Meter`
reads in Python as before, and :meth:`CompiledRead.synced` copies that read's state into the array
and the control; each path is the same computation (``tests/test_metrics_incremental.py``).

Without the installed extension (or with one built from another ``kernels_module.c``) every read
runs in Python, with a WARNING once (:func:`statefulset.index.compiled.module_function`).
"""

from __future__ import annotations

from typing import Any

import numpy

from statefulset.index.compiled import module_function
from statefulset.shards import storage_stats

# The control's int64 slots, in kernels_module.c's order (MR_*): see its enum for what each holds.
CONTROL = (
    "keys", "values", "count", "tokens", "ready", "position", "storage", "own", "offset",
    "ahead", "first", "step", "span", "row", "map", "place",
    "stamps", "slots", "bundle", "rows", "workers",
)  # fmt: skip
SLOT = {name: i for i, name in enumerate(CONTROL)}
RING = SLOT["stamps"]  # the ring's slots, from here to the end: written in one assignment
NO_PLACE = -(2**63)  # the place slot before a read with a position
FIRST = ("data_wait_seconds", "batches", "tokens", "worker_restarts", "stall_warnings")  # values[0..4]
STORAGE_KEYS = (
    "storage/requests", "storage/bytes", "storage/retries", "storage/failures", "storage/in_flight",
    "storage/latency_p50_seconds", "storage/latency_p90_seconds", "storage/latency_p99_seconds",
    "read_ahead/batches", "read_ahead/ready",
)  # fmt: skip


def address(array: numpy.ndarray) -> int:
    """The data address of a C-contiguous array the control points at (the caller keeps the array)."""
    if not array.flags.c_contiguous:
        raise ValueError("internal: the compiled metrics read needs C-contiguous arrays")
    return int(array.ctypes.data)


class CompiledRead:
    """The control and the arrays it points at, for one :class:`~statefulset.loading.metrics.Meter`."""

    @classmethod
    def made(cls) -> CompiledRead | None:
        """One, or None without a usable compiled ``metrics_read`` (logged once)."""
        read = module_function("metrics_read")
        if read is None:
            return None
        layout = (len(CONTROL), storage_stats.WIDTH, storage_stats.FIRST_BUCKET, storage_stats.BUCKETS)
        if read() != layout:  # pragma: no cover - a source out of step with this file (no arguments: its layout)
            raise RuntimeError(f"internal: metrics_read's layout {read()} is not {layout}")
        return cls(read)

    def __init__(self, read: Any) -> None:
        self.read = read
        self.control = numpy.zeros(len(CONTROL), dtype=numpy.int64)
        self.control[SLOT["position"]], self.control[SLOT["place"]] = -1, NO_PLACE  # nothing synced yet
        self.address = address(self.control)
        # The arrays the control points at, kept alive while it does (replaced only after it stops).
        self.kept: tuple[Any, ...] = ()
        self.ring_kept: tuple[Any, ...] = ()

    def ring(self, ring: Any) -> None:
        """The current pass's batch ring (None: none): its stamps and workers' storage rows."""
        if ring is None:
            kept: tuple[Any, ...] = ()
            slots = [0, 0, 0, 0, 0]
        else:
            stamps, rows = ring.stamps.numpy(), ring.stats.numpy()
            kept = (stamps, rows)
            slots = [address(stamps), stamps.size // 2, ring.bundle, address(rows), rows.shape[0]]
        previous = self.ring_kept
        self.ring_kept = kept
        self.control[RING:] = slots  # one assignment: a read sees the old ring or the new one
        del previous

    def synced(self, values: dict[str, float], position: int | None, state: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """After a read in Python: the array and the control as that read left them. ``values``: the
        meter's dict; ``state``: its tokens a batch, storage offset row, the per-source keys a row of
        the positions walked ahead holds (samples then epochs; none without per-source values) and
        that walk (first position, step, positions covered, the rows' bytes). Returns what
        :meth:`Meter.read` passes the compiled read (None: a layout it cannot serve)."""
        tokens, offset, counted, (first, step, span, rows) = state
        keys = tuple(values)
        template = dict(values)  # what the C call copies: the keys in their order, the values held
        at = keys.index(STORAGE_KEYS[0]) if STORAGE_KEYS[0] in values else -1
        if keys[:5] != FIRST or keys[at : at + len(STORAGE_KEYS)] != STORAGE_KEYS:
            return None  # pragma: no cover - the meter's dict always starts with these and has those together
        own = storage_stats.row()
        array = numpy.array(list(values.values()) * 2, dtype=numpy.float64)  # the values; the template's
        mapping = numpy.array([keys.index(key) for key in counted], dtype=numpy.int64)
        ahead = numpy.frombuffer(rows, dtype=numpy.float64) if rows and counted else None
        new = [
            id(template), address(array), len(keys), tokens,
            keys.index("workers/ready_batches") if "workers/ready_batches" in values else -1,
            keys.index("position") if position is not None else -1,
            at, address(own), address(offset),
            0 if ahead is None else address(ahead), first, step, span, len(counted),
            address(mapping) if counted else 0, NO_PLACE if position is None else position,
        ]  # fmt: skip
        previous = self.kept
        self.kept = (template, array, mapping, ahead, rows, own, offset)
        self.control[:RING] = new  # one assignment: a read sees the old layout or the new one
        del previous
        return self.read, self.address, template, own

    def place(self) -> int | None:
        """The position of the last read that served per-source values (None: none)."""
        found = int(self.control[SLOT["place"]])
        return None if found == NO_PLACE or self.control[SLOT["position"]] < 0 else found
