"""One pass of a ``torch.utils.data.DataLoader`` over a rank's micro-batches: in order, watched.

The loaders (:mod:`statefulset.loading.loader`) hand out what a ``Delivery`` yields. It builds the
DataLoader over a :class:`~statefulset.loading.batches.BatchSource`, waits for each worker hand-off
under the watchdog (:mod:`statefulset.loading.watchdog`), starts forked workers again that never
started (:mod:`statefulset.loading.worker_start`), and widens or pins the batches it receives.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from statefulset.errors import StatefulsetError
from statefulset.index.native.keys import derive_key
from statefulset.loading import torch_internals
from statefulset.loading.batches import BatchRing, BatchSource, bundle_size, describe_batch, receive
from statefulset.loading.datasets import StreamDataset
from statefulset.loading.state import Cursor
from statefulset.loading.watchdog import TimedOut, Watchdog
from statefulset.loading.worker_start import POLL_SECONDS, StartWatch, stop_workers


def _identity(item: Any) -> Any:
    return item  # batches are (worker, slot, t) notes or ready tensors: nothing to collate


def _data_loader(dataset: StreamDataset, cursor: Cursor, options: dict[str, Any]) -> tuple[DataLoader, BatchSource]:
    stream = dataset.stream
    wrap = None if stream.unbounded or not dataset.repeat else len(stream)
    workers = dataset.worker_config.num_workers
    ring = None
    if workers:
        slots = options["prefetch_factor"] + 1  # see statefulset.loading.batches
        fields = dataset.fields()
        ring = BatchRing(workers, slots, dataset.batch_size, fields, bundle_size(dataset.batch_size, fields))
    source = BatchSource(stream, cursor, dataset.stop_batch(cursor), wrap, ring, dataset.document_boundaries)
    # Worker seeds come from our own generator: creating the iterator never draws from (or
    # reseeds) the trainer's global torch RNG.
    seed = derive_key(stream.spec.seed, dataset.worker_config.seed_offset, dataset.worker_config.rank) >> 1
    loader = DataLoader(
        source,
        batch_size=None,
        collate_fn=_identity,
        num_workers=workers,
        prefetch_factor=options["prefetch_factor"] if workers else None,
        persistent_workers=options["persistent_workers"] and workers > 0,
        multiprocessing_context=options["multiprocessing_context"] if workers else None,
        generator=torch.Generator().manual_seed(seed),
    )
    return loader, source


class Delivery:
    """One pass of a DataLoader: batches in order, watched, widened, pinned if asked."""

    def __init__(self, dataset: StreamDataset, cursor: Cursor, options: dict[str, Any]) -> None:
        self.dataset, self.options = dataset, options
        self.workers = dataset.worker_config.num_workers
        self.watchdog: Watchdog = options["watchdog"]
        self.timeout = options["timeout"]
        self.pin = options["pin_memory"] and torch.cuda.is_available()
        self.next_t = cursor.batches
        self.first = True
        self.ready: list[dict[str, torch.Tensor]] = []  # the rest of a worker's bundle, last first
        self.start_watch = StartWatch(options["multiprocessing_context"]) if self.workers else None
        self._start(cursor)

    def _start(self, cursor: Cursor) -> None:
        self.loader, self.source = _data_loader(self.dataset, cursor, self.options)
        self.iterator = iter(self.loader)
        if self.start_watch is not None:
            torch_internals.check_iterator(self.iterator)
            self.start_watch.watch(self.source.ring.started)

    def _get(self, period: float | None) -> Any:
        if not self.workers:
            return next(self.iterator)
        if self.start_watch is None or not self.start_watch.pending():
            return self._wait(period)
        # Until every worker has started, wait in steps of a second and look for stuck ones.
        waited = 0.0
        while True:
            step = POLL_SECONDS if period is None else min(POLL_SECONDS, max(period - waited, 1e-3))
            try:
                return self._wait(step)
            except TimedOut:
                waited += step
            stuck = self.start_watch.unstarted(self.iterator)
            if stuck:
                stop_workers(self.iterator, stuck)
                self.start_watch.restarted(stuck, self.next_t)
                c = self.source.cursor  # the same batches again, from the first one not delivered
                self._start(Cursor(c.base, self.next_t, c.dp_rank, c.dp_size, c.batch_size))
            if period is not None and waited >= period:
                raise TimedOut
            if self.timeout and waited >= self.timeout:
                raise StatefulsetError(
                    f"{describe_batch(self.source, self.next_t, self.workers)}: "
                    f"DataLoader timed out after {self.timeout} seconds"
                )

    def _wait(self, period: float | None) -> Any:
        """The next item within ``period`` seconds (None: no bound), or TimedOut."""
        # DataLoader reads its timeout for each batch; a timed-out wait leaves the iterator intact.
        limits = [x for x in (period, self.timeout or None) if x]
        torch_internals.set_wait_timeout(self.iterator, min(limits) if limits else 0)
        try:
            return next(self.iterator)
        except RuntimeError as exc:
            text = str(exc)
            if "timed out" in text and period is not None and (not self.timeout or period < self.timeout):
                raise TimedOut from None
            if "exited unexpectedly" in text or "timed out" in text:
                raise StatefulsetError(f"{describe_batch(self.source, self.next_t, self.workers)}: {text}") from exc
            raise

    def __next__(self) -> dict[str, torch.Tensor]:
        if not self.ready:
            item = self.watchdog.wait(
                self._get, self.first, lambda: describe_batch(self.source, self.next_t, self.workers)
            )
            self.ready = receive(self.source, item, self.next_t)
            self.ready.reverse()
        batch = self.ready.pop()
        self.next_t += 1
        self.first = False
        if self.pin:
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return batch

    def __iter__(self) -> Delivery:
        return self
