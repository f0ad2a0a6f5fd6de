"""Process groups of a :class:`~statefulset.parallel.layout.ParallelLayout`, and errors raised on every rank alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from statefulset.errors import StatefulsetError
from statefulset.parallel.layout import ParallelLayout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["create_data_parallel_groups", "create_parallel_groups", "raise_on_every_rank"]


def _require_world(layout: ParallelLayout) -> int:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise StatefulsetError("create_parallel_groups: torch.distributed is not initialised")
    world = dist.get_world_size()
    if world != layout.world_size:
        raise StatefulsetError(
            f"create_parallel_groups: layout world_size {layout.world_size} != torch.distributed world size {world}"
        )
    return dist.get_rank()


def create_parallel_groups(
    layout: ParallelLayout, kinds: Sequence[str] = ("dp", "tp", "pp"), backend: str | None = None
) -> dict[str, ProcessGroup]:
    """Create the process groups of ``layout`` for each kind and return this rank's, keyed by kind.

    A collective: ``torch.distributed.new_group`` must be called by every rank for every group in
    the same order, so every rank calls this with the same arguments. Each call creates new
    communicators (expensive with NCCL); call it once at start-up. The loader needs ``"dp"``
    (state gathering), ``"tp"`` (broadcasting a batch from TP rank 0) and ``"pp"`` (sending
    from the first stage); any kind :meth:`ParallelLayout.groups` accepts works.

    ``torch.distributed`` numbers a group's members in ascending global rank. For the single
    kinds (``"tp"``, ``"cp"``, ``"dp"``, ``"pp"``) members ascend with their coordinate, so the
    group rank equals ``tp_rank`` / ``cp_rank`` / ``dp_rank`` / ``pp_rank``.
    """
    import torch.distributed as dist

    rank = _require_world(layout)
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    if len(set(kinds)) != len(kinds):
        raise StatefulsetError(f"create_parallel_groups: kinds {kinds!r} repeats a kind")
    # Compute everything before the first collective so a bad kind fails on every rank alike.
    plans = {kind: layout.groups(kind) for kind in kinds}
    mine: dict[str, ProcessGroup] = {}
    for kind, groups in plans.items():
        for ranks in groups:
            group = dist.new_group(ranks=ranks, backend=backend)
            if rank in ranks:
                mine[kind] = group
    return mine


def create_data_parallel_groups(layout: ParallelLayout, backend: str | None = None) -> ProcessGroup:
    """Create every DP group of ``layout`` (a collective over the world) and return this rank's.

    Unlike the Energon guide, which only builds DP groups among loading ranks, every rank gets
    its DP group, as in Megatron: later stages' groups are simply never used by a loader.
    Pass the result as ``WorkerConfig(data_parallel_group=...)``.
    """
    return create_parallel_groups(layout, ("dp",), backend)["dp"]


def raise_on_every_rank(errors: Sequence[str | None], group: Any = None) -> None:
    """A collective: raise ``StatefulsetError`` on every rank of ``group`` when any rank had an error.

    A builder that fails on one rank (a corrupt shard, a state that does not fit) would leave its
    peers waiting in their next collective until a timeout; this turns that into the same error
    everywhere, naming the rank. Without torch.distributed it raises this rank's own errors.
    """
    import torch.distributed as dist

    mine = "; ".join(e for e in errors if e) or None
    if dist.is_available() and dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
    else:
        gathered = [mine]
    failed = [g for g in gathered if g]
    if failed:
        raise StatefulsetError(failed[0] if len(failed) == 1 else f"{failed[0]} (and {len(failed) - 1} more)")
