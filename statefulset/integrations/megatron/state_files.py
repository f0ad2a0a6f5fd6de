"""Megatron-LM's dataloader state files: the flag that turns them on, where they go, reading them back.

Stock Megatron-LM's ``save_checkpoint`` calls ``maybe_save_dataloader_state(train_iterator,
iteration, getattr(args, "dataloader_save", None))``, which stores ``{"dataloader_state_dict":
train_iterator.iterable.save_state()}`` once per DP rank, but only when ``args.dataloader_save``
is set, and ``megatron/training/arguments.py`` defines no such argument: ``pretrain_gpt.py``
rejects ``--dataloader-save`` unless an ``extra_args_provider`` adds it (Megatron-LM's own
multimodal example does). Without it, no loader state is saved, silently. Megatron-LM never reads
the files back. Checked against Megatron-LM core_v0.16.1, core_v0.17.1, core_v0.18.2, core_v0.19.0
and main at d98e8a6.

- :func:`add_statefulset_args`: the ``extra_args_provider`` (``--dataloader-save``, ``--statefulset-spec``).
- :func:`layout_from_megatron_args`: the :class:`ParallelLayout` of ``get_args()``.
- :func:`load_megatron_dataloader_state_from_args`: this rank's state on resume, or None with a
  log line that says why (never an ``AttributeError`` on stock args).
- :func:`megatron_dataloader_state_path` / :func:`save_megatron_dataloader_state` /
  :func:`load_megatron_dataloader_state`: the files themselves, for any loop.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch

from statefulset.errors import StatefulsetError
from statefulset.loading.state import check_state
from statefulset.parallel.layout import ParallelLayout

logger = logging.getLogger("statefulset")

__all__ = [
    "add_statefulset_args",
    "layout_from_megatron_args",
    "load_megatron_dataloader_state",
    "load_megatron_dataloader_state_from_args",
    "megatron_dataloader_state_path",
    "save_megatron_dataloader_state",
]


# -- Megatron-LM's arguments --------------------------------------------------------------------
def add_statefulset_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM ``extra_args_provider``: adds ``--dataloader-save DIR`` and ``--statefulset-spec YAML``.

    ``--dataloader-save`` sets ``args.dataloader_save``, the attribute stock ``save_checkpoint``
    reads; it is skipped when the parser already has it (chained after a provider that adds it).
    Chain with another provider as ``lambda p: add_statefulset_args(other(p))``.
    """
    group = parser.add_argument_group(title="statefulset")
    if not any("--dataloader-save" in action.option_strings for action in parser._actions):
        group.add_argument(
            "--dataloader-save",
            type=str,
            default=None,
            help="folder for the per-DP-rank loader states save_checkpoint writes (e.g. $SAVE/dataloader)",
        )
    group.add_argument("--statefulset-spec", type=str, default=None, help="the statefulset dataset spec (YAML)")
    return parser


def layout_from_megatron_args(args: Any) -> ParallelLayout:
    """The :class:`ParallelLayout` of Megatron-LM's ``get_args()``: its sizes, and the rank order
    ``--use-tp-pp-dp-mapping`` picks (megatron-core's ``tp-cp-ep-pp-dp``, else ``tp-cp-ep-dp-pp``)."""
    where = "layout_from_megatron_args"
    if not hasattr(args, "world_size"):
        raise StatefulsetError(f"{where}: args has no world_size; pass Megatron-LM's get_args() after initialisation")
    return ParallelLayout(
        args.world_size,
        tp=getattr(args, "tensor_model_parallel_size", 1) or 1,
        pp=getattr(args, "pipeline_model_parallel_size", 1) or 1,
        cp=getattr(args, "context_parallel_size", 1) or 1,
        ep=getattr(args, "expert_model_parallel_size", 1) or 1,
        order="tp-cp-ep-pp-dp" if getattr(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-dp-pp",
    )


def _saver_expert_rank(layout: ParallelLayout, rank: int) -> int:
    """The expert rank of the rank that saves this rank's DP state (first stage, TP 0, CP 0)."""
    info = layout.rank_info(rank)
    saver = layout.rank_info(layout.rank_info(info.first_stage_rank).tp_src_rank).cp_group_ranks[0]
    return layout.rank_info(saver).ep_rank


def load_megatron_dataloader_state_from_args(
    args: Any, layout: ParallelLayout, rank: int | None = None
) -> dict[str, Any] | None:
    """This rank's loader state for a resume under stock Megatron-LM, or None, with a log line saying why.

    Reads ``args.dataloader_save`` (set by :func:`add_statefulset_args`), ``args.iteration``
    (restored by ``load_checkpoint``) and ``args.dataloader_type``; missing attributes count as
    unset. None: no ``--dataloader-save`` (a warning: Megatron-LM will save no loader state, and
    the resume relies on ``consumed_train_samples`` alone), iteration 0, a rank that reads no
    data, or no file for this DP rank (a warning naming the path; expected after the DP size grew).
    With expert parallelism both file names are tried: main's (no expert suffix) and that of
    core_v0.16 to 0.18, whose name carries the saving rank's expert rank.
    """
    rank = rank if rank is not None else (torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
    info = layout.rank_info(rank)
    dataloader_type = getattr(args, "dataloader_type", None)
    if dataloader_type not in (None, "external"):
        raise StatefulsetError(
            f"Megatron-LM args: --dataloader-type is {dataloader_type!r}; statefulset's iterators need "
            "--dataloader-type external (Megatron-LM would wrap them in its own sampler)"
        )
    folder = getattr(args, "dataloader_save", None) or None
    iteration = getattr(args, "iteration", 0) or 0
    if folder is None:
        if rank == 0:
            logger.warning(
                "statefulset: args.dataloader_save is not set, so Megatron-LM will save no loader state "
                "and a resume relies on consumed_train_samples alone; pass extra_args_provider="
                "add_statefulset_args and --dataloader-save DIR (a folder of its own, e.g. $SAVE/dataloader)"
            )
        return None
    if iteration == 0 or not info.loads_data:
        if rank == 0:
            logger.info("statefulset: loader states go to %s at every checkpoint", folder)
        return None
    pipeline = layout.pp > 1
    # core_v0.19 and main (since 0a7f372) name the file without an expert suffix; core_v0.16 to 0.18 add
    # the saver's expert rank.
    experts = [None, _saver_expert_rank(layout, rank)] if layout.ep > 1 else [None]
    paths = [
        megatron_dataloader_state_path(folder, iteration, info.dp_rank, pipeline_parallel=pipeline, expert_rank=e)
        for e in experts
    ]
    for path, expert in zip(paths, experts, strict=True):
        if os.path.exists(path):
            if info.saves_state:
                logger.info("statefulset: resuming DP rank %d from %s", info.dp_rank, path)
            return load_megatron_dataloader_state(
                folder, iteration, info.dp_rank, pipeline_parallel=pipeline, expert_rank=expert
            )
    if info.saves_state:
        logger.warning(
            "statefulset: %s does not exist: no loader state for DP rank %d at iteration %d (a new DP rank after "
            "the DP size grew, or a checkpoint saved without --dataloader-save); resuming from "
            "consumed_train_samples alone",
            paths[0],
            info.dp_rank,
            iteration,
        )
    return None


# -- the files ----------------------------------------------------------------------------------
def megatron_dataloader_state_path(
    save_dir: str | os.PathLike[str],
    iteration: int,
    dp_rank: int,
    *,
    pipeline_parallel: bool,
    expert_rank: int | None = None,
) -> str:
    """Where Megatron-LM's ``maybe_save_dataloader_state`` puts DP rank ``dp_rank``'s loader state.

    ``<save_dir>/iter_{iteration:07d}/mp_rank_00[_000][_{expert_rank:03d}]/train_dataloader_dprank{dp:03d}.pt``:
    the directory of TP rank 0 and pipeline rank 0 (the ranks that save), with the ``_000``
    pipeline suffix when the job runs PP > 1 and an expert suffix with expert parallelism.
    """
    for name, value in (("iteration", iteration), ("dp_rank", dp_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise StatefulsetError(f"megatron_dataloader_state_path: {name} must be a non-negative int, got {value!r}")
    folder = "mp_rank_00_000" if pipeline_parallel else "mp_rank_00"
    if expert_rank is not None:
        folder += f"_{expert_rank:03d}"
    name = f"train_dataloader_dprank{dp_rank:03d}.pt"
    return os.path.join(os.fspath(save_dir), f"iter_{iteration:07d}", folder, name)


def save_megatron_dataloader_state(
    iterator: Any,
    save_dir: str | os.PathLike[str],
    iteration: int,
    dp_rank: int,
    *,
    pipeline_parallel: bool,
    expert_rank: int | None = None,
) -> str | None:
    """Write ``{"dataloader_state_dict": iterator.save_state()}`` where Megatron-LM would; return the path.

    For loops that do not run Megatron-LM's ``save_checkpoint``. Call it on the saving rank of
    each DP rank (first stage, TP rank 0). Writes to a temporary name and renames, so a crash
    never leaves a truncated file. Returns None (writing nothing) when the state is None.
    """
    source = getattr(iterator, "iterable", iterator)  # a RerunDataIterator or ours
    state = source.save_state()
    if state is None:
        return None
    path = megatron_dataloader_state_path(
        save_dir, iteration, dp_rank, pipeline_parallel=pipeline_parallel, expert_rank=expert_rank
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save({"dataloader_state_dict": state}, tmp)
    os.replace(tmp, path)
    return path


def load_megatron_dataloader_state(
    load_dir: str | os.PathLike[str],
    iteration: int,
    dp_rank: int,
    *,
    pipeline_parallel: bool,
    expert_rank: int | None = None,
    missing_ok: bool = False,
) -> dict[str, Any] | None:
    """The loader state in DP rank ``dp_rank``'s ``train_dataloader_dprank*.pt`` (``weights_only`` load).

    A missing file raises :class:`StatefulsetError` naming the path, or returns None with
    ``missing_ok`` (for example after the DP size grew; resume from ``consumed_train_samples``).
    """
    path = megatron_dataloader_state_path(
        load_dir, iteration, dp_rank, pipeline_parallel=pipeline_parallel, expert_rank=expert_rank
    )
    if not os.path.exists(path):
        if missing_ok:
            return None
        raise StatefulsetError(f"{path}: no dataloader state for DP rank {dp_rank} at iteration {iteration}")
    try:
        saved = torch.load(path, weights_only=True)
    except Exception as exc:  # torch raises many types for a damaged file
        raise StatefulsetError(f"{path}: cannot read the dataloader state: {exc}") from None
    if not isinstance(saved, dict) or "dataloader_state_dict" not in saved:
        raise StatefulsetError(f"{path}: not a Megatron dataloader state file (no 'dataloader_state_dict')")
    state = saved["dataloader_state_dict"]
    check_state(state, path)
    return state
