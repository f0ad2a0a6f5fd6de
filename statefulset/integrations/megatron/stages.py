"""Who moves Megatron-LM's batches between pipeline stages, and which tensors travel.

One loader per DP rank lives on the first stage; it sends the raw ``text`` rows (and the loader's extra
fields) to the last stage of its own pipeline, and with ``inter_document_masking`` the document
boundaries to the middle stages too
(:func:`~statefulset.integrations.megatron.builder.build_megatron_iterators`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from statefulset.integrations.megatron.iterators import TensorParallelMode
from statefulset.parallel.layout import RankInfo
from statefulset.parallel.transfer import TensorSpec
from statefulset.spec.model import DatasetSpec
from statefulset.streams.label_masks import spec_has_masks


@dataclass(frozen=True)
class StageRole:
    """What this rank does with the data: read it, receive it from its first stage, or neither."""

    reads: bool  # a loader on the first stage (TP rank 0 only in "broadcast" mode)
    receives: bool  # the last stage (PP > 1), fed by the first stage of its own pipeline
    receives_bounds: bool  # a middle stage that receives the document boundaries
    peer: int  # the stage at the other end of the first-to-last link
    middle_peers: tuple[int, ...]  # the middle stages a reading rank sends document boundaries to


def stage_role(info: RankInfo, tensor_parallel: TensorParallelMode, documents: bool) -> StageRole:
    """This rank's role, from its place in the pipeline, the tensor-parallel mode and inter-document masking."""
    first, last = info.pp_rank == 0, info.is_last_stage
    holder = tensor_parallel == "read" or info.tp_rank == 0  # the TP ranks that call next()
    reads = first and holder
    return StageRole(
        reads=reads,
        receives=last and not first and holder,
        # Attention needs the document boundaries on every stage: middle stages receive them too.
        receives_bounds=documents and not first and not last and holder,
        peer=info.pp_group_ranks[-1] if reads and not last else info.first_stage_rank,
        middle_peers=info.pp_group_ranks[1:-1] if reads and documents else (),
    )


def link_tensors(
    spec: DatasetSpec, micro_batch_size: int, documents: bool
) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The tensors the first stage sends its last stage, and those it sends middle stages (document bounds)."""
    b, s = micro_batch_size, spec.seq_length
    # The last stage derives its fields from what the first sends: text, and the loader's extra
    # fields (the loss_mask of bestfit or of loss-mask shards, the document boundaries) when there are any.
    link_specs = [TensorSpec("text", (b, s + 1), torch.int64), TensorSpec("sample_id", (b,), torch.int64)]
    if spec.packing == "bestfit" or spec_has_masks(spec):
        link_specs.append(TensorSpec("loss_mask", (b, s), torch.float32))
    if documents:
        link_specs += [TensorSpec("cu_seqlens", (b, s + 1), torch.int32), TensorSpec("max_seqlen", (b,), torch.int32),
                       TensorSpec("position_ids", (b, s), torch.int64)]  # fmt: skip
    bounds_specs = [TensorSpec("cu_seqlens", (b, s + 1), torch.int32), TensorSpec("max_seqlen", (b,), torch.int32),
                    TensorSpec("sample_id", (b,), torch.int64)]  # fmt: skip
    return link_specs, bounds_specs
