"""Megatron-LM's GPT batch formats from a loader's ``text`` rows: the legacy ``{"text"}`` and megatron-core's
``tokens`` / ``labels`` / ``loss_mask`` / ``position_ids`` / optional ``attention_mask``.

:class:`GPTBatchConfig` + :func:`gpt_batch` turn ``text`` [B, S+1] into megatron-core's
``GPTDataset.__getitem__`` output, collated and vectorised over the batch. The first pipeline
stage and the last one derive their fields with this same pure function.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch

from statefulset.errors import StatefulsetError

MEGATRON_PAD_TOKEN = -1
"""megatron-core's ``_PAD_TOKEN_ID``: the pad id ``GPTDataset`` uses when the tokenizer has none."""

Format = Literal["gpt", "text"]


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
    - ``inter_document_masking``: megatron-core 0.19's option of that name: the batch adds
      ``cu_seqlens`` (int32 [B, S+1]) and ``max_seqlen`` (int32 [B]) and its ``position_ids``
      restart at every document; no ``attention_mask``. Needs a loader built with
      ``document_boundaries=True`` (the Megatron builder does it).
    """

    eod_token: int | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = False
    pad_token: int | None = MEGATRON_PAD_TOKEN
    inter_document_masking: bool = False

    def __post_init__(self) -> None:
        flags = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss", "create_attention_mask")
        for name in (*flags, "inter_document_masking"):
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
            inter_document_masking=bool(getattr(config, "inter_document_masking", False)),
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
            inter_document_masking=bool(getattr(args, "dataloader_inter_document_masking", False)),
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


DOCUMENT_KEYS = ("cu_seqlens", "max_seqlen", "position_ids")


def gpt_batch(
    text: torch.Tensor, config: GPTBatchConfig | None = None, fields: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """megatron-core ``GPTDataset.__getitem__`` for a whole micro-batch of ``text`` rows [B, S+1].

    ``fields`` is the rest of the loader's batch: its ``loss_mask`` (packing bestfit) zeroes
    padding, and with ``config.inter_document_masking`` its ``cu_seqlens``, ``max_seqlen`` and
    ``position_ids`` are the batch's.

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
    fields = fields or {}
    if "loss_mask" in fields:  # padding of packing bestfit, whatever its pad id
        loss_mask.mul_(fields["loss_mask"].to(loss_mask.device))
    if config.inter_document_masking:
        missing = [k for k in DOCUMENT_KEYS if k not in fields]
        if missing:
            raise StatefulsetError(
                f"gpt_batch: inter_document_masking needs the batch's {', '.join(missing)}: build the loader with "
                "get_train_dataset(..., document_boundaries=True)"
            )
        out["position_ids"] = fields["position_ids"].to(torch.int64)
        out["cu_seqlens"] = fields["cu_seqlens"].to(torch.int32)
        out["max_seqlen"] = fields["max_seqlen"].to(torch.int32)
    elif config.create_attention_mask:
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


def format_batch(batch: Mapping[str, torch.Tensor], fmt: Format, config: GPTBatchConfig) -> dict[str, torch.Tensor]:
    # "text": the text and whatever fields the loader adds (loss_mask, document boundaries).
    out = dict(batch) if fmt == "text" else gpt_batch(batch["text"], config, batch)
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


class GPTDocumentBatch(NamedTuple):
    """:class:`GPTBatch` with document boundaries: what ``get_batch`` returns with ``inter_document_masking``.

    ``cu_seqlens`` (int32 [B, S+1], padded with S) and ``max_seqlen`` (int32 [B]) are on every
    stage that holds tokens or labels (attention needs them on both); ``attention_mask`` is None.
    """

    tokens: torch.Tensor | None
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    max_seqlen: torch.Tensor | None
    sample_id: torch.Tensor | None = None
