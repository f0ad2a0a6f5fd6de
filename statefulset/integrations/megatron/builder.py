""":func:`build_megatron_iterators`: this rank's train / valid / test iterators for Megatron-LM training.

Megatron-LM's GPT recipe reads the same samples twice: TP rank 0 of the first stage for
``tokens``, TP rank 0 of the last stage for ``labels`` and ``loss_mask``, each through its own
``GPTDataset`` + ``MegatronPretrainingSampler``, trusting that both reads agree. Here one loader
per DP rank lives on the first stage; it sends the raw ``text`` rows to the last stage of its own
pipeline, which derives labels and masks with the same pure function
(:func:`~statefulset.integrations.megatron.batch.gpt_batch`).
The resume point is Megatron's own ``consumed_train_samples`` (any DP size) or the Energon-style
state ``maybe_save_dataloader_state`` writes per DP rank.

Called on every rank (it creates process groups, a collective); returns a :class:`MegatronData`
whose ``train`` / ``valid`` / ``test`` are what ``train_valid_test_datasets_provider`` returns
under ``--dataloader-type external``; :meth:`MegatronData.get_batch` is Megatron's ``get_batch`` +
``get_batch_on_this_tp_rank`` for users' own loops.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from statefulset.errors import StatefulsetError, check_int
from statefulset.integrations.megatron.batch import Format, GPTBatch, GPTBatchConfig, GPTDocumentBatch, format_batch
from statefulset.integrations.megatron.iterators import SPLIT_TAGS, MegatronIterator, TensorParallelMode
from statefulset.integrations.megatron.resume import restore_train, unwrap_state
from statefulset.integrations.megatron.stages import link_tensors, stage_role
from statefulset.loading.datasets import get_train_dataset, get_val_dataset
from statefulset.loading.loader import SavableLoader, get_loader, get_savable_loader
from statefulset.loading.worker_config import WorkerConfig
from statefulset.parallel.groups import create_parallel_groups, raise_on_every_rank
from statefulset.parallel.layout import ParallelLayout, RankInfo
from statefulset.parallel.transfer import LINK_TAG, StageLink, TensorSpec, broadcast_batch
from statefulset.spec.model import DatasetSpec, load_spec
from statefulset.transforms.hooks import refuse_custom_batch


# -- builder ------------------------------------------------------------------------------------
@dataclass
class MegatronData:
    """This rank's iterators and what :meth:`get_batch` needs to move their batches.

    ``train`` / ``valid`` / ``test`` are None where Megatron's ``get_batch`` never touches the
    iterator (middle stages, unless ``inter_document_masking`` gives them the document boundaries;
    TP ranks > 0 in ``"broadcast"`` mode) and for empty splits.
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
            if which not in SPLIT_TAGS:
                raise StatefulsetError(f"get_batch: split must be train, valid or test, got {which!r}")
            return getattr(self, which)
        return which

    def _keys(self) -> tuple[str, ...]:
        """The keys Megatron's ``get_batch_on_this_tp_rank`` moves on this rank's stage."""
        first, last = self.info.pp_rank == 0, self.info.is_last_stage
        documents = self.batch_config.inter_document_masking
        if documents and not first and not last:
            return ("cu_seqlens", "max_seqlen", "sample_id")
        mask = ("attention_mask",) if self.batch_config.create_attention_mask and not documents else ()
        bounds = ("cu_seqlens", "max_seqlen") if documents else ()
        if first and last:
            return ("tokens", "labels", "loss_mask", *mask, "position_ids", *bounds, "sample_id")
        if first:
            return ("tokens", *mask, "position_ids", *bounds, "sample_id")
        if last:
            return ("labels", "loss_mask", *mask, *bounds, "sample_id")
        return ()

    def _specs(self, keys: tuple[str, ...]) -> list[TensorSpec]:
        b, s = self.micro_batch_size, self.seq_length
        shapes = {
            "tokens": ((b, s), torch.int64),
            "labels": ((b, s), torch.int64),
            "loss_mask": ((b, s), torch.float32),
            "position_ids": ((b, s), torch.int64),
            "attention_mask": ((b, 1, s, s), torch.bool),
            "cu_seqlens": ((b, s + 1), torch.int32),
            "max_seqlen": ((b,), torch.int32),
            "sample_id": ((b,), torch.int64),
        }
        return [TensorSpec(k, *shapes[k]) for k in keys]

    def get_batch(
        self, which: str | MegatronIterator | None = "train", device: torch.device | str | None = None
    ) -> GPTBatch | GPTDocumentBatch:
        """Megatron's ``get_batch`` + ``get_batch_on_this_tp_rank`` for a loop of your own.

        Call it on every rank once per micro-batch (middle stages return at once, never
        touching an iterator, except with ``inter_document_masking``, where they receive
        ``cu_seqlens`` and ``max_seqlen`` from their first stage, as Megatron-LM broadcasts them).
        In ``"broadcast"`` mode TP rank 0 takes the next batch and
        broadcasts this stage's tensors over the TP group; in ``"read"`` mode every TP rank
        already holds the same batch. ``which`` is ``"train"``, ``"valid"``, ``"test"`` or an
        iterator. ``device`` moves tensors there before the broadcast (use a TP group of the
        matching backend, e.g. Megatron's NCCL TP group, via ``groups=`` of the builder).
        """
        keys = self._keys()
        if not keys:
            if self.batch_config.inter_document_masking:
                return GPTDocumentBatch(None, None, None, None, None, None, None, None)
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
                raw = format_batch(raw, "gpt", self.batch_config)
            batch = {k: raw[k].to(device) if device is not None else raw[k] for k in keys}
        if broadcast:
            batch = broadcast_batch(
                batch, self._specs(keys), src=self.info.tp_src_rank, group=self.groups.get("tp"), device=device
            )
        if batch is None:  # unreachable: a rank either holds the batch or receives the broadcast
            raise StatefulsetError(f"get_batch: rank {self.info.global_rank} got no batch")
        if self.batch_config.inter_document_masking:
            return GPTDocumentBatch(
                tokens=batch.get("tokens"),
                labels=batch.get("labels"),
                loss_mask=batch.get("loss_mask"),
                attention_mask=None,
                position_ids=batch.get("position_ids"),
                cu_seqlens=batch.get("cu_seqlens"),
                max_seqlen=batch.get("max_seqlen"),
                sample_id=batch.get("sample_id"),
            )
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
    task_encoder: Any = None,
    **loader_options: Any,
) -> MegatronData:
    """Build this rank's Megatron iterators; call it on **every** rank, with the same arguments.

    Roles (from ``layout.rank_info(rank)``):

    - first stage: a reading train iterator; in ``"broadcast"`` mode only TP rank 0 reads (its
      TP peers get None and receive tensors in :meth:`MegatronData.get_batch`, as Megatron's
      ``get_batch_on_this_tp_rank`` does), in ``"read"`` mode every TP rank reads the same samples;
    - last stage (PP > 1): a receiving iterator fed over a :class:`StageLink` by the first
      stage of its own pipeline (never a second loader);
    - middle stages: None; with ``batch_config.inter_document_masking`` a receiving iterator of
      ``cu_seqlens``, ``max_seqlen`` and ``sample_id`` (attention needs them on every stage).

    Resume: ``consumed_train_samples`` is Megatron's global counter (any DP or micro-batch size
    resumes from it); ``state`` is this DP rank's saved loader state (``save_state()``'s return
    or the dict in ``train_dataloader_dprank*.pt``), checked against the data; when both are
    given they must agree. Only reading ranks use them. Valid/test never resume mid-stream.

    ``groups`` may hold ready process groups ``"tp"`` (broadcast in ``get_batch``), ``"pp"``
    (the stage link) and ``"dp"`` (the loader's DP group); missing ones are created here with the
    gloo backend (batches travel as CPU tensors), which is why every rank must call this.
    Errors on any rank are raised on every rank. ``loader_options`` go to ``get_savable_loader``.
    ``task_encoder``: run over every split's samples (docs/transforms.md); its ``encode_sample``
    fields are collated and formatted as usual, so an encoder defining ``batch`` is refused.
    """
    refuse_custom_batch(task_encoder, "build_megatron_iterators", "the builder formats Megatron-LM's batches itself")
    rank, info = _rank_info(layout, rank)
    micro_batch_size, config = _check_options(
        micro_batch_size, tensor_parallel, format, consumed_train_samples, batch_config
    )
    depth = link_depth if link_depth is not None else max(4, 2 * layout.pp)
    spec = spec if isinstance(spec, DatasetSpec) else load_spec(spec)

    # Collective part first, identical on every rank.
    groups = dict(groups or {})
    missing = [kind for kind in ("dp", "tp", "pp") if kind not in groups]
    if missing and dist.is_available() and dist.is_initialized():
        groups.update(create_parallel_groups(layout, missing, backend="gloo"))

    documents = config.inter_document_masking
    role = stage_role(info, tensor_parallel, documents)
    link_specs, bounds_specs = link_tensors(spec, micro_batch_size, documents)
    built: dict[str, MegatronIterator | None] = {"train": None, "valid": None, "test": None}
    errors: list[str | None] = []
    wanted = {"train": True, "valid": valid, "test": test}
    for split, want in wanted.items():
        if not want or spec.blend_for(split) is None or not (role.reads or role.receives or role.receives_bounds):
            continue
        link = None
        tag = LINK_TAG + SPLIT_TAGS[split]
        if role.receives_bounds:
            link = StageLink(info.first_stage_rank, bounds_specs, group=groups.get("pp"), tag=tag, depth=depth)
            built[split] = MegatronIterator(split, format, config, link=link, receive=True)
            continue
        if layout.pp > 1:
            link = StageLink(role.peer, link_specs, group=groups.get("pp"), tag=tag, depth=depth)
        fanout = [StageLink(p, bounds_specs, group=groups.get("pp"), tag=tag, depth=depth) for p in role.middle_peers]
        if role.receives:
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
                loader = _train_loader(spec, wc, micro_batch_size, documents, task_encoder, loader_options)
                restore_train(loader, unwrap_state(state), consumed_train_samples, info, micro_batch_size)
            else:
                loader = _eval_loader(spec, split, wc, info, micro_batch_size, documents, task_encoder, loader_options)
            built[split] = MegatronIterator(
                split, format, config, loader=loader, link=link, fanout=fanout, cyclic=split != "train"
            )
        except StatefulsetError as error:
            errors.append(f"rank {rank}: {error}" if not str(error).startswith("rank ") else str(error))
    raise_on_every_rank(errors)
    return MegatronData(
        train=built["train"],
        valid=built["valid"],
        test=built["test"],
        info=info,
        layout=layout,
        micro_batch_size=micro_batch_size,
        seq_length=spec.seq_length,
        tensor_parallel=tensor_parallel,
        format=format,
        batch_config=config,
        groups=groups,
    )


def _rank_info(layout: ParallelLayout, rank: int | None) -> tuple[int, RankInfo]:
    """This rank (``rank`` or torch.distributed's) and its place in ``layout``, checked against the world."""
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
    return rank, layout.rank_info(rank)


def _check_options(
    micro_batch_size: int,
    tensor_parallel: TensorParallelMode,
    format: Format,
    consumed_train_samples: int | None,
    batch_config: GPTBatchConfig | None,
) -> tuple[int, GPTBatchConfig]:
    """The checked micro-batch size and batch config; refuses a bad mode, format or consumed count."""
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
    return micro_batch_size, config


def _train_loader(
    spec: DatasetSpec,
    wc: WorkerConfig,
    micro_batch_size: int,
    documents: bool,
    task_encoder: Any,
    loader_options: Mapping[str, Any],
) -> SavableLoader:
    """This DP rank's savable loader of the train split (not yet resumed)."""
    dataset = get_train_dataset(
        spec, batch_size=micro_batch_size, worker_config=wc, document_boundaries=documents, task_encoder=task_encoder
    )
    return get_savable_loader(dataset, **loader_options)


def _eval_loader(
    spec: DatasetSpec,
    split: str,
    wc: WorkerConfig,
    info: RankInfo,
    micro_batch_size: int,
    documents: bool,
    task_encoder: Any,
    loader_options: Mapping[str, Any],
) -> Any:
    """This DP rank's loader of the valid or test split; refuses a split smaller than one global batch."""
    b = micro_batch_size
    dataset = get_val_dataset(
        spec, split_part=split, batch_size=b, worker_config=wc, document_boundaries=documents, task_encoder=task_encoder
    )
    if len(dataset) == 0:
        raise StatefulsetError(
            f"{spec.source}: the {split} split has {len(dataset.stream)} samples, fewer than one "
            f"global batch ({info.dp_size} DP ranks x micro_batch_size {b}); pass {split}=False or give "
            "it more data"
        )
    return get_loader(dataset, **loader_options)
