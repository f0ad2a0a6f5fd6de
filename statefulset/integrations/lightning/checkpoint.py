"""The data module's checkpoint entry: every DP rank's loader state, gathered, and its checks on restore.

``StatefulsetDataModule.state_dict()`` holds the loader states of all DP ranks (what was handed to
the trainer), gathered over the DP group so whichever rank writes the checkpoint writes all of
it, plus BioNeMo's ``consumed_samples``. :func:`read_module_state` checks an entry (this module's,
or a NeMo / BioNeMo data module's ``{"consumed_samples": n}``) before anything is restored. No
Lightning import here.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from statefulset.errors import StatefulsetError
from statefulset.loading.loader import SavableLoader
from statefulset.loading.state import check_state
from statefulset.parallel.arrival import meet

FORMAT = "statefulset.datamodule"
VERSION = 1

_WHERE = "StatefulsetDataModule.load_state_dict"


def dp_group(data_parallel_group: Any, dp_size: int) -> Any:
    """The group to gather over: the one given, the world when it is the DP group, else megatron-core's DP group."""
    if data_parallel_group is not None:
        return data_parallel_group
    if dist.get_world_size() == dp_size:
        return None
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_data_parallel_group()
    except ImportError:
        pass
    raise StatefulsetError(
        f"StatefulsetDataModule: DP size {dp_size} differs from the world size {dist.get_world_size()}; "
        "pass data_parallel_group so state_dict() can gather every DP rank's loader state"
    )


def gather_loader_states(
    loader: SavableLoader, dp_rank: int, dp_size: int, data_parallel_group: Any
) -> list[dict[str, Any]]:
    """Every DP rank's ``save_state_rank()``, in DP-rank order, on every rank (a collective over the DP group)."""
    state = loader.save_state_rank()
    if dp_size == 1:
        return [state]
    if not (dist.is_available() and dist.is_initialized()):
        raise StatefulsetError(
            f"StatefulsetDataModule.state_dict: DP size {dp_size} but torch.distributed is not initialised, "
            "so the other DP ranks' loader states cannot be collected"
        )
    group = dp_group(data_parallel_group, dp_size)
    if dist.get_world_size(group) != dp_size or dist.get_rank(group) != dp_rank:
        raise StatefulsetError(
            f"StatefulsetDataModule.state_dict: DP rank {dp_rank} of {dp_size} does not match the "
            f"data_parallel_group (rank {dist.get_rank(group)} of {dist.get_world_size(group)})"
        )
    meet("StatefulsetDataModule.state_dict", group, loader.collective_timeout)
    states: list[Any] = [None] * dp_size
    dist.all_gather_object(states, state, group=group)
    return states


def module_state(consumed_samples: int, global_step: int, states: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The checkpoint entry: plain data."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "consumed_samples": consumed_samples,
        "global_step": global_step,
        "loader_states": states,
    }


def read_module_state(state_dict: dict[str, Any]) -> tuple[int, list[dict[str, Any]] | None]:
    """``(consumed_samples, loader_states)`` of a checked entry; ``loader_states`` is None in a NeMo / BioNeMo one."""
    fmt = state_dict.get("format")
    if fmt is not None and (fmt != FORMAT or state_dict.get("version") != VERSION):
        raise StatefulsetError(
            f"{_WHERE}: not a {FORMAT} version {VERSION} state (format {fmt!r}, version {state_dict.get('version')!r})"
        )
    consumed = state_dict.get("consumed_samples")
    if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
        raise StatefulsetError(f"{_WHERE}: 'consumed_samples' must be a non-negative int, got {consumed!r}")
    states = state_dict.get("loader_states")
    if states is not None:
        if not isinstance(states, list) or not states:
            raise StatefulsetError(f"{_WHERE}: 'loader_states' must be a non-empty list of DP-rank states")
        for i, state in enumerate(states):
            check_state(state, f"{_WHERE}: loader_states[{i}]")
    return consumed, states
