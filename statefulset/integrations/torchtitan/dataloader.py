"""A torchtitan (0.3) train dataloader over Megatron bin/idx shards that resumes at another DP size.

torchtitan 0.3's ``Trainer`` builds its loader with::

    config.dataloader.build(dp_world_size=..., dp_rank=..., tokenizer=..., seq_len=...,
                            local_batch_size=..., snapshot_every_n_steps=...)

(``Configurable.Config.build`` forwards these to the owner class) and iterates it for
``({"input": [B, S], "positions": [B, S]}, labels [B, S])``. :class:`StatefulsetDataLoader` is
that owner class: rows of DP rank ``r`` of ``W`` follow the contract's layout (micro-batch ``t``, row ``j`` is global
position ``(t·W + r)·B + j``), ``input`` is ``text[:, :-1]`` and ``labels`` ``text[:, 1:]``, with
torchtitan's ``IGNORE_INDEX`` (-100) where a ``loss_mask`` is 0 (bestfit padding, masked
prompts). ``positions`` (from which torchtitan's Flex/varlen attention builds its masks) restart at
each document with ``document_boundaries``, else count ``0..S-1`` in every row.

``state_dict()`` / ``load_state_dict()`` go through torchtitan's checkpointer (DCP); the layout
is in :mod:`statefulset.integrations.torchtitan.dcp_layout`. A checkpoint restores into another
``dp_world_size``, ``local_batch_size`` or worker count: the stream continues at the first global
position no rank consumed.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader

from statefulset.errors import StatefulsetError, check_int
from statefulset.integrations.torchtitan.dcp_layout import (
    RECORD_KEY,
    WORLD_KEY,
    encode_record,
    gather_record,
    initial_record,
    rank_key,
    record_states,
)
from statefulset.loading.datasets import get_train_dataset
from statefulset.loading.loader import SavableLoader, get_savable_loader
from statefulset.loading.state import encode as encode_state
from statefulset.loading.worker_config import WorkerConfig
from statefulset.spec.model import DatasetSpec, load_spec

__all__ = ["IGNORE_INDEX", "StatefulsetDataLoader"]

IGNORE_INDEX = -100  # torchtitan.components.loss.IGNORE_INDEX: labels the loss skips
_SPEC_FIELDS = ("data_path", "split", "seed", "packing", "num_samples", "path_to_cache")
_TRAINER_KWARGS = frozenset({"snapshot_every_n_steps"})  # the Trainer's, meaningless for a cursor state


class StatefulsetDataLoader(BaseDataLoader):
    """torchtitan's ``BaseDataLoader`` over a statefulset spec: ``StatefulsetDataLoader.Config(...).build(...)``."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = ""
        """The dataset spec (YAML file, docs/yaml.md); or leave it empty and give ``data_path``."""

        data_path: str | None = None
        """Without ``dataset``: one shard prefix, or Megatron's blend ``"w1 prefix1 w2 prefix2 ..."``."""

        split: str | None = None
        """Without ``dataset``: train,valid,test ratios (spec default ``969,30,1``)."""

        seed: int | None = None
        """Without ``dataset``: the spec's seed (default 1234)."""

        packing: str | None = None
        """Without ``dataset``: megatron (default), native or bestfit."""

        num_samples: int | None = None
        """Without ``dataset``: train samples to build (packing megatron; None: one epoch)."""

        path_to_cache: str | None = None
        """Without ``dataset``: where derived indices are kept."""

        num_workers: int = 2
        """Worker processes reading shards (0: in the training process)."""

        prefetch_factor: int = 2
        """Micro-batches each worker prepares ahead."""

        pin_memory: bool = False
        """Pin batches in page-locked memory."""

        document_boundaries: bool = True
        """``positions`` restart at each document of the shard index, as torchtitan's own loaders do (False:
        ``0..S-1`` in every row, Megatron's one causal sequence per sample)."""

        collective_timeout: float = 300.0
        """Seconds a checkpoint save waits for every rank before naming the missing ones."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any = None,
        seq_len: int,
        local_batch_size: int,
        **kwargs: Any,
    ) -> None:
        where = f"StatefulsetDataLoader (DP rank {dp_rank} of {dp_world_size})"
        unknown = sorted(set(kwargs) - _TRAINER_KWARGS)
        if unknown:
            raise StatefulsetError(f"{where}: unknown build() argument(s): {', '.join(unknown)}")
        self.dp_world_size = check_int("dp_world_size", dp_world_size, 1, where)
        self.dp_rank = check_int("dp_rank", dp_rank, 0, where)
        if self.dp_rank >= self.dp_world_size:
            raise StatefulsetError(f"{where}: dp_rank is outside [0, dp_world_size)")
        self.seq_len = check_int("seq_len", seq_len, 2, where)
        self.local_batch_size = check_int("local_batch_size", local_batch_size, 1, where)
        self.tokenizer = tokenizer  # tokens are read pre-tokenised; kept for the trainer's own use
        self.config = config
        self.where = where
        _check_world(self.dp_rank, self.dp_world_size, where)
        self.spec = spec_from_config(config, self.seq_len, where)
        wc = WorkerConfig(
            rank=self.dp_rank,
            world_size=self.dp_world_size,
            num_workers=check_int("num_workers", config.num_workers, 0, where),
        )
        dataset = get_train_dataset(
            self.spec,
            batch_size=self.local_batch_size,
            worker_config=wc,
            document_boundaries=bool(config.document_boundaries),
        )
        self.loader: SavableLoader = get_savable_loader(
            dataset,
            prefetch_factor=check_int("prefetch_factor", config.prefetch_factor, 1, where),
            pin_memory=bool(config.pin_memory),
            collective_timeout=config.collective_timeout,
        )
        self._restored = False

    # -- iteration --------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for batch in self.loader:
            yield trainer_batch(batch, self.config.document_boundaries)

    # -- state ------------------------------------------------------------------------------------
    @property
    def _fresh(self) -> bool:
        """Nothing handed out and nothing restored: the state is the stream's start on every rank."""
        return not self._restored and self.loader.batches_taken == 0

    def state_dict(self) -> dict[str, Any]:
        """The DCP state (dcp_layout): on a loader that has started, a collective over every rank of the job.

        A fresh loader's (which is also what DCP's load asks for) is built without communication.
        """
        state = self.loader.save_state_rank()
        out: dict[str, Any] = {WORLD_KEY: self.dp_world_size}
        if self._fresh:
            out[RECORD_KEY] = initial_record(state, self.dp_world_size)
            return out
        if not _in_a_job():  # one process: DP size 1 (the build checked it)
            out[RECORD_KEY] = encode_record([state], 1)
            return out
        record = gather_record(state, self.dp_world_size, self.loader.collective_timeout)
        if record is not None:
            out[RECORD_KEY] = record
        elif self.dp_rank != 0:
            out[rank_key(self.dp_rank)] = encode_state(state)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue after every batch the saving job consumed, at this DP size, batch size and worker count."""
        where = f"{self.where}: load_state_dict"
        if self._restored or self.loader.batches_taken:
            raise StatefulsetError(f"{where}: this loader has already started; load into a freshly built one")
        states = record_states(state_dict, where)
        try:
            self.loader.restore_state_global(states)
        except StatefulsetError as exc:
            raise StatefulsetError(f"{where}: {exc}") from None
        self._restored = True

    # -- bookkeeping ------------------------------------------------------------------------------
    @property
    def consumed_samples(self) -> int:
        """First global position no rank has taken (all DP ranks in step): Megatron's ``consumed_samples``."""
        return self.loader.consumed_samples

    def metrics(self) -> dict[str, float]:
        """This rank's loader metrics (docs/observability.md)."""
        return self.loader.metrics()

    def __repr__(self) -> str:
        return (
            f"StatefulsetDataLoader({self.spec.source}, dp_rank={self.dp_rank}/{self.dp_world_size}, "
            f"batch={self.local_batch_size}x{self.seq_len}, consumed_samples={self.consumed_samples})"
        )


def _in_a_job() -> bool:
    """More than one process: a save gathers (TP/PP peers of a DP size of 1 are checked against each other too)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _check_world(dp_rank: int, dp_world_size: int, where: str) -> None:
    """A DP size above 1 needs torch.distributed, and global rank 0 must be DP rank 0 (it writes the record)."""
    if dp_world_size == 1:
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise StatefulsetError(f"{where}: dp_world_size > 1 needs torch.distributed, which is not initialised")
    if dist.get_world_size() < dp_world_size:
        raise StatefulsetError(f"{where}: the world has only {dist.get_world_size()} ranks")
    if dist.get_rank() == 0 and dp_rank != 0:
        raise StatefulsetError(f"{where}: global rank 0 must be DP rank 0 (it writes the checkpoint's loader record)")


def spec_from_config(config: StatefulsetDataLoader.Config, seq_len: int, where: str) -> DatasetSpec:
    """The YAML spec ``config.dataset``, or one of the Config's spec keys; its seq_length must be ``seq_len``."""
    given = {key: getattr(config, key) for key in _SPEC_FIELDS if getattr(config, key) is not None}
    if config.dataset_path is not None:
        raise StatefulsetError(
            f"{where}: dataloader.dataset_path is not read by this loader; name the spec with dataloader.dataset "
            "or the shards with dataloader.data_path"
        )
    if config.dataset:
        if given:
            raise StatefulsetError(
                f"{where}: dataloader.{', dataloader.'.join(given)} given beside the spec {config.dataset}; "
                "set those keys in the spec file, or leave dataloader.dataset empty"
            )
        spec = load_spec(config.dataset)
        if spec.seq_length != seq_len:
            raise StatefulsetError(
                f"{where}: training.seq_len {seq_len} differs from the spec's seq_length {spec.seq_length} "
                f"({spec.source}); make them equal"
            )
        return spec
    if "data_path" not in given:
        raise StatefulsetError(f"{where}: set dataloader.dataset (a spec YAML file) or dataloader.data_path")
    given["data_path"] = _blend_words(given["data_path"], where)
    return load_spec({**given, "seq_length": seq_len})


def _blend_words(text: str, where: str) -> str | list[Any]:
    """Megatron's ``--data-path`` words: one prefix, or ``w1 prefix1 w2 prefix2 ...`` (weights as numbers)."""
    words = shlex.split(text)
    if len(words) == 1:
        return words[0]
    if len(words) % 2:
        raise StatefulsetError(f"{where}: dataloader.data_path must be one prefix or 'w1 prefix1 w2 prefix2 ...'")
    out: list[Any] = []
    for weight, prefix in zip(words[::2], words[1::2], strict=True):
        try:
            out += [float(weight), prefix]
        except ValueError:
            raise StatefulsetError(f"{where}: dataloader.data_path: weight {weight!r} is not a number") from None
    return out


def trainer_batch(batch: dict[str, Any], positions: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """torchtitan's ``({"input": [B, S], "positions": [B, S]}, labels [B, S])`` from a batch (``text`` [B, S+1]).

    ``positions`` restart at each document of the shard index with ``positions=True``
    (``document_boundaries``), else count ``0..S-1`` in every row. torchtitan 0.3's models with
    Flex or varlen attention (its llama3 debug model among them) build their attention masks from
    ``positions`` and fail without them, so they are always there, as in torchtitan's own loaders.
    """
    text = batch["text"]
    inputs = text[:, :-1].contiguous()
    labels = text[:, 1:].contiguous()
    mask = batch.get("loss_mask")
    if mask is not None:
        labels[mask == 0] = IGNORE_INDEX
    if positions:
        where = batch["position_ids"].to(torch.int64)
    else:  # one document per row: what torchtitan's masks and RoPE make of 0..S-1
        where = torch.arange(inputs.shape[1], dtype=torch.int64).expand_as(inputs).contiguous()
    return {"input": inputs, "positions": where}, labels
