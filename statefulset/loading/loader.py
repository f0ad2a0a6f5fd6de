"""``get_savable_loader`` / ``get_loader``: micro-batches from worker processes, in order, savable at any step.

Worker ``w`` of ``N`` builds batches ``t ≡ w (mod N)`` of this rank's layout, each with one
batched ``stream.gather`` into a shared-memory ring (:mod:`statefulset.loading.batches`);
``torch.utils.data.DataLoader`` delivers them round-robin, which is batch order, under a
watchdog (:mod:`statefulset.loading.delivery`). The main process counts the batches it hands
to the trainer, so a save is that count plus the layout (:mod:`statefulset.loading.state`): it
never counts prefetched batches, never asks a worker anything, and a restore is a seek (no
replay), whatever the step.
"""

from __future__ import annotations

import logging
from typing import Any

from statefulset.errors import StatefulsetError, check_int
from statefulset.loading.datasets import StreamDataset
from statefulset.loading.delivery import Delivery
from statefulset.loading.encoder_state import check_encoder, with_encoder
from statefulset.loading.metrics import Meter, log_metrics, rank_metrics
from statefulset.loading.metrics import across_ranks as gather_waits
from statefulset.loading.state import Cursor, fit_global_state, fit_rank_state, make_state
from statefulset.loading.state_exchange import check_source, gather_states, in_group, receive_cursor
from statefulset.loading.watchdog import STALL_SECONDS, Watchdog
from statefulset.loading.worker_config import WorkerConfig
from statefulset.parallel.arrival import DEFAULT_TIMEOUT, check_timeout

_log = logging.getLogger("statefulset")


def _options(
    prefetch_factor: int = 2,
    pin_memory: bool = False,
    persistent_workers: bool = True,
    multiprocessing_context: Any = None,
    timeout: float = 0,
    watchdog: Watchdog | None = None,
) -> dict[str, Any]:
    if isinstance(prefetch_factor, bool) or not isinstance(prefetch_factor, int) or prefetch_factor < 1:
        raise StatefulsetError(f"prefetch_factor must be a positive int, got {prefetch_factor!r}")
    return {
        "prefetch_factor": prefetch_factor,
        "pin_memory": bool(pin_memory),
        "persistent_workers": bool(persistent_workers),
        "multiprocessing_context": multiprocessing_context,
        "timeout": timeout,
        "watchdog": watchdog or Watchdog(None),
        "meter": Meter(),
    }


class Loader:
    """A non-savable loader (validation): every ``iter()`` is a fresh pass from the start.

    With workers and ``persistent_workers=True`` (the default) every pass runs on the same
    DataLoader, so the workers forked for the first pass serve the later ones too. One pass at a
    time: a new ``iter()`` ends the one before (its iterator then raises if asked for more).
    """

    def __init__(self, dataset: StreamDataset, **options: Any) -> None:
        self.dataset = dataset
        self.worker_config = dataset.worker_config
        self._options = _options(**options)
        self._last: Delivery | None = None

    def __iter__(self) -> Delivery:
        last, reuse = self._last, None
        if last is not None and last.workers and self._options["persistent_workers"]:
            last.superseded = True
            if not last.restarted:  # a pass that started its workers again began mid-way: not reusable
                reuse = (last.loader, last.source, last.iterator)
        self._last = Delivery(self.dataset, self.dataset.layout(), self._options, reuse)
        return self._last

    def __len__(self) -> int:
        return len(self.dataset)

    def metrics(self) -> dict[str, float]:
        """This loader's counters over all its passes (docs/observability.md); no source shares (one pass)."""
        return rank_metrics(self._options["meter"], self.dataset, None)


class SavableLoader:
    """Megatron-Energon's ``SavableDataLoader`` surface over a deterministic stream.

    One persistent iterator: a second ``for`` loop continues where the first stopped.
    ``collective_timeout``: seconds :meth:`save_state_global` / :meth:`restore_state_global` wait
    for every DP rank to call them before raising a ``StatefulsetError`` that names the missing
    ranks (default 300; None waits as long as the process group does).
    """

    def __init__(
        self,
        dataset: StreamDataset,
        collective_timeout: float | None = DEFAULT_TIMEOUT,
        allow_changed_task_encoder: bool = False,
        **options: Any,
    ) -> None:
        if not isinstance(allow_changed_task_encoder, bool):
            raise StatefulsetError(
                f"allow_changed_task_encoder must be True or False, got {allow_changed_task_encoder!r}"
            )
        self.dataset = dataset
        self.allow_changed_task_encoder = allow_changed_task_encoder
        self.worker_config = dataset.worker_config
        self.collective_timeout = check_timeout(collective_timeout, "collective_timeout")
        self._options = _options(**options)
        self._cursor = dataset.layout()
        self._taken = 0  # batches handed to the trainer since the cursor's batch
        self._iterator: Any = None

    # -- iteration ------------------------------------------------------------------------------
    def __iter__(self) -> SavableLoader:
        if self._iterator is None:
            self._iterator = Delivery(self.dataset, self._cursor, self._options)
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            iter(self)
        batch = next(self._iterator)
        self._taken += 1
        return batch

    def __len__(self) -> int:
        return len(self.dataset)

    # -- metrics (docs/observability.md) ----------------------------------------------------------
    def metrics(self, across_ranks: bool = False) -> dict[str, float]:
        """This rank's metrics as a flat ``dict[str, float]``; microseconds to read.

        ``across_ranks=True`` is a collective over the DP group (bounded by ``collective_timeout``)
        adding ``data_wait_seconds/max|min|mean|max_rank``.
        """
        c = self._cursor  # the place (consumed_samples), without building a Cursor
        values = self._options["meter"].read(
            self.dataset, c.base + (c.batches + self._taken) * c.dp_size * c.batch_size
        )
        if across_ranks:
            return gather_waits(values, self.worker_config, self.collective_timeout)
        return values

    def log_metrics(self, writer: Any, step: int, across_ranks: bool = False, prefix: str = "data/") -> None:
        """``writer.add_scalar(prefix + name, value, step)`` for every metric (a SummaryWriter-like object)."""
        log_metrics(self.metrics(across_ranks), writer, step, prefix)

    @property
    def batches_taken(self) -> int:
        """Micro-batches this rank has handed out since the start of the stream layout it runs in."""
        return self._cursor.batches + self._taken

    def _position(self) -> Cursor:
        c = self._cursor
        return Cursor(c.base, c.batches + self._taken, c.dp_rank, c.dp_size, c.batch_size)

    # -- rank state -----------------------------------------------------------------------------
    def save_state_rank(self) -> dict[str, Any]:
        """This rank's state: plain data, a few hundred bytes; safe to call at any step."""
        identity = with_encoder(self.dataset.stream.identity, self._encoder())
        return make_state(identity, self._position(), self.worker_config.num_workers)

    def _encoder(self) -> str | None:
        return None if self.dataset.encoder is None else self.dataset.encoder.identity

    def check_task_encoder(self, states: Any, where: str) -> None:
        """Refuse a state (or list of states) saved with another task encoder, naming both; with
        ``allow_changed_task_encoder=True`` log it at WARNING instead (docs/transforms.md)."""
        check_encoder(states, self._encoder(), self.allow_changed_task_encoder, where)

    def _restore(self, cursor: Cursor) -> None:
        if self._iterator is not None:
            raise StatefulsetError(
                "restore_state_*: this loader has started iterating; restore into a fresh loader before iterating"
            )
        self._cursor = cursor
        self._taken = 0

    def restore_state_rank(self, state: dict[str, Any] | None) -> None:
        """Continue exactly after the last batch the saving loader handed out.

        ``None`` means no state (Energon's meaning): a fresh start from sample 0, logged at WARNING
        with the rank, since a checkpoint that lost its loader state would otherwise retrain silently.
        """
        wc, stream = self.worker_config, self.dataset.stream
        if state is None:
            _log.warning(
                "restore_state_rank(None) on DP rank %d: no loader state, so this rank starts from sample 0 "
                "(the first batch of the stream)",
                wc.rank,
            )
            return
        self.check_task_encoder(state, f"state for DP rank {wc.rank}")
        self._restore(
            fit_rank_state(
                state,
                stream.identity,
                wc.rank,
                wc.world_size,
                self.dataset.batch_size,
                stream.source_prefixes,
                stream.legacy_data,
            )
        )

    # -- Megatron / Nanotron bookkeeping --------------------------------------------------------
    @property
    def consumed_samples(self) -> int:
        """First global position no rank has taken, when every DP rank took as many batches as this one.

        This is Megatron-LM's and Nanotron's ``consumed_train_samples`` after as many micro-batches.
        """
        return self._position().consumed

    def restore_consumed_samples(self, consumed_samples: int) -> None:
        """Start at global position ``consumed_samples``: Megatron's and Nanotron's resume from one integer.

        Any DP size, batch size or worker count may resume from it, since it names the first
        sample of the stream that no rank has trained on.
        """
        base = check_int("consumed_samples", consumed_samples, 0, "restore_consumed_samples", high=2**62 - 1)
        self._restore(self.dataset.layout(base=base))

    # -- global state (the collectives: statefulset.loading.state_exchange) ----------------------
    def save_state_global(self, global_dst_rank: int = 0) -> list[dict[str, Any]] | None:
        """Collective over the DP group: the list of every DP rank's state on ``global_dst_rank``, None elsewhere."""
        return gather_states(self.save_state_rank(), self.worker_config, global_dst_rank, self.collective_timeout)

    def restore_state_global(self, state: list[dict[str, Any]] | None, src_rank: int | None = None) -> None:
        """Restore from every DP rank's states, also into another DP size, batch size or worker count.

        ``src_rank=None``: every rank passes the whole list. Otherwise DP rank ``src_rank`` (within the
        group) passes it and the others pass None; it is checked there, and each rank receives only its
        own cursor (one scatter of a fixed slot: see statefulset.parallel.exchange).
        """
        wc = self.worker_config
        if src_rank is not None:
            check_source(state, wc, src_rank)
            if in_group(wc):
                self._restore(
                    receive_cursor(state, src_rank, self.dataset, self.collective_timeout, self.check_task_encoder)
                )
                return
        if state is None:
            raise StatefulsetError(f"restore_state_global: DP rank {wc.rank} received no state")
        self.check_task_encoder(state, "global state")
        stream = self.dataset.stream
        self._restore(
            fit_global_state(
                state,
                stream.identity,
                wc.rank,
                wc.world_size,
                self.dataset.batch_size,
                stream.source_prefixes,
                stream.legacy_data,
            )
        )

    # -- torch.distributed.checkpoint (Stateful) ------------------------------------------------
    def _key(self) -> str:
        return f"dp_rank_{self.worker_config.rank}"

    def state_dict(self) -> dict[str, Any]:
        """Per-DP-rank key: DCP keeps one copy of each non-tensor key, so a shared key would keep rank 0's."""
        return {"version": 1, "dp_world_size": self.worker_config.world_size, self._key(): self.save_state_rank()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if not isinstance(state_dict, dict) or state_dict.get("version") != 1:
            raise StatefulsetError("load_state_dict: not a statefulset loader state_dict (version 1)")
        saved = state_dict.get("dp_world_size")
        if saved != self.worker_config.world_size:
            raise StatefulsetError(
                f"load_state_dict: saved with data-parallel size {saved}, this loader has "
                f"{self.worker_config.world_size}; a changed DP size restores through save_state_global / "
                "restore_state_global (all ranks' states are needed)"
            )
        if self._key() not in state_dict:
            raise StatefulsetError(f"load_state_dict: key '{self._key()}' is missing")
        self.restore_state_rank(state_dict[self._key()])

    def __repr__(self) -> str:
        return f"SavableLoader({self.dataset!r}, batches_taken={self.batches_taken})"


def _check_config(dataset: StreamDataset, worker_config: WorkerConfig | None) -> None:
    if not isinstance(dataset, StreamDataset):
        raise StatefulsetError(
            f"expected a dataset from get_train_dataset/get_val_dataset, got {type(dataset).__name__}"
        )
    if worker_config is not None and worker_config != dataset.worker_config:
        raise StatefulsetError("worker_config differs from the one the dataset was built with")


def get_savable_loader(
    dataset: StreamDataset,
    *,
    worker_config: WorkerConfig | None = None,
    checkpoint_every_sec: float = 60,
    checkpoint_every_min_n_samples: int | None = None,
    n_checkpoints: int | None = None,
    gc_collect_every_n_steps: int = 10,
    prefetch_factor: int = 2,
    cache_pool: Any = None,
    watchdog_timeout_seconds: float | None = 60,
    watchdog_initial_timeout_seconds: float | None = None,
    fail_on_timeout: bool = False,
    pin_memory: bool = False,
    persistent_workers: bool = True,
    multiprocessing_context: Any = None,
    timeout: float = 0,
    collective_timeout: float | None = DEFAULT_TIMEOUT,
    allow_changed_task_encoder: bool = False,
    stall_seconds: float | None = STALL_SECONDS,
) -> SavableLoader:
    """A loader whose state saves and restores exactly (Energon's signature).

    The watchdog keywords are Energon's (:mod:`statefulset.loading.watchdog`): after
    ``watchdog_timeout_seconds`` (default 60) without a batch, a warning names the worker, the
    micro-batch and the files; ``fail_on_timeout=True`` raises instead; after 10 periods it always
    raises. The checkpoint_* / n_checkpoints / gc keywords exist because Energon replays from
    periodic worker snapshots; a state here is a cursor, so they have nothing to tune.
    ``collective_timeout`` bounds the wait of ``save_state_global`` / ``restore_state_global`` for
    the other DP ranks (seconds, default 300; see :class:`SavableLoader`).
    ``allow_changed_task_encoder=True`` restores a state saved with another task encoder (or
    version of it), logged at WARNING, instead of refusing it (docs/transforms.md).
    ``stall_seconds`` (default 10, None: off): one ``next()`` waiting that long logs a WARNING
    naming the worker, micro-batch, positions, files and oldest storage request
    (docs/observability.md); ``loader.metrics()`` reports the data wait.
    """
    _check_config(dataset, worker_config)
    return SavableLoader(
        dataset,
        collective_timeout=collective_timeout,
        allow_changed_task_encoder=allow_changed_task_encoder,
        watchdog=Watchdog(watchdog_timeout_seconds, watchdog_initial_timeout_seconds, fail_on_timeout, stall_seconds),
        prefetch_factor=prefetch_factor,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        multiprocessing_context=multiprocessing_context,
        timeout=timeout,
    )


def get_loader(
    dataset: StreamDataset,
    *,
    worker_config: WorkerConfig | None = None,
    prefetch_factor: int = 2,
    cache_pool: Any = None,
    watchdog_timeout_seconds: float | None = 60,
    watchdog_initial_timeout_seconds: float | None = None,
    fail_on_timeout: bool = False,
    pin_memory: bool = False,
    persistent_workers: bool = True,
    multiprocessing_context: Any = None,
    timeout: float = 0,
    stall_seconds: float | None = STALL_SECONDS,
) -> Loader:
    """A plain loader (validation): not savable, each pass starts at the beginning."""
    _check_config(dataset, worker_config)
    return Loader(
        dataset,
        watchdog=Watchdog(watchdog_timeout_seconds, watchdog_initial_timeout_seconds, fail_on_timeout, stall_seconds),
        prefetch_factor=prefetch_factor,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        multiprocessing_context=multiprocessing_context,
        timeout=timeout,
    )


__all__ = ["Loader", "SavableLoader", "get_loader", "get_savable_loader"]
