"""A drop-in for Nanotron's train dataloader: its micro-batch format, its pipeline roles, its resume integer.

Nanotron's trainer draws ``n_micro_batches_per_batch`` micro-batches per step with
``batch = (next(dataloader) for _ in range(n))`` on **every** rank and hands that generator to
the pipeline engine, which pulls from it lazily while it schedules forwards and backwards. Each
micro-batch is a dict with ``input_ids``, ``input_mask``, ``label_ids`` and ``label_mask``
(``[micro_batch_size, sequence_length]``); on a pipeline stage that does not hold a tensor, the
value is a ``TensorPointer(group_rank=...)`` naming the stage that does. Its collator
(``DataCollatorForCLM``) builds them from ``[sequence_length + 1]`` token rows: inputs drop the
last token, labels drop the first, masks are all True, and context-parallel ranks keep a
contiguous slice of the sequence.

:func:`build_nanotron_dataloader` returns an iterator with that behaviour, called identically
on every rank:

- **input stage** (``input_pp_rank``, the first stage by default): the only rank that reads
  shards. Every TP (and CP) rank of it runs its own :class:`~statefulset.loading.loader.SavableLoader`
  over the same DP slice, as Nanotron does, so there is no TP broadcast. Rows follow the
  contract's layout: DP rank ``r`` of ``W``, micro-batch ``t``, row ``j`` holds global stream
  position ``consumed_train_samples + (t*W + r)*micro_batch_size + j``.
- **output stage** (``output_pp_rank``, the last stage by default): gets the raw ``text`` rows
  from the input stage of its own pipeline over a :class:`~statefulset.parallel.transfer.StageLink` and
  derives ``label_ids``/``label_mask`` with the same function. Labels therefore cannot drift from
  inputs, and shards are read once per pipeline, not twice.
- **other stages**: yield four ``TensorPointer``s per ``next()``, forever, with no I/O, so they
  step in lockstep like Nanotron's ``EmptyInfiniteDataset``.

Why the lazy draw cannot deadlock: the input stage's sends are ``isend`` (it never waits for the
output stage's schedule) and at most ``send_depth`` of them are in flight; the default,
``n_micro_batches_per_batch + pp``, exceeds the number of micro-batches a pipeline schedule can
draw on the input stage before the output stage has received the first of them (at most one
step: the input stage cannot finish a step's backwards before the output stage computed every
loss of that step, each of which needed its labels). The output stage's ``recv`` of micro-batch
``i`` waits only for the input stage's draw ``i``, which precedes the input stage's forward ``i``
that the output stage waits for anyway.

Resume is Nanotron's: pass the checkpoint's ``consumed_train_samples`` (``+= micro_batch_size *
n_micro_batches_per_batch * dp`` per step). It is a global stream position, so it resumes exactly
into any DP size, micro-batch size or accumulation count; see :func:`build_nanotron_dataloader`.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch

from statefulset.errors import StatefulsetError, check_int
from statefulset.integrations.nanotron.context import (
    ParallelContextLike,
    check_context_groups,
    layout_from_parallel_context,
)
from statefulset.integrations.nanotron.loader import NanotronDataLoader
from statefulset.loading.datasets import get_train_dataset
from statefulset.loading.loader import SavableLoader, get_savable_loader
from statefulset.loading.worker_config import WorkerConfig
from statefulset.parallel.groups import create_parallel_groups, raise_on_every_rank
from statefulset.parallel.layout import ParallelLayout
from statefulset.parallel.transfer import StageLink, TensorSpec
from statefulset.spec.model import DatasetSpec, load_spec
from statefulset.streams.label_masks import spec_has_masks
from statefulset.transforms.hooks import refuse_custom_batch

__all__ = ["NanotronDataLoader", "build_nanotron_dataloader"]

# get_savable_loader's options, checked on every rank (the loader is only built on the input stage).
_LOADER_OPTIONS = frozenset(inspect.signature(get_savable_loader).parameters) - {"dataset", "worker_config"}


def _link_group(layout: ParallelLayout) -> Any:
    """A group that carries CPU tensors between pipeline stages: the world if it speaks gloo, else new gloo PP groups.

    Creating groups is a collective over the world; every rank calls the builder, with the
    same arguments, so every rank takes the same branch.
    """
    import torch.distributed as dist

    if "gloo" in str(dist.get_backend()).lower():
        return None
    return create_parallel_groups(layout, ("pp",), backend="gloo")["pp"]


def _layout_of(parallel: Any, where: str) -> tuple[ParallelLayout, ParallelContextLike | None]:
    """The layout, and the Nanotron ``ParallelContext`` it came from (None for a ``ParallelLayout``)."""
    if isinstance(parallel, ParallelLayout):
        return parallel, None
    if isinstance(parallel, ParallelContextLike):
        return layout_from_parallel_context(parallel), parallel
    raise StatefulsetError(
        f"{where}: parallel must be a ParallelLayout or a Nanotron ParallelContext, got {type(parallel).__name__}"
    )


def _global_rank(rank: Any, layout: ParallelLayout, where: str) -> tuple[int, bool]:
    """This process's global rank, checked against the layout and torch.distributed, and whether that is initialised."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    if distributed and dist.get_world_size() != layout.world_size:
        raise StatefulsetError(
            f"{where}: the layout has world_size {layout.world_size}, torch.distributed has {dist.get_world_size()}"
        )
    if rank is None:
        rank = dist.get_rank() if distributed else 0
    rank = check_int("rank", rank, 0, where)
    if rank >= layout.world_size:
        raise StatefulsetError(f"{where}: rank {rank} is outside [0, world_size {layout.world_size})")
    if distributed and rank != dist.get_rank():
        raise StatefulsetError(f"{where}: rank {rank} was passed but torch.distributed says {dist.get_rank()}")
    return rank, distributed


def _checked_spec(spec: Any, sequence_length: int | None, layout: ParallelLayout, where: str) -> DatasetSpec:
    """The parsed spec, its ``seq_length`` checked against the trainer's and the CP size.

    Every rank parses the spec (no shard reads), so a bad spec fails on every rank, not only where data is read.
    """
    parsed = spec if isinstance(spec, DatasetSpec) else load_spec(spec)
    seq_length = parsed.seq_length
    if sequence_length is not None and check_int("sequence_length", sequence_length, 1, where) != seq_length:
        raise StatefulsetError(
            f"{where}: sequence_length {sequence_length} (the trainer's tokens.sequence_length) differs from the "
            f"spec's seq_length {seq_length} ({parsed.source})"
        )
    if seq_length % layout.cp:
        raise StatefulsetError(
            f"{where}: the spec's seq_length {seq_length} is not divisible by cp {layout.cp} "
            f"({parsed.source}; Nanotron's collator needs equal context-parallel slices)"
        )
    return parsed


def _link_specs(parsed: DatasetSpec, micro_batch_size: int) -> list[TensorSpec]:
    """What travels from the input stage to the output stage per micro-batch."""
    seq_length = parsed.seq_length
    specs = [
        TensorSpec("text", (micro_batch_size, seq_length + 1), torch.int64),
        TensorSpec("sample_id", (micro_batch_size,), torch.int64),
    ]
    if parsed.packing == "bestfit" or spec_has_masks(parsed):  # the output stage masks padding and prompts
        specs.append(TensorSpec("loss_mask", (micro_batch_size, seq_length), torch.float32))
    return specs


def _input_loader(
    parsed: DatasetSpec,
    wc: WorkerConfig,
    micro_batch_size: int,
    consumed: int,
    position_ids: bool,
    task_encoder: Any,
    loader_options: dict[str, Any],
) -> SavableLoader:
    """The input stage's savable loader over this DP rank's slice, placed at ``consumed``."""
    dataset = get_train_dataset(
        parsed, batch_size=micro_batch_size, worker_config=wc, document_boundaries=bool(position_ids),
        task_encoder=task_encoder,
    )  # fmt: skip
    loader = get_savable_loader(dataset, **loader_options)
    if consumed:
        loader.restore_consumed_samples(consumed)
    return loader


def build_nanotron_dataloader(
    spec: str | os.PathLike[str] | Mapping[str, Any] | DatasetSpec,
    parallel: ParallelLayout | ParallelContextLike,
    rank: int | None = None,
    *,
    micro_batch_size: int,
    n_micro_batches_per_batch: int = 1,
    consumed_train_samples: int = 0,
    input_pp_rank: int = 0,
    output_pp_rank: int | None = None,
    sequence_length: int | None = None,
    num_workers: int = 0,
    data_parallel_group: Any = None,
    link_group: Any = None,
    send_depth: int | None = None,
    include_sample_id: bool = False,
    seed_offset: int = 0,
    position_ids: bool = False,
    task_encoder: Any = None,
    **loader_options: Any,
) -> NanotronDataLoader:
    """Nanotron's train dataloader for ``spec`` on global ``rank``: call it on every rank with the same arguments.

    ``parallel`` is a :class:`ParallelLayout` (Nanotron's layout is the default order) or a
    Nanotron ``ParallelContext``; from a context, ``dp_pg`` becomes the DP group and its groups'
    ranks are checked against the layout. ``rank`` defaults to ``torch.distributed.get_rank()``
    (0 without torch.distributed).

    ``consumed_train_samples`` is Nanotron's checkpoint metadata (``+= micro_batch_size *
    n_micro_batches_per_batch * dp`` per step). It names the first stream position no rank has
    trained on, so any value resumes exactly: a multiple of the *current* global batch is not
    required, and would be wrong to require, since a run saved with another DP size, micro-batch
    size or accumulation count (or mid-way through a batch-size ramp) legitimately leaves one.

    ``sequence_length``, when given (Nanotron's ``tokens.sequence_length``), must equal the spec's
    ``seq_length``; the micro-batches are ``[micro_batch_size, seq_length]``.

    ``n_micro_batches_per_batch`` is the trainer's ``batch_accumulation_per_replica``; it sizes the
    in-flight window of the input → output stage link (``send_depth``, default ``n + pp``) so the
    input stage never blocks on the output stage within a step. ``num_workers`` and
    ``loader_options`` go to :func:`~statefulset.get_savable_loader` on the input stage.
    ``link_group`` carries the CPU text rows to the output stage: the world when its backend speaks
    gloo, otherwise gloo PP groups created here (a collective). ``include_sample_id`` adds
    ``sample_id`` (int64 ``[micro_batch_size]``, the rows' global positions) for checks and logs;
    leave it off when the model's forward takes ``**micro_batch``. ``position_ids=True`` gives the
    micro-batch of Nanotron's ``DataCollatorForCLMWithPositionIds`` (``input_ids``,
    ``position_ids`` restarting at every document of the shard index, ``label_ids``,
    ``label_mask``). With packing bestfit, ``label_mask`` is False on padded labels.
    ``task_encoder`` runs over the samples (docs/transforms.md); its ``encode_sample`` fields are
    collated and formatted as usual, so an encoder defining ``batch`` is refused.
    """
    where = "build_nanotron_dataloader"
    refuse_custom_batch(task_encoder, where, "the dataloader formats Nanotron's batches itself")
    unknown = sorted(set(loader_options) - _LOADER_OPTIONS)
    if unknown:
        raise StatefulsetError(f"{where}: unknown keyword argument(s): {', '.join(unknown)}")
    layout, context = _layout_of(parallel, where)
    rank, distributed = _global_rank(rank, layout, where)
    where = f"{where} (global rank {rank})"
    micro_batch_size = check_int("micro_batch_size", micro_batch_size, 1, where)
    n_micro = check_int("n_micro_batches_per_batch", n_micro_batches_per_batch, 1, where)
    consumed = check_int("consumed_train_samples", consumed_train_samples, 0, where)
    if consumed >= 2**62:
        raise StatefulsetError(f"{where}: consumed_train_samples {consumed} is beyond any stream (>= 2**62)")
    input_pp_rank = check_int("input_pp_rank", input_pp_rank, 0, where)
    output_pp_rank = layout.pp - 1 if output_pp_rank is None else check_int("output_pp_rank", output_pp_rank, 0, where)
    for name, value in (("input_pp_rank", input_pp_rank), ("output_pp_rank", output_pp_rank)):
        if value >= layout.pp:
            raise StatefulsetError(f"{where}: {name} {value} is outside the pipeline [0, pp {layout.pp})")
    depth = n_micro + layout.pp if send_depth is None else check_int("send_depth", send_depth, 1, where)
    info = layout.rank_info(rank)
    # Errors only some ranks can see are raised on every rank (raise_on_every_rank below), after
    # every rank has passed the same collectives, so none is left waiting for a peer that gave up.
    errors: list[str | None] = []
    if context is not None:
        try:
            check_context_groups(context, info)
        except StatefulsetError as error:
            errors.append(str(error))
        if data_parallel_group is None:
            data_parallel_group = getattr(context, "dp_pg", None)

    parsed = _checked_spec(spec, sequence_length, layout, where)
    needs_link = input_pp_rank != output_pp_rank
    group = None
    if needs_link:
        if not distributed:
            raise StatefulsetError(
                f"{where}: input_pp_rank {input_pp_rank} != output_pp_rank {output_pp_rank} needs torch.distributed "
                "(labels travel from the input stage to the output stage), which is not initialised"
            )
        group = link_group if link_group is not None else _link_group(layout)

    loader = None
    if info.pp_rank == input_pp_rank and not errors:
        try:
            wc = WorkerConfig(
                rank=info.dp_rank,
                world_size=info.dp_size,
                num_workers=check_int("num_workers", num_workers, 0, where),
                data_parallel_group=data_parallel_group,
                seed_offset=seed_offset,
            )
            loader = _input_loader(parsed, wc, micro_batch_size, consumed, position_ids, task_encoder, loader_options)
        except StatefulsetError as error:
            errors.append(f"rank {rank}: {error}")
    if distributed:
        # Only input stages open shards: without this, a corrupt shard would leave the output
        # stage waiting for labels until the gloo timeout instead of failing with the reason.
        raise_on_every_rank(errors)
    elif errors:
        raise StatefulsetError(errors[0])
    specs = _link_specs(parsed, micro_batch_size)
    link = None
    if needs_link and info.pp_rank in (input_pp_rank, output_pp_rank):
        peer = output_pp_rank if info.pp_rank == input_pp_rank else input_pp_rank
        link = StageLink(info.pp_group_ranks[peer], specs, group=group, depth=depth)
    return NanotronDataLoader(
        info,
        micro_batch_size=micro_batch_size,
        sequence_length=parsed.seq_length,
        n_micro_batches_per_batch=n_micro,
        consumed_train_samples=consumed,
        input_pp_rank=input_pp_rank,
        output_pp_rank=output_pp_rank,
        cp_size=layout.cp,
        loader=loader,
        link=link,
        include_sample_id=bool(include_sample_id),
        position_ids=bool(position_ids),
    )
