"""Nanotron's ``ParallelContext`` as a :class:`~statefulset.parallel.layout.ParallelLayout`, checked
against its process groups.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from statefulset.errors import StatefulsetError, check_int
from statefulset.parallel.layout import ParallelLayout, RankInfo


@runtime_checkable
class ParallelContextLike(Protocol):
    """The part of Nanotron's ``ParallelContext`` the builder reads (sizes; groups when present).

    ``tp_pg``, ``pp_pg``, ``dp_pg`` and ``cp_pg`` are optional: when present and torch.distributed
    is initialised, this rank's coordinates in them are checked against the derived layout.
    """

    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int


def layout_from_parallel_context(context: Any) -> ParallelLayout:
    """The :class:`ParallelLayout` of a Nanotron ``ParallelContext`` (or any object with its size attributes).

    Nanotron lays ranks out as ``reshape(ep, pp, dp, cp, tp)``: TP fastest, then CP, DP, PP, which
    is megatron-core's default order. Expert parallelism > 1 is refused: Nanotron counts its
    world without it, so its rank grid is not a dense layout this module can reproduce.
    """
    where = f"layout_from_parallel_context({type(context).__name__})"
    sizes = {}
    for attr in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if not hasattr(context, attr):
            raise StatefulsetError(f"{where}: the parallel context has no attribute {attr!r}")
        sizes[attr] = check_int(attr, getattr(context, attr), 1, where)
    cp = check_int("context_parallel_size", getattr(context, "context_parallel_size", 1), 1, where)
    ep = check_int("expert_parallel_size", getattr(context, "expert_parallel_size", 1), 1, where)
    if ep != 1:
        raise StatefulsetError(f"{where}: expert_parallel_size {ep} is not supported (dense data path only)")
    tp, pp, dp = sizes["tensor_parallel_size"], sizes["pipeline_parallel_size"], sizes["data_parallel_size"]
    return ParallelLayout(tp * cp * dp * pp, tp=tp, pp=pp, cp=cp)


def check_context_groups(context: Any, info: RankInfo) -> None:
    """Raise when the context's process groups disagree with the layout-derived coordinates."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    for group_attr, name, expected in (
        ("tp_pg", "tp_rank", info.tp_rank),
        ("cp_pg", "cp_rank", info.cp_rank),
        ("dp_pg", "dp_rank", info.dp_rank),
        ("pp_pg", "pp_rank", info.pp_rank),
    ):
        group = getattr(context, group_attr, None)
        if group is None:
            continue
        actual = dist.get_rank(group)
        if actual != expected:
            raise StatefulsetError(
                f"build_nanotron_dataloader: global rank {info.global_rank} is {name} {actual} in the context's "
                f"{group_attr} but {expected} in the Megatron/Nanotron rank order; the context uses another layout"
            )
