"""Where a Megatron train loader resumes: Megatron's ``consumed_train_samples``, this DP rank's saved
loader state (``save_state()``'s return or the dict in ``train_dataloader_dprank*.pt``), or both when
they agree (:func:`~statefulset.integrations.megatron.builder.build_megatron_iterators`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from statefulset.errors import StatefulsetError
from statefulset.loading.loader import SavableLoader
from statefulset.loading.state import check_identity, check_state, cursor_of
from statefulset.parallel.layout import RankInfo


def unwrap_state(state: Any) -> Any:
    """Accept the loader state or the whole ``train_dataloader_dprank*.pt`` dict Megatron writes."""
    if isinstance(state, Mapping) and set(state) == {"dataloader_state_dict"}:
        return state["dataloader_state_dict"]
    return state


def restore_train(
    loader: SavableLoader, state: Any, consumed: int | None, info: RankInfo, micro_batch_size: int
) -> None:
    """Resume from Megatron's consumed_train_samples, a saved state, or both when they agree."""
    where = f"rank {info.global_rank} (DP rank {info.dp_rank} of {info.dp_size})"
    if state is None:
        loader.restore_consumed_samples(consumed or 0)
        return
    check_state(state, f"{where}: loader state")
    stream = loader.dataset.stream
    check_identity(state, stream.identity, f"{where}: loader state", stream.source_prefixes, stream.legacy_data)
    loader.check_task_encoder(state, f"{where}: loader state")  # also when only its position is used below
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
