"""``StatefulsetDataModule``: the loaders as a Lightning ``LightningDataModule`` (NeMo 2, BioNeMo, plain Lightning).

What it does that a hand-written data module gets wrong:

* **One restore, not two.** The training loader's state lives in the data module's checkpoint
  entry only. The object Lightning iterates looks *stateful* to Lightning (so it does not warn
  that mid-epoch resumes are unreliable) but its ``state_dict`` is a marker and its
  ``load_state_dict`` does nothing: Lightning's own loader restore can never advance the stream a
  second time on top of ours (the double count of NeMo #11481).
* **A length that does not shrink.** ``len()`` of the training loader is one nominal pass over the
  stream (rounded down to whole optimizer steps) before and after a resume. Lightning adds the
  batches already done in the epoch itself; a length that shrank with the consumed samples (NeMo
  #10007) would end the resumed epoch early. The stream repeats, so a Lightning epoch is just a
  window of it and ``max_steps`` is always reached.
* **Exact, not arithmetic.** The checkpoint holds every DP rank's loader state (what was handed
  to the trainer, not what the optimizer stepped over), plus BioNeMo's ``consumed_samples``
  computed from ``global_step - init_global_step``. A restore uses the exact states; the integer
  is used only when a checkpoint has nothing else (one written by NeMo / BioNeMo), and then
  resumes Megatron-style at that global position.
* **Validation never resumes.** Validation and test loaders are plain one-pass loaders: every
  pass starts at the first sample and a restore never touches them (NeMo's ``WrappedDataLoader``
  defaults to ``mode="train"``, so an unlabelled validation loader there silently resumes).

Lightning is an optional dependency (``pip install statefulset[lightning]``): importing this
module imports ``lightning.pytorch`` (or the older ``pytorch_lightning``) and raises
``StatefulsetError`` when neither is installed.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from statefulset.errors import StatefulsetError, check_int
from statefulset.integrations.lightning.checkpoint import (
    FORMAT,
    VERSION,
    gather_loader_states,
    module_state,
    read_module_state,
)
from statefulset.integrations.lightning.stage_loaders import StageLoader, TrainStageLoader
from statefulset.loading.datasets import get_train_dataset, get_val_dataset
from statefulset.loading.loader import Loader, SavableLoader, get_loader, get_savable_loader
from statefulset.loading.worker_config import WorkerConfig
from statefulset.spec.model import DatasetSpec, load_spec


def _import_lightning() -> Any:
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl
        except ImportError:
            raise StatefulsetError(
                "StatefulsetDataModule needs Lightning: pip install statefulset[lightning] "
                "(neither lightning.pytorch nor pytorch_lightning is importable)"
            ) from None
    return pl


pl = _import_lightning()

_LOADER_OPTIONS = {
    "prefetch_factor", "pin_memory", "persistent_workers", "multiprocessing_context", "timeout", "stall_seconds"
}  # fmt: skip
# Only the savable training loader runs collectives (see SavableLoader).
_TRAIN_LOADER_OPTIONS = {"collective_timeout", "allow_changed_task_encoder"}


class StatefulsetDataModule(pl.LightningDataModule):
    """Training, validation and test loaders of one dataset spec, with exact mid-stream resume.

    Args:
        spec: the YAML spec (path), the same mapping, or a ``DatasetSpec``; checked here, so a bad
            spec fails when the module is built, not on the first step.
        micro_batch_size: samples per micro-batch on each DP rank (the loaders' ``batch_size``).
        global_batch_size: samples per optimizer step over all DP ranks; it must be a multiple of
            ``micro_batch_size * dp_size``. ``None``: ``micro_batch_size * dp_size *
            trainer.accumulate_grad_batches``. Only the ``consumed_samples`` arithmetic and the
            rounding of the epoch length to whole steps use it; the loader states are exact anyway.
        num_workers: worker processes per loader (no effect on which samples a rank sees).
        limit_val_batches: cap on micro-batches per validation / test pass and rank (Lightning's
            ``limit_val_batches`` works too).
        dp_rank, dp_size: this process's data-parallel coordinates; both or neither. When not given
            they come from the trainer's strategy (``distributed_sampler_kwargs``, which is the DP
            rank/size for DDP, FSDP and NeMo's MegatronStrategy), else from torch.distributed, else 0 of 1.
        data_parallel_group: the DP process group, when it is not the whole world (TP / PP / CP):
            ``state_dict()`` gathers the loader states over it. ``None`` with a DP size smaller than
            the world tries megatron-core's ``parallel_state``.
        seed_offset: ``WorkerConfig.seed_offset`` (worker seeds for user transforms only).
        log_metrics_every_n_steps: every that many optimizer steps, the training loader's
            ``metrics()`` go to the trainer's loggers under ``data/`` (docs/observability.md); None: never.
        loader_options: ``prefetch_factor``, ``pin_memory``, ``persistent_workers``,
            ``multiprocessing_context``, ``timeout``, ``stall_seconds`` for every loader; ``collective_timeout`` for the
            training loader (how long ``state_dict()`` waits for every DP rank, default 300 s).
    """

    def __init__(
        self,
        spec: str | os.PathLike[str] | Mapping[str, Any] | DatasetSpec,
        *,
        micro_batch_size: int,
        global_batch_size: int | None = None,
        num_workers: int = 2,
        limit_val_batches: int | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        data_parallel_group: Any = None,
        seed_offset: int = 0,
        task_encoder: Any = None,
        log_metrics_every_n_steps: int | None = None,
        **loader_options: Any,
    ) -> None:
        super().__init__()
        self.task_encoder = task_encoder  # run by every loader's workers (docs/transforms.md)
        self.spec = spec if isinstance(spec, DatasetSpec) else load_spec(spec)
        where = "StatefulsetDataModule"
        self.micro_batch_size = check_int("micro_batch_size", micro_batch_size, 1, where)
        self._global_batch_size = check_int("global_batch_size", global_batch_size, 1, where, none_ok=True)
        self.num_workers = check_int("num_workers", num_workers, 0, where)
        self.limit_val_batches = check_int("limit_val_batches", limit_val_batches, 0, where, none_ok=True)
        self.seed_offset = check_int("seed_offset", seed_offset, 0, where)
        self.log_metrics_every_n_steps = check_int(
            "log_metrics_every_n_steps", log_metrics_every_n_steps, 1, where, none_ok=True
        )
        self._metrics_logged_at: int | None = None
        if (dp_rank is None) != (dp_size is None):
            raise StatefulsetError("StatefulsetDataModule: give both dp_rank and dp_size, or neither")
        if dp_size is not None:
            check_int("dp_size", dp_size, 1, where)
            check_int("dp_rank", dp_rank, 0, where)
            if dp_rank >= dp_size:
                raise StatefulsetError(f"StatefulsetDataModule: dp_rank {dp_rank} is outside dp_size {dp_size}")
        self._explicit_dp = (dp_rank, dp_size) if dp_size is not None else None
        self.data_parallel_group = data_parallel_group
        unknown = sorted(set(loader_options) - _LOADER_OPTIONS - _TRAIN_LOADER_OPTIONS)
        if unknown:
            raise StatefulsetError(
                f"StatefulsetDataModule: unknown keyword argument(s) {', '.join(unknown)}; loader options are "
                f"{', '.join(sorted(_LOADER_OPTIONS | _TRAIN_LOADER_OPTIONS))}"
            )
        self.loader_options = loader_options
        # BioNeMo / NeMo bookkeeping: consumed_samples = init_consumed_samples + (global_step -
        # init_global_step) * global_batch_size. None: take the trainer's step at the next update.
        self.init_global_step: int | None = 0
        self.init_consumed_samples = 0
        self._train_loader: SavableLoader | None = None
        self._eval_loaders: dict[str, Loader] = {}
        self._pending: tuple[str, Any] | None = None  # a restore waiting for the training loader
        self._handed_out: weakref.WeakSet[StageLoader] = weakref.WeakSet()

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (``ddp_spawn`` sends the data module to its processes): loaders travel as their state."""
        state = dict(self.__dict__)
        if self._train_loader is not None:
            state["_pending"] = ("rank", self._train_loader.save_state_rank())
        state.update(_train_loader=None, _eval_loaders={}, _handed_out=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._handed_out = weakref.WeakSet()

    # -- who we are ------------------------------------------------------------------------------
    def _trainer(self) -> Any:
        return getattr(self, "trainer", None)

    def data_parallel(self) -> tuple[int, int]:
        """``(dp_rank, dp_size)``: explicit, else the strategy's sampler coordinates, else torch.distributed."""
        if self._explicit_dp is not None:
            return self._explicit_dp
        trainer = self._trainer()
        if trainer is not None:
            kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
            if kwargs:
                return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1))
        if dist.is_available() and dist.is_initialized():
            group = self.data_parallel_group
            return dist.get_rank(group), dist.get_world_size(group)
        return 0, 1

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all DP ranks (see the class docstring)."""
        _, dp_size = self.data_parallel()
        per_step = self.micro_batch_size * dp_size
        if self._global_batch_size is None:
            trainer = self._trainer()
            accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1) if trainer is not None else 1
            return per_step * accumulate
        if self._global_batch_size % per_step:
            raise StatefulsetError(
                f"StatefulsetDataModule: global_batch_size {self._global_batch_size} is not a multiple of "
                f"micro_batch_size {self.micro_batch_size} x dp_size {dp_size}"
            )
        return self._global_batch_size

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank and optimizer step (Lightning's ``accumulate_grad_batches``)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel()[1])

    def _worker_config(self) -> WorkerConfig:
        rank, size = self.data_parallel()
        return WorkerConfig(
            rank=rank,
            world_size=size,
            num_workers=self.num_workers,
            data_parallel_group=self.data_parallel_group,
            seed_offset=self.seed_offset,
        )

    # -- BioNeMo's global-step bookkeeping -------------------------------------------------------
    def _global_step(self) -> int:
        trainer = self._trainer()
        return int(trainer.global_step) if trainer is not None else (self.init_global_step or 0)

    def compute_consumed_samples(self, steps_since_resume: int) -> int:
        """NeMo's ``MegatronDataSampler.compute_consumed_samples``: samples stepped over since the start."""
        return self.init_consumed_samples + steps_since_resume * self.global_batch_size

    def update_init_global_step(self) -> None:
        """Make the trainer's current step the origin of the step arithmetic (BioNeMo: whenever loaders are made).

        Steps done since the previous origin are folded into ``init_consumed_samples`` first, so
        making loaders again (``reload_dataloaders_every_n_epochs``, a second ``fit``) loses nothing.
        """
        step = self._global_step()
        if self.init_global_step is not None:
            self.init_consumed_samples = self.compute_consumed_samples(step - self.init_global_step)
        self.init_global_step = step

    @property
    def consumed_samples(self) -> int:
        """BioNeMo's number: samples the optimizer has stepped over, from ``global_step - init_global_step``."""
        if self.init_global_step is None:
            return self.init_consumed_samples
        return self.compute_consumed_samples(self._global_step() - self.init_global_step)

    # -- metrics (docs/observability.md) -----------------------------------------------------------
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Lightning's hook, once per training batch: log the loader's metrics every n steps."""
        trainer, every = self._trainer(), self.log_metrics_every_n_steps
        if every is None or trainer is None or not trainer.training or self._train_loader is None:
            return batch
        step = int(trainer.global_step)
        if step % every == 0 and step != self._metrics_logged_at:  # once per step, whatever the accumulation
            self._metrics_logged_at = step
            values = {"data/" + k: v for k, v in self._train_loader.metrics().items()}
            for logger in trainer.loggers:
                logger.log_metrics(values, step=step)
        return batch

    # -- loaders ---------------------------------------------------------------------------------
    @property
    def train_loader(self) -> SavableLoader | None:
        """The savable training loader underneath, once ``train_dataloader()`` has made it."""
        return self._train_loader

    def _new_train_loader(self) -> SavableLoader:
        wc, encoder = self._worker_config(), self.task_encoder
        dataset = get_train_dataset(self.spec, batch_size=self.micro_batch_size, worker_config=wc, task_encoder=encoder)
        return get_savable_loader(dataset, **self.loader_options)

    def _continue_train_loader(self, old: SavableLoader) -> SavableLoader:
        loader = self._new_train_loader()
        loader.restore_state_rank(old.save_state_rank())
        if self._train_loader is old:
            self._train_loader = loader
        return loader

    def train_dataloader(self) -> TrainStageLoader:
        """The training loader: resumes mid-stream from a restored state, or continues the previous one."""
        self.update_init_global_step()
        if self._train_loader is not None:
            # Made again (reload_dataloaders_every_n_epochs, another fit): continue, never restart.
            loader = self._continue_train_loader(self._train_loader)
        else:
            loader = self._new_train_loader()
            if self._pending is not None:
                kind, value = self._pending
                if kind == "states":
                    loader.restore_state_global(value)
                elif kind == "rank":
                    loader.restore_state_rank(value)
                else:
                    loader.restore_consumed_samples(value)
        self._pending = None
        self._train_loader = loader
        steps = self.num_micro_batches
        # Whole optimizer steps per Lightning epoch: Lightning flushes a partial accumulation at the
        # end of an epoch, which would break the global-step arithmetic.
        length = max(steps, len(loader) // steps * steps)
        stage = TrainStageLoader(loader, "train", length, self._continue_train_loader)
        self._handed_out.add(stage)
        return stage

    def _new_eval_loader(self, split: str) -> Loader:
        dataset = get_val_dataset(
            self.spec,
            split_part=split,
            batch_size=self.micro_batch_size,
            worker_config=self._worker_config(),
            limit=self.limit_val_batches,
            task_encoder=self.task_encoder,
        )
        options = {k: v for k, v in self.loader_options.items() if k in _LOADER_OPTIONS}
        self._eval_loaders[split] = get_loader(dataset, **options)
        return self._eval_loaders[split]

    def _eval_loader(self, split: str, mode: str) -> StageLoader:
        loader = self._eval_loaders[split] if split in self._eval_loaders else self._new_eval_loader(split)
        stage = StageLoader(loader, mode, len(loader), lambda old: self._new_eval_loader(split))
        self._handed_out.add(stage)
        return stage

    def val_dataloader(self) -> StageLoader:
        """One pass over the validation split from its first sample, every time (never resumed)."""
        self.update_init_global_step()
        return self._eval_loader("val", "validation")

    def test_dataloader(self) -> StageLoader:
        """One pass over the test split from its first sample, every time (never resumed)."""
        return self._eval_loader("test", "test")

    def teardown(self, stage: str) -> None:
        """Stop every loader's worker processes when Lightning finishes a stage; positions are kept.

        Another ``fit`` on the same trainer iterates the same loaders again: the training stream
        continues where it stopped and evaluation passes start at the beginning, as always.
        """
        for handed_out in list(self._handed_out):
            handed_out.release_workers()

    # -- checkpoint ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every DP rank's loader state plus BioNeMo's ``consumed_samples``; plain data.

        A collective over the DP group once the training loader exists (every rank gets the whole
        list, so whichever rank writes the checkpoint writes all of it): call it on every rank,
        as ``trainer.save_checkpoint`` and ``ModelCheckpoint`` do.
        """
        if self._train_loader is not None:
            dp_rank, dp_size = self.data_parallel()
            states: list[dict[str, Any]] | None = gather_loader_states(
                self._train_loader, dp_rank, dp_size, self.data_parallel_group
            )
        elif self._pending is not None and self._pending[0] == "states":
            states = self._pending[1]  # restored, not yet iterated: hand the same states on
        else:
            states = None
        return module_state(self.consumed_samples, self._global_step(), states)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore before the training loader is made (Lightning does so when resuming with ``ckpt_path``).

        Takes this module's ``state_dict()`` (exact, also into another DP size, micro-batch size or
        worker count) or a NeMo / BioNeMo data module's ``{"consumed_samples": n}`` (resumes at
        global position ``n``, Megatron-style).
        """
        if not isinstance(state_dict, dict):
            raise StatefulsetError(
                f"StatefulsetDataModule.load_state_dict: expected a dict, got {type(state_dict).__name__}"
            )
        if self._train_loader is not None and self._train_loader.batches_taken:
            raise StatefulsetError(
                "StatefulsetDataModule.load_state_dict: the training loader has already handed out batches; "
                "restore into a fresh data module"
            )
        consumed, states = read_module_state(state_dict)
        if states is not None:
            self._pending = ("states", states)
        else:
            self._pending = ("consumed", consumed)
        self.init_consumed_samples = consumed
        # The restored consumed_samples belong to whatever step the trainer resumes at (the saved
        # one under ckpt_path, 0 in a fresh trainer): the next update adopts it without adding steps.
        self.init_global_step = None
        self._train_loader = None  # made, never iterated: make it again from the restored state


__all__ = ["FORMAT", "VERSION", "StageLoader", "StatefulsetDataModule", "TrainStageLoader"]
