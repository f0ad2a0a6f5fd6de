"""Loader states across the DP group: the collectives behind ``save_state_global`` / ``restore_state_global``.

:class:`~statefulset.loading.loader.SavableLoader` makes and fits the states
(:mod:`statefulset.loading.state`); this module moves them between the ranks of the
``data_parallel_group``. A save gathers every rank's state on one rank; a restore from one source
rank checks the list there once and scatters to each rank only its own cursor. Both first meet
every rank (:func:`statefulset.parallel.arrival.meet`), so a rank that never calls makes the others
raise after ``collective_timeout`` naming it, and both send fixed slots
(:mod:`statefulset.parallel.exchange`): O(W) bytes, no all-gather of sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import torch.distributed as dist

from statefulset.errors import StatefulsetError
from statefulset.loading.datasets import StreamDataset
from statefulset.loading.state import Cursor, fit_global_states
from statefulset.loading.state import decode as decode_state
from statefulset.loading.state import encode as encode_state
from statefulset.loading.worker_config import WorkerConfig
from statefulset.parallel.arrival import meet
from statefulset.parallel.exchange import gather_bytes, scatter_bytes


def in_group(worker_config: WorkerConfig) -> bool:
    """Whether the states travel at all (DP size above 1), after checking the process group matches the config."""
    size = worker_config.world_size
    if size == 1:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        raise StatefulsetError(f"WorkerConfig says world_size {size} but torch.distributed is not initialised")
    group = worker_config.data_parallel_group
    if dist.get_world_size(group) != size or dist.get_rank(group) != worker_config.rank:
        raise StatefulsetError(
            f"WorkerConfig rank {worker_config.rank} of {size} does not match the "
            f"data_parallel_group (rank {dist.get_rank(group)} of {dist.get_world_size(group)})"
        )
    return True


def gather_states(
    state: dict[str, Any], worker_config: WorkerConfig, global_dst_rank: int, timeout: float | None
) -> list[dict[str, Any]] | None:
    """Every DP rank's ``state``, as a list by DP rank, on global rank ``global_dst_rank``; None elsewhere."""
    if not in_group(worker_config):
        return [state]
    group = worker_config.data_parallel_group
    try:
        if group is None and not 0 <= global_dst_rank < dist.get_world_size():
            raise ValueError(global_dst_rank)  # torch only notices inside gloo, killing the ranks
        dist.get_group_rank(group if group is not None else dist.group.WORLD, global_dst_rank)
    except (ValueError, RuntimeError):
        raise StatefulsetError(
            f"save_state_global: global rank {global_dst_rank} is not in this rank's data_parallel_group"
        ) from None
    meet("save_state_global", group, timeout, f"global_dst_rank={global_dst_rank}")
    # Fixed slots (statefulset.parallel.exchange): O(W) bytes, no all-gather of sizes.
    gathered = gather_bytes(encode_state(state), global_dst_rank, group, what="save_state_global")
    return [decode_state(data) for data in gathered] if gathered is not None else None


def check_source(state: Any, worker_config: WorkerConfig, src_rank: int) -> None:
    """Refuse a ``src_rank`` outside the DP group, and a state passed on a rank other than ``src_rank``."""
    wc = worker_config
    if not 0 <= src_rank < wc.world_size:
        raise StatefulsetError(f"restore_state_global: src_rank {src_rank} is outside the DP group of {wc.world_size}")
    if wc.rank != src_rank and state is not None:
        raise StatefulsetError(
            f"restore_state_global: DP rank {wc.rank} passed a state but src_rank is {src_rank}; pass None"
        )


def receive_cursor(
    states: list[dict[str, Any]] | None,
    src_rank: int,
    dataset: StreamDataset,
    timeout: float | None,
    check_task_encoder: Callable[[Any, str], None],
) -> Cursor:
    """DP rank ``src_rank`` checks the list once and sends each rank only its own cursor.

    One scatter of fixed slots: each rank receives ~100 bytes, whatever the DP size (a
    broadcast of the list would send every rank every state). A check that fails at the
    source is sent to every rank, so all of them raise the same error.
    """
    wc = dataset.worker_config
    group = wc.data_parallel_group
    source = dist.get_global_rank(group, src_rank) if group is not None else src_rank
    meet("restore_state_global", group, timeout, f"src_rank={src_rank}")
    stream = dataset.stream
    items, error = None, None
    if wc.rank == src_rank:
        try:
            check_task_encoder(states, "global state")
            cursors = fit_global_states(
                states, stream.identity, wc.world_size, dataset.batch_size,
                stream.source_prefixes, stream.legacy_data,
            )  # fmt: skip
            items = [
                msgpack.packb({"fingerprint": stream.fingerprint, "base": c.base, "batches": c.batches})
                for c in cursors
            ]
        except StatefulsetError as exc:
            error = str(exc)  # every rank raises it (the exchange fits it to its slot)
    # Every rank takes part in the scatter whatever happened here, so none waits in it alone.
    got = msgpack.unpackb(
        scatter_bytes(items, source, group, error, f"DP rank {src_rank}, which checked it", what="restore_state_global")
    )
    if got["fingerprint"] != stream.fingerprint:
        raise StatefulsetError(
            f"restore_state_global: DP rank {wc.rank} opened other data than DP rank {src_rank} "
            "(their stream fingerprints differ): every rank must load the same spec"
        )
    return Cursor(got["base"], got["batches"], wc.rank, wc.world_size, dataset.batch_size)


__all__ = ["check_source", "gather_states", "in_group", "receive_cursor"]
