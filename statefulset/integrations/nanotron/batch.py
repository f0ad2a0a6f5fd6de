"""Nanotron's CLM micro-batch (``DataCollatorForCLM``): ``input_ids``, ``input_mask``, ``label_ids``,
``label_mask`` from ``[sequence_length + 1]`` token rows, with ``TensorPointer``s where a stage holds none.

Inputs drop the last token, labels drop the first, masks are all True, and context-parallel ranks
keep a contiguous slice of the sequence. ``TensorPointer`` is Nanotron's own class when Nanotron is
installed (so its pipeline engine recognises our pointers), else a stand-in with the same field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from statefulset.errors import StatefulsetError, check_int

try:  # Nanotron's own class when it is installed, so its pipeline engine recognises our pointers.
    from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer
except ImportError:  # pragma: no cover - depends on the environment

    @dataclass
    class TensorPointer:  # type: ignore[no-redef]
        """Stand-in for Nanotron's ``TensorPointer``: the tensor lives on PP-group rank ``group_rank``."""

        group_rank: int


NANOTRON_KEYS = ("input_ids", "input_mask", "label_ids", "label_mask")
"""Keys of a Nanotron CLM micro-batch, in the order Nanotron's collator fills them."""
NANOTRON_POSITION_KEYS = ("input_ids", "position_ids", "label_ids", "label_mask")
"""Keys of ``DataCollatorForCLMWithPositionIds``'s micro-batch (no ``input_mask``)."""


def _sequence_slice(seq_length: int, cp_rank: int, cp_size: int) -> slice:
    """Nanotron's context-parallel slice: CP rank ``c`` keeps ``[c*S//cp, (c+1)*S//cp)``."""
    return slice(cp_rank * seq_length // cp_size, (cp_rank + 1) * seq_length // cp_size)


def clm_micro_batch(
    text: torch.Tensor,
    *,
    pp_rank: int = 0,
    input_pp_rank: int = 0,
    output_pp_rank: int = 0,
    cp_rank: int = 0,
    cp_size: int = 1,
    with_position_ids: bool = False,
    position_ids: torch.Tensor | None = None,
    label_mask: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Nanotron's ``DataCollatorForCLM`` output for ``text`` (int64 ``[B, S+1]``) on pipeline rank ``pp_rank``.

    ``input_ids = text[:, :-1]`` and an all-True ``input_mask`` on ``input_pp_rank``;
    ``label_ids = text[:, 1:]`` and an all-True ``label_mask`` on ``output_pp_rank``; a
    ``TensorPointer`` to the owning stage everywhere else. With context parallelism each CP rank
    keeps the contiguous slice ``[cp_rank*S//cp_size, (cp_rank+1)*S//cp_size)`` of every tensor.
    Tensors are contiguous copies, so they can be sent or pinned without another copy.
    ``text`` may be None on a rank that is neither input nor output stage.

    ``with_position_ids`` gives ``DataCollatorForCLMWithPositionIds``'s format instead:
    ``input_ids``, ``position_ids`` (the loader's per-document ``position_ids`` [B, S], or
    ``0..S-1`` when None), ``label_ids``, ``label_mask``. ``label_mask`` (the loader's
    ``loss_mask`` of packing bestfit) marks padded labels False in either format.
    """
    where = f"clm_micro_batch (pp_rank {pp_rank})"
    cp_size = check_int("cp_size", cp_size, 1, where)
    cp_rank = check_int("cp_rank", cp_rank, 0, where)
    if cp_rank >= cp_size:
        raise StatefulsetError(f"{where}: cp_rank {cp_rank} is outside [0, cp_size {cp_size})")
    keys = NANOTRON_POSITION_KEYS if with_position_ids else NANOTRON_KEYS
    owners = {"input_ids": input_pp_rank, "input_mask": input_pp_rank, "position_ids": input_pp_rank,
              "label_ids": output_pp_rank, "label_mask": output_pp_rank}  # fmt: skip
    out: dict[str, Any] = {key: TensorPointer(group_rank=owners[key]) for key in keys}
    if pp_rank not in (input_pp_rank, output_pp_rank):
        return out
    if not isinstance(text, torch.Tensor) or text.dim() != 2 or text.shape[1] < 2:
        shape = tuple(text.shape) if isinstance(text, torch.Tensor) else type(text).__name__
        raise StatefulsetError(f"{where}: 'text' must be a 2-D tensor [micro_batch_size, seq_length+1], got {shape}")
    if text.dtype != torch.int64:
        raise StatefulsetError(f"{where}: 'text' must be int64 token ids, got {text.dtype}")
    seq_length = text.shape[1] - 1
    if seq_length % cp_size:
        raise StatefulsetError(
            f"{where}: seq_length {seq_length} is not divisible by cp_size {cp_size}; Nanotron's collator "
            "rejects uneven context-parallel slices"
        )
    part = _sequence_slice(seq_length, cp_rank, cp_size)
    mask = torch.ones((text.shape[0], part.stop - part.start), dtype=torch.bool)
    if pp_rank == input_pp_rank:
        out["input_ids"] = text[:, :-1][:, part].contiguous()
        if with_position_ids:
            if position_ids is None:
                position_ids = torch.arange(seq_length, dtype=torch.int64).expand(text.shape[0], seq_length)
            out["position_ids"] = position_ids[:, part].to(torch.int64).contiguous()
        else:
            out["input_mask"] = mask
    if pp_rank == output_pp_rank:
        out["label_ids"] = text[:, 1:][:, part].contiguous()
        if label_mask is not None:
            out["label_mask"] = label_mask[:, part].to(torch.bool).contiguous()
        else:
            out["label_mask"] = mask.clone() if pp_rank == input_pp_rank else mask
    return out
