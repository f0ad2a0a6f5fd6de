"""The batch ring: ``workers x slots`` buffers of one shared-memory block, and its sequence stamps.

How workers fill the slots and the trainer copies them out, and why ``slots = prefetch_factor + 1``
suffices: :mod:`statefulset.loading.batches`.
"""

from __future__ import annotations

from typing import Any

import numpy
import torch

from statefulset.errors import StatefulsetError
from statefulset.loading.encoded_ring import staged_names
from statefulset.shards import storage_stats
from statefulset.streams.documents import FieldSpec

# A worker sends batches in bundles of about this many bytes: each DataLoader round trip (index
# queue, result queue, their feeder threads) costs ~0.3 ms of CPU here, which one 32 KB batch
# cannot pay for, while a bundle of eight can.
BUNDLE_BYTES = 256 * 1024
MAX_BUNDLE = 16


def bundle_size(batch_size: int, fields: list[FieldSpec]) -> int:
    """Batches per worker hand-off: 1 for batches of BUNDLE_BYTES of text or more, at most MAX_BUNDLE.

    Sized by ``text`` alone: the other fields (document boundaries: ~7x the bytes of uint16
    text) cost a copy each, not a round trip, so they must not shrink the bundle (measured: a
    bundle of 1 instead of 8 cost 2 workers 60% of their throughput).
    """
    per_batch = batch_size * _row_bytes(fields[0])
    return max(1, min(MAX_BUNDLE, BUNDLE_BYTES // max(per_batch, 1)))


def make_ring(workers: int, slots: int, batch_size: int, fields: list[FieldSpec], encoder: Any) -> BatchRing:
    """The ring of a dataset whose rows are ``fields``, with ``encoder`` (a TaskEncoderRunner, or None)
    running in the workers. ``text`` travels in the corpus dtype, as without an encoder: the encoder's
    samples hold the slot's rows and widen ``text`` to int64 only where it is read
    (statefulset.transforms.sample), so an identity's slot is sent as it was gathered. An encoder that
    changes a micro-batch's rows in place (``encode_rows_in_place``, FillInTheMiddle's compiled path)
    works on int64 rows: its ring carries ``text`` as int64, gathered straight into the slot and changed
    there (statefulset.loading.encoded_ring). Bundled as the corpus dtype's rows would be."""
    bundle = bundle_size(batch_size, fields)
    wide = encoder is not None and encoder.rows_in_place
    if wide:
        fields = [FieldSpec(f.name, f.shape, numpy.dtype(numpy.int64)) if f.name == "text" else f for f in fields]
    return BatchRing(workers, slots, batch_size, fields, bundle)


def _row_bytes(field: FieldSpec) -> int:
    return int(numpy.prod(field.shape, dtype=numpy.int64)) * field.dtype.itemsize


class BatchRing:
    """``workers × slots`` buffers of ``bundle`` batches each, in one shared-memory block.

    A slot holds every field of its batches (``text`` in the corpus dtype, int64 for an encoder that
    changes rows in place, then ``loss_mask`` and the document fields when the dataset has them), one
    array per field, back to back.
    """

    def __init__(self, workers: int, slots: int, batch_size: int, fields: list[FieldSpec], bundle: int = 1) -> None:
        self.workers, self.slots, self.bundle = workers, slots, bundle
        self.batch_size = batch_size
        self.fields = list(fields)
        self.staged_names = staged_names(self.fields)  # asked every encoded micro-batch (encoded_ring)
        self.dtype = self.fields[0].dtype  # text's: what read-ahead builds rows in
        self.limits = numpy.iinfo(self.dtype)  # the tokens a slot holds (an encoder's are checked against it)
        self.shape = (bundle, batch_size, *self.fields[0].shape)
        self._offsets, at = [], 0
        for field in self.fields:
            at = -(-at // 8) * 8  # every field 8-byte aligned
            self._offsets.append(at)
            at += bundle * batch_size * _row_bytes(field)
        self.slot_bytes = -(-at // 8) * 8
        self.block = torch.empty(workers * slots * self.slot_bytes, dtype=torch.uint8).share_memory_()
        # Raised by each worker as its first act (statefulset.loading.worker_start watches them).
        self.started = torch.zeros(workers, dtype=torch.int8).share_memory_()
        # Per slot: the begin and end sequence stamps (the first batch number of the bundle in it).
        self.stamps = torch.full((workers, slots, 2), -1, dtype=torch.int64).share_memory_()
        # Each worker's storage and read-ahead counters (statefulset.shards.storage_stats), read by the trainer.
        self.stats = torch.zeros((workers, storage_stats.WIDTH), dtype=torch.float64).share_memory_()
        self._flat = self.block.numpy()
        self._stamps = self.stamps.numpy()
        self._views: dict[tuple[int, int], dict[str, numpy.ndarray]] = {}

    def begin(self, worker: int, slot: int, sequence: int) -> None:
        """The worker is about to write ``sequence`` (a bundle's first batch number) into the slot."""
        self._stamps[worker, slot, 0] = sequence

    def end(self, worker: int, slot: int, sequence: int) -> None:
        """The worker has written all of ``sequence`` into the slot."""
        self._stamps[worker, slot, 1] = sequence

    def check(self, worker: int, slot: int, sequence: int) -> None:
        """After the trainer copied the slot out: it held all of ``sequence`` and nothing else began."""
        begin, end = (int(x) for x in self._stamps[worker, slot])
        if begin != sequence or end != sequence:
            raise StatefulsetError(
                f"batch ring: slot {slot} of DataLoader worker {worker} holds stamps begin={begin}, end={end} "
                f"after the trainer copied micro-batch {sequence} out of it (expected {sequence} for both): "
                f"the worker refilled the slot during the copy, so torch {torch.__version__} prefetches more "
                "than the ring was sized for (statefulset.loading.torch_internals)"
            )

    def view(self, worker: int, slot: int) -> dict[str, numpy.ndarray]:
        """Slot ``slot`` of ``worker``: each field as ``[bundle, batch_size, *shape]`` of its dtype."""
        found = self._views.get((worker, slot))
        if found is None:
            base = (worker * self.slots + slot) * self.slot_bytes
            found = {}
            for field, at in zip(self.fields, self._offsets, strict=True):
                size = self.bundle * self.batch_size * _row_bytes(field)
                found[field.name] = (
                    self._flat[base + at : base + at + size]
                    .view(field.dtype)
                    .reshape(self.bundle, self.batch_size, *field.shape)
                )
            self._views[(worker, slot)] = found
        return found

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_flat", "_stamps", "_views")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._flat = self.block.numpy()
        self._stamps = self.stamps.numpy()
        self._views = {}
