"""Megatron-LM drop-in: batches, iterators and ``get_batch`` for TP x PP x DP training.

Megatron-LM's GPT recipe reads the same samples twice: TP rank 0 of the first stage for
``tokens``, TP rank 0 of the last stage for ``labels`` and ``loss_mask``, each through its own
``GPTDataset`` + ``MegatronPretrainingSampler``, trusting that both reads agree. Here one loader
per DP rank lives on the first stage; it sends the raw ``text`` rows to the last stage of its own
pipeline (:class:`~statefulset.pipeline.StageLink`), which derives labels and masks with the same
pure function (:func:`gpt_batch`). The resume point is Megatron's own ``consumed_train_samples``
(any DP size) or the Energon-style state ``maybe_save_dataloader_state`` writes per DP rank.

Pieces:

- :class:`GPTBatchConfig` + :func:`gpt_batch`: ``text`` [B, S+1] → megatron-core's
  ``GPTDataset.__getitem__`` output, collated (``tokens``, ``labels``, ``loss_mask``,
  ``position_ids``, optional ``attention_mask``), vectorised over the batch.
- :func:`build_megatron_iterators`: called on every rank (it creates process groups, a
  collective); returns a :class:`MegatronData` whose ``train`` / ``valid`` / ``test`` are what
  ``train_valid_test_datasets_provider`` returns under ``--dataloader-type external``.
- :meth:`MegatronData.get_batch`: Megatron's ``get_batch`` + ``get_batch_on_this_tp_rank`` for
  users' own loops.
- from :mod:`statefulset.megatron_state`, re-exported here: :func:`add_statefulset_args` (the
  ``extra_args_provider`` that adds ``--dataloader-save``, which stock Megatron-LM reads but never
  defines), :func:`layout_from_megatron_args`, :func:`load_megatron_dataloader_state_from_args`, and
  :func:`megatron_dataloader_state_path` / :func:`save_megatron_dataloader_state` /
  :func:`load_megatron_dataloader_state` for the files ``save_checkpoint`` writes.
"""

from __future__ import annotations

import contextlib
import operator
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist

from .datasets import get_train_dataset, get_val_dataset
from .errors import StatefulsetError, check_int
from .loader import SavableLoader, get_loader, get_savable_loader
from .megatron_state import (
    add_statefulset_args,
    layout_from_megatron_args,
    load_megatron_dataloader_state,
    load_megatron_dataloader_state_from_args,
    megatron_dataloader_state_path,
    save_megatron_dataloader_state,
)
from .parallel import ParallelLayout, RankInfo, create_parallel_groups, raise_on_every_rank
from .pipeline import LINK_TAG, StageLink, TensorSpec, broadcast_batch
from .spec import DatasetSpec, load_spec
from .state import check_identity, check_state, cursor_of
from .workers import WorkerConfig

__all__ = [
    "GPTBatch",
    "GPTBatchConfig",
    "MegatronData",
    "MegatronIterator",
    "add_statefulset_args",
    "build_megatron_iterators",
    "gpt_batch",
    "layout_from_megatron_args",
    "load_megatron_dataloader_state",
    "load_megatron_dataloader_state_from_args",
    "megatron_dataloader_state_path",
    "save_megatron_dataloader_state",
]

MEGATRON_PAD_TOKEN = -1
"""megatron-core's ``_PAD_TOKEN_ID``: the pad id ``GPTDataset`` uses when the tokenizer has none."""

Format = Literal["gpt", "text"]
TensorParallelMode = Literal["broadcast", "read"]
_SPLIT_TAGS = {"train": 0, "valid": 1, "test": 2}


# -- batch formats ------------------------------------------------------------------------------
def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise StatefulsetError(f"GPTBatchConfig: {name} must be True or False, got {value!r}")
    return value


def _token(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise StatefulsetError(f"GPTBatchConfig: {name} must be an int token id or None, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise StatefulsetError(f"GPTBatchConfig: {name} must be an int token id or None, got {value!r}") from None


@dataclass(frozen=True)
class GPTBatchConfig:
    """The ``GPTDatasetConfig`` fields that shape a batch, with megatron-core's meaning.

    - ``eod_token``: the tokenizer's end-of-document id (``tokenizer.eod``); needed by the three
      options below.
    - ``reset_position_ids``: positions restart at 0 after every EOD token.
    - ``reset_attention_mask``: a token attends only within its document (needs
      ``create_attention_mask`` to show in the batch).
    - ``eod_mask_loss``: no loss where the *input* token is EOD (megatron-core masks by
      ``tokens``, not ``labels``; kept as is so losses match).
    - ``create_attention_mask``: add ``attention_mask`` bool [B, 1, S, S], True = masked
      (``--create-attention-mask-in-dataloader``). Off by default: fused attention kernels build
      the causal mask themselves and an S x S mask per row is large.
    - ``pad_token``: ``tokenizer.pad`` or megatron-core's -1 when the tokenizer has none; no loss
      where the label is pad, and pad ids in tokens/labels become 0. None skips this step.
    """

    eod_token: int | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = False
    pad_token: int | None = MEGATRON_PAD_TOKEN

    def __post_init__(self) -> None:
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss", "create_attention_mask"):
            _flag(name, getattr(self, name))
        object.__setattr__(self, "eod_token", _token("eod_token", self.eod_token))
        object.__setattr__(self, "pad_token", _token("pad_token", self.pad_token))
        needs_eod = [n for n in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss") if getattr(self, n)]
        if needs_eod and self.eod_token is None:
            raise StatefulsetError(f"GPTBatchConfig: {', '.join(needs_eod)} needs eod_token (the tokenizer's eod id)")

    @classmethod
    def from_gpt_dataset_config(cls, config: Any) -> GPTBatchConfig:
        """The batch options of a megatron-core ``GPTDatasetConfig`` (reads its tokenizer's eod and pad)."""
        tokenizer = getattr(config, "tokenizer", None)
        pad = _megatron_pad_token(tokenizer, bool(getattr(config, "allow_ambiguous_pad_tokens", False)))
        return cls(
            eod_token=getattr(tokenizer, "eod", None),
            reset_position_ids=bool(config.reset_position_ids),
            reset_attention_mask=bool(config.reset_attention_mask),
            eod_mask_loss=bool(config.eod_mask_loss),
            create_attention_mask=bool(getattr(config, "create_attention_mask", False)),
            pad_token=pad,
        )

    @classmethod
    def from_args(cls, args: Any, eod_token: int | None, pad_token: int | None = MEGATRON_PAD_TOKEN) -> GPTBatchConfig:
        """The batch options of Megatron-LM's ``get_args()`` namespace (``--reset-position-ids`` etc.)."""
        return cls(
            eod_token=eod_token,
            reset_position_ids=bool(getattr(args, "reset_position_ids", False)),
            reset_attention_mask=bool(getattr(args, "reset_attention_mask", False)),
            eod_mask_loss=bool(getattr(args, "eod_mask_loss", False)),
            create_attention_mask=bool(getattr(args, "create_attention_mask_in_dataloader", False)),
            pad_token=pad_token,
        )


def _megatron_pad_token(tokenizer: Any, allow_ambiguous: bool) -> int:
    """The pad id megatron-core's ``MegatronDataset`` settles on for ``tokenizer``.

    Its rules: ``tokenizer.pad`` if the tokenizer has one, else -1; and -1 again when the pad id
    collides with another special token (unless ``allow_ambiguous_pad_tokens``), so that real
    EOD tokens are never masked as padding.
    """
    try:
        pad = tokenizer.pad
    except Exception:  # megatron-core catches everything here too
        return MEGATRON_PAD_TOKEN
    if pad is None:
        return MEGATRON_PAD_TOKEN
    try:
        special = [v for k, v in tokenizer.special_tokens_dict.items() if k != "pad_token"]
    except (AttributeError, IndexError, ValueError):
        special = []
    if not special:
        for name in ("eos", "eod"):
            with contextlib.suppress(AttributeError, NotImplementedError):
                special.append(getattr(tokenizer, name))
    if pad in special and not allow_ambiguous:
        return MEGATRON_PAD_TOKEN
    return pad


def gpt_batch(text: torch.Tensor, config: GPTBatchConfig | None = None) -> dict[str, torch.Tensor]:
    """megatron-core ``GPTDataset.__getitem__`` for a whole micro-batch of ``text`` rows [B, S+1].

    Returns ``tokens``, ``labels`` (int64 [B, S]), ``loss_mask`` (float32 [B, S]),
    ``position_ids`` (int64 [B, S]) and, with ``create_attention_mask``, ``attention_mask``
    (bool [B, 1, S, S], True = masked), equal to stacking ``__getitem__`` row by row. Vectorised:
    document starts come from a cumulative max over EOD positions instead of megatron-core's
    Python loop over EOD tokens, so the cost does not grow with the number of documents.
    """
    config = config if config is not None else GPTBatchConfig()
    if not isinstance(text, torch.Tensor) or text.dim() != 2 or text.shape[1] < 2:
        shape = tuple(text.shape) if isinstance(text, torch.Tensor) else type(text).__name__
        raise StatefulsetError(f"gpt_batch: text must be a [batch, seq_length + 1] tensor, got {shape}")
    text = text.to(torch.int64)
    tokens = text[:, :-1].clone()
    labels = text[:, 1:].clone()
    rows, seq = tokens.shape
    positions = torch.arange(seq, dtype=torch.int64, device=text.device)

    loss_mask = torch.ones(rows, seq, dtype=torch.float32, device=text.device)
    is_eod = tokens == config.eod_token if config.eod_token is not None else None
    if config.eod_mask_loss:
        loss_mask[is_eod] = 0.0

    if config.reset_position_ids and is_eod is not None:
        # A document starts one past the last EOD strictly before a position.
        after_eod = torch.where(is_eod, positions + 1, torch.zeros_like(positions))
        start = torch.zeros_like(tokens)
        start[:, 1:] = torch.cummax(after_eod, dim=1).values[:, :-1]
        position_ids = positions - start
    else:
        position_ids = positions.expand(rows, seq).contiguous()

    out = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    if config.create_attention_mask:
        mask = torch.ones(seq, seq, dtype=torch.bool, device=text.device).triu(diagonal=1).expand(rows, seq, seq)
        if config.reset_attention_mask and is_eod is not None:
            # Query q may not see key k <= q when an EOD lies in [k, q): different document numbers.
            document = torch.zeros_like(tokens)
            document[:, 1:] = torch.cumsum(is_eod, dim=1)[:, :-1]
            mask = mask | (document[:, :, None] != document[:, None, :])
        out["attention_mask"] = mask.unsqueeze(1).contiguous()

    if config.pad_token is not None:
        loss_mask[labels == config.pad_token] = 0.0
        tokens[tokens == config.pad_token] = 0
        labels[labels == config.pad_token] = 0
    return out


def _format_batch(batch: Mapping[str, torch.Tensor], fmt: Format, config: GPTBatchConfig) -> dict[str, torch.Tensor]:
    out = {"text": batch["text"]} if fmt == "text" else gpt_batch(batch["text"], config)
    out["sample_id"] = batch["sample_id"]
    return out


class GPTBatch(NamedTuple):
    """What :meth:`MegatronData.get_batch` returns; unpacks like Megatron's ``get_batch``.

    Fields a stage does not need are None, as in Megatron: with PP > 1 the first stage has no
    labels/loss_mask, the last stage no tokens/position_ids, middle stages nothing.
    ``sample_id`` (global stream positions of the rows) is extra, for logging and checks.
    """

    tokens: torch.Tensor | None
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    sample_id: torch.Tensor | None = None


# -- iterators ----------------------------------------------------------------------------------
class MegatronIterator:
    """One micro-batch per ``next()``: the object ``--dataloader-type external`` passes through.

    Megatron wraps it as ``RerunDataIterator(it)`` and calls ``next(it)`` once per micro-batch on
    the ranks that hold one; ``maybe_save_dataloader_state`` calls ``it.save_state()``.

    Two kinds, made by :func:`build_megatron_iterators`:

    - a *reading* iterator (first stage) draws from a :class:`~statefulset.loader.SavableLoader`
      and, when the pipeline has a later stage, sends the raw ``text`` rows to its last stage;
    - a *receiving* iterator (last stage, PP > 1) gets those rows and derives the same batch.
      It holds no position of its own, so its :meth:`save_state` returns None (Megatron only
      saves on the first stage).

    Validation and test iterators cycle: after the last whole global batch of the split they
    start again from its beginning, as Megatron's cyclic validation iterator does.
    """

    def __init__(
        self,
        split: str,
        fmt: Format,
        config: GPTBatchConfig,
        *,
        loader: Any = None,
        link: StageLink | None = None,
        receive: bool = False,
        cyclic: bool = False,
    ) -> None:
        self.split = split
        self.format = fmt
        self.batch_config = config
        self.loader = loader
        self.link = link
        self.receive = receive
        self.cyclic = cyclic
        self._source: Iterator[dict[str, torch.Tensor]] | None = None
        self.batches = 0
        """Micro-batches handed out by this iterator since it was built."""

    @property
    def reads(self) -> bool:
        """True on a rank that reads samples from disk (a first-stage loader)."""
        return self.loader is not None

    def __iter__(self) -> MegatronIterator:
        return self

    def _next_raw(self) -> dict[str, torch.Tensor]:
        if self.receive:
            if self.link is None:
                raise StatefulsetError(f"{self.split} iterator: a receiving iterator needs a StageLink")
            return self.link.recv()
        if self._source is None:
            self._source = iter(self.loader)
        try:
            return next(self._source)
        except StopIteration:
            if not self.cyclic:
                raise
        self._source = iter(self.loader)  # a fresh pass over the (never savable) eval split
        try:
            return next(self._source)
        except StopIteration:
            raise StatefulsetError(
                f"{self.split} iterator: the {self.split} split has no whole global batch; "
                "lower the micro-batch size or give the split more data"
            ) from None

    def __next__(self) -> dict[str, torch.Tensor]:
        raw = self._next_raw()
        if self.link is not None and not self.receive:
            self.link.send({"text": raw["text"], "sample_id": raw["sample_id"]})
        self.batches += 1
        return _format_batch(raw, self.format, self.batch_config)

    # -- state -----------------------------------------------------------------------------
    def save_state(self) -> dict[str, Any] | None:
        """This DP rank's loader state (Energon-style): what ``maybe_save_dataloader_state`` stores.

        None on a receiving iterator or an eval iterator: nothing to resume there. Waits for
        the text rows still in flight to the last stage first, so a checkpoint never races a send.
        """
        if self.link is not None and not self.receive:
            self.link.flush()
        if isinstance(self.loader, SavableLoader):
            return self.loader.save_state_rank()
        return None

    def save_state_rank(self) -> dict[str, Any] | None:
        """Energon's name for :meth:`save_state`."""
        return self.save_state()

    @property
    def consumed_samples(self) -> int | None:
        """Megatron's ``consumed_train_samples`` after the micro-batches this rank took (reading train only)."""
        if isinstance(self.loader, SavableLoader):
            return self.loader.consumed_samples
        return None

    def flush(self) -> None:
        """Wait for every text row still in flight to the last stage (before exit or a checkpoint)."""
        if self.link is not None and not self.receive:
            self.link.flush()

    def __repr__(self) -> str:
        kind = "receiving" if self.receive else "reading"
        return f"MegatronIterator({self.split}, {kind}, format={self.format!r}, batches={self.batches})"


# -- builder ------------------------------------------------------------------------------------
@dataclass
class MegatronData:
    """This rank's iterators and what :meth:`get_batch` needs to move their batches.

    ``train`` / ``valid`` / ``test`` are None where Megatron's ``get_batch`` never touches the
    iterator (middle stages; TP ranks > 0 in ``"broadcast"`` mode) and for empty splits.
    """

    train: MegatronIterator | None
    valid: MegatronIterator | None
    test: MegatronIterator | None
    info: RankInfo
    layout: ParallelLayout
    micro_batch_size: int
    seq_length: int
    tensor_parallel: TensorParallelMode
    format: Format
    batch_config: GPTBatchConfig
    groups: dict[str, Any] = field(default_factory=dict)

    @property
    def iterators(self) -> tuple[MegatronIterator | None, MegatronIterator | None, MegatronIterator | None]:
        """``(train, valid, test)``: what ``train_valid_test_datasets_provider`` returns."""
        return self.train, self.valid, self.test

    def _iterator(self, which: str | MegatronIterator | None) -> MegatronIterator | None:
        if isinstance(which, str):
            if which not in _SPLIT_TAGS:
                raise StatefulsetError(f"get_batch: split must be train, valid or test, got {which!r}")
            return getattr(self, which)
        return which

    def _keys(self) -> tuple[str, ...]:
        """The keys Megatron's ``get_batch_on_this_tp_rank`` moves on this rank's stage."""
        first, last = self.info.pp_rank == 0, self.info.is_last_stage
        mask = ("attention_mask",) if self.batch_config.create_attention_mask else ()
        if first and last:
            return ("tokens", "labels", "loss_mask", *mask, "position_ids", "sample_id")
        if first:
            return ("tokens", *mask, "position_ids", "sample_id")
        if last:
            return ("labels", "loss_mask", *mask, "sample_id")
        return ()

    def _specs(self, keys: tuple[str, ...]) -> list[TensorSpec]:
        b, s = self.micro_batch_size, self.seq_length
        shapes = {
            "tokens": ((b, s), torch.int64),
            "labels": ((b, s), torch.int64),
            "loss_mask": ((b, s), torch.float32),
            "position_ids": ((b, s), torch.int64),
            "attention_mask": ((b, 1, s, s), torch.bool),
            "sample_id": ((b,), torch.int64),
        }
        return [TensorSpec(k, *shapes[k]) for k in keys]

    def get_batch(
        self, which: str | MegatronIterator | None = "train", device: torch.device | str | None = None
    ) -> GPTBatch:
        """Megatron's ``get_batch`` + ``get_batch_on_this_tp_rank`` for a loop of your own.

        Call it on every rank once per micro-batch (middle stages return at once, never
        touching an iterator). In ``"broadcast"`` mode TP rank 0 takes the next batch and
        broadcasts this stage's tensors over the TP group; in ``"read"`` mode every TP rank
        already holds the same batch. ``which`` is ``"train"``, ``"valid"``, ``"test"`` or an
        iterator. ``device`` moves tensors there before the broadcast (use a TP group of the
        matching backend, e.g. Megatron's NCCL TP group, via ``groups=`` of the builder).
        """
        keys = self._keys()
        if not keys:
            return GPTBatch(None, None, None, None, None, None)
        iterator = self._iterator(which)
        broadcast = self.tensor_parallel == "broadcast" and self.layout.tp > 1
        holds = not broadcast or self.info.tp_rank == 0
        batch: dict[str, torch.Tensor] | None = None
        if holds:
            if iterator is None:
                raise StatefulsetError(
                    f"get_batch: rank {self.info.global_rank} (TP {self.info.tp_rank}, PP {self.info.pp_rank}) "
                    f"needs a {which if isinstance(which, str) else 'data'} iterator but has None"
                )
            raw = next(iterator)
            if self.format == "text":
                raw = _format_batch(raw, "gpt", self.batch_config)
            batch = {k: raw[k].to(device) if device is not None else raw[k] for k in keys}
        if broadcast:
            batch = broadcast_batch(
                batch, self._specs(keys), src=self.info.tp_src_rank, group=self.groups.get("tp"), device=device
            )
        if batch is None:  # unreachable: a rank either holds the batch or receives the broadcast
            raise StatefulsetError(f"get_batch: rank {self.info.global_rank} got no batch")
        return GPTBatch(
            tokens=batch.get("tokens"),
            labels=batch.get("labels"),
            loss_mask=batch.get("loss_mask"),
            attention_mask=batch.get("attention_mask"),
            position_ids=batch.get("position_ids"),
            sample_id=batch.get("sample_id"),
        )

    def save_state(self) -> dict[str, Any] | None:
        """The train loader's state on the rank Megatron saves it from (first stage, TP 0, CP 0), else None."""
        if self.info.saves_state and self.train is not None:
            return self.train.save_state()
        return None

    def flush(self) -> None:
        """Wait for every send to the last stage in flight (call before a checkpoint or exit)."""
        for iterator in self.iterators:
            if iterator is not None:
                iterator.flush()


def _unwrap_state(state: Any) -> Any:
    """Accept the loader state or the whole ``train_dataloader_dprank*.pt`` dict Megatron writes."""
    if isinstance(state, Mapping) and set(state) == {"dataloader_state_dict"}:
        return state["dataloader_state_dict"]
    return state


def _restore_train(
    loader: SavableLoader, state: Any, consumed: int | None, info: RankInfo, micro_batch_size: int
) -> None:
    """Resume from Megatron's consumed_train_samples, a saved state, or both when they agree."""
    where = f"rank {info.global_rank} (DP rank {info.dp_rank} of {info.dp_size})"
    if state is None:
        loader.restore_consumed_samples(consumed or 0)
        return
    check_state(state, f"{where}: loader state")
    check_identity(state, loader.dataset.stream.identity, f"{where}: loader state")
    cursor = cursor_of(state)
    if consumed is not None and cursor.consumed != consumed:
        raise StatefulsetError(
            f"{where}: consumed_train_samples is {consumed} but the loader state was saved after "
            f"{cursor.consumed} samples; pass the state and consumed_train_samples of the same checkpoint"
        )
    if cursor.dp_size == info.dp_size and cursor.batch_size == micro_batch_size:
        if cursor.dp_rank != info.dp_rank:
            raise StatefulsetError(
                f"{where}: the loader state was saved by DP rank {cursor.dp_rank}; load "
                f"train_dataloader_dprank{info.dp_rank:03d}.pt on this rank"
            )
        loader.restore_state_rank(state)
    else:
        # Another DP size or micro-batch size: Megatron steps every DP rank in lockstep, so the
        # state's consumed count is the global one, and the new layout starts there.
        loader.restore_consumed_samples(cursor.consumed)


def build_megatron_iterators(
    spec: str | os.PathLike[str] | Mapping[str, Any] | DatasetSpec,
    layout: ParallelLayout,
    rank: int | None = None,
    *,
    micro_batch_size: int,
    consumed_train_samples: int | None = None,
    state: Any = None,
    tensor_parallel: TensorParallelMode = "broadcast",
    format: Format = "gpt",
    batch_config: GPTBatchConfig | None = None,
    num_workers: int = 2,
    valid: bool = True,
    test: bool = True,
    groups: Mapping[str, Any] | None = None,
    link_depth: int | None = None,
    **loader_options: Any,
) -> MegatronData:
    """Build this rank's Megatron iterators; call it on **every** rank, with the same arguments.

    Roles (from ``layout.rank_info(rank)``):

    - first stage: a reading train iterator; in ``"broadcast"`` mode only TP rank 0 reads (its
      TP peers get None and receive tensors in :meth:`MegatronData.get_batch`, as Megatron's
      ``get_batch_on_this_tp_rank`` does), in ``"read"`` mode every TP rank reads the same samples;
    - last stage (PP > 1): a receiving iterator fed over a :class:`StageLink` by the first
      stage of its own pipeline (never a second loader);
    - middle stages: None.

    Resume: ``consumed_train_samples`` is Megatron's global counter (any DP or micro-batch size
    resumes from it); ``state`` is this DP rank's saved loader state (``save_state()``'s return
    or the dict in ``train_dataloader_dprank*.pt``), checked against the data; when both are
    given they must agree. Only reading ranks use them. Valid/test never resume mid-stream.

    ``groups`` may hold ready process groups ``"tp"`` (broadcast in ``get_batch``), ``"pp"``
    (the stage link) and ``"dp"`` (the loader's DP group); missing ones are created here with the
    gloo backend (batches travel as CPU tensors), which is why every rank must call this.
    Errors on any rank are raised on every rank. ``loader_options`` go to ``get_savable_loader``.
    """
    if not isinstance(layout, ParallelLayout):
        raise StatefulsetError(
            f"build_megatron_iterators: layout must be a ParallelLayout, got {type(layout).__name__}"
        )
    if rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise StatefulsetError("build_megatron_iterators: pass rank= or initialise torch.distributed first")
        rank = dist.get_rank()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != layout.world_size:
        raise StatefulsetError(
            f"build_megatron_iterators: layout world_size {layout.world_size} != torch.distributed world size "
            f"{dist.get_world_size()}"
        )
    info = layout.rank_info(rank)
    micro_batch_size = check_int("micro_batch_size", micro_batch_size, 1, "build_megatron_iterators")
    if tensor_parallel not in ("broadcast", "read"):
        raise StatefulsetError(
            f"build_megatron_iterators: tensor_parallel must be 'broadcast' or 'read', got {tensor_parallel!r}"
        )
    if format not in ("gpt", "text"):
        raise StatefulsetError(f"build_megatron_iterators: format must be 'gpt' or 'text', got {format!r}")
    if consumed_train_samples is not None and (
        isinstance(consumed_train_samples, bool)
        or not isinstance(consumed_train_samples, int)
        or consumed_train_samples < 0
    ):
        raise StatefulsetError(
            "build_megatron_iterators: consumed_train_samples must be a non-negative int, "
            f"got {consumed_train_samples!r}"
        )
    config = batch_config if batch_config is not None else GPTBatchConfig()
    if not isinstance(config, GPTBatchConfig):
        raise StatefulsetError(f"build_megatron_iterators: batch_config must be a GPTBatchConfig, got {config!r}")
    depth = link_depth if link_depth is not None else max(4, 2 * layout.pp)
    spec = spec if isinstance(spec, DatasetSpec) else load_spec(spec)

    # Collective part first, identical on every rank.
    groups = dict(groups or {})
    missing = [kind for kind in ("dp", "tp", "pp") if kind not in groups]
    if missing and dist.is_available() and dist.is_initialized():
        groups.update(create_parallel_groups(layout, missing, backend="gloo"))

    first, last = info.pp_rank == 0, info.is_last_stage
    reads = first and (tensor_parallel == "read" or info.tp_rank == 0)
    receives = last and not first and (tensor_parallel == "read" or info.tp_rank == 0)
    peer = info.pp_group_ranks[-1] if reads and not last else info.first_stage_rank
    seq_length = spec.seq_length
    b, s = micro_batch_size, seq_length
    link_specs = (TensorSpec("text", (b, s + 1), torch.int64), TensorSpec("sample_id", (b,), torch.int64))

    built: dict[str, MegatronIterator | None] = {"train": None, "valid": None, "test": None}
    errors: list[str | None] = []
    wanted = {"train": True, "valid": valid, "test": test}
    for split, want in wanted.items():
        if not want or spec.blend_for(split) is None or not (reads or receives):
            continue
        link = None
        if layout.pp > 1:
            link = StageLink(peer, link_specs, group=groups.get("pp"), tag=LINK_TAG + _SPLIT_TAGS[split], depth=depth)
        if receives:
            built[split] = MegatronIterator(split, format, config, link=link, receive=True)
            continue
        try:
            wc = WorkerConfig(
                rank=info.dp_rank,
                world_size=info.dp_size,
                num_workers=num_workers,
                data_parallel_group=groups.get("dp"),
            )
            if split == "train":
                loader: Any = get_savable_loader(
                    get_train_dataset(spec, batch_size=b, worker_config=wc), **loader_options
                )
                _restore_train(loader, _unwrap_state(state), consumed_train_samples, info, b)
            else:
                dataset = get_val_dataset(spec, split_part=split, batch_size=b, worker_config=wc)
                if len(dataset) == 0:
                    raise StatefulsetError(
                        f"{spec.source}: the {split} split has {len(dataset.stream)} samples, fewer than one "
                        f"global batch ({info.dp_size} DP ranks x micro_batch_size {b}); pass {split}=False or give "
                        "it more data"
                    )
                loader = get_loader(dataset, **loader_options)
            built[split] = MegatronIterator(split, format, config, loader=loader, link=link, cyclic=split != "train")
        except StatefulsetError as error:
            errors.append(f"rank {rank}: {error}" if not str(error).startswith("rank ") else str(error))
    raise_on_every_rank(errors)
    return MegatronData(
        train=built["train"],
        valid=built["valid"],
        test=built["test"],
        info=info,
        layout=layout,
        micro_batch_size=b,
        seq_length=seq_length,
        tensor_parallel=tensor_parallel,
        format=format,
        batch_config=config,
        groups=groups,
    )
