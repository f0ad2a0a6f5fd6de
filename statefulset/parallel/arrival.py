"""A bounded meeting before a collective: ranks that never come are named instead of hanging.

``save_state_global`` and ``restore_state_global`` are collectives over the DP group. A rank
that does not call them (a checkpoint hook behind ``if rank == 0``, a rank that raised just
before) would leave its peers inside ``gather_object`` / ``broadcast_object_list`` until the
process group's timeout (30 min for gloo, 10 for NCCL by default, often raised to hours), and
then with a message that does not say who was missing.

So before the collective, every rank of the group sets its own key in torch.distributed's
default store (the TCPStore or FileStore of ``init_process_group``: no communicator is
involved, so NCCL groups work the same as gloo ones) and waits at most ``timeout`` seconds for
its peers' keys. On timeout it raises a ``StatefulsetError`` naming the DP ranks (and global
ranks) that did not arrive. Each key also carries the call's arguments (``global_dst_rank``,
``src_rank``), so ranks that disagree on them are named too, where the store can read many
keys at once.

Keys are ``statefulset/<call>/<group>/<n>/<dp rank>``, where ``n`` counts this process's calls
of ``<call>`` on that group: ranks making the same calls number them alike (which is what is
checked). At call ``n`` a rank deletes its key of call ``n - 2``: every peer has passed call
``n - 1``'s meeting by then, so nobody waits for it any more, and the store stays small.
"""

from __future__ import annotations

import datetime
import hashlib
from typing import Any

from statefulset.errors import StatefulsetError

# Seconds a rank waits for its DP peers to reach save_state_global / restore_state_global.
# Below both process-group defaults; generous for ranks that reach a checkpoint at different
# moments. None waits as long as the process group does (no meeting at all).
DEFAULT_TIMEOUT = 300.0

_calls: dict[tuple[str, tuple[int, ...]], int] = {}


def check_timeout(timeout: Any, where: str) -> float | None:
    """``timeout`` as positive seconds, or None; a ``StatefulsetError`` naming ``where`` otherwise."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise StatefulsetError(f"{where}: timeout must be a positive number of seconds or None, got {timeout!r}")
    return float(timeout)


def meet(call: str, group: Any, timeout: float | None, argument: object = None) -> None:
    """Wait (at most ``timeout`` s) until every rank of ``group`` has reached ``call`` with the same ``argument``."""
    if timeout is None:
        return
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    me = dist.get_rank(group)
    n = _calls.get((call, ranks), 0)
    _calls[(call, ranks)] = n + 1
    tag = hashlib.blake2b(",".join(map(str, ranks)).encode(), digest_size=8).hexdigest()
    base = f"statefulset/{call}/{tag}"
    keys = [f"{base}/{n}/{r}" for r in range(len(ranks))]
    store = _get_default_store()
    try:
        store.set(keys[me], repr(argument))
        if n >= 2:
            store.delete_key(f"{base}/{n - 2}/{me}")
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:  # torch's store errors (timeouts included) are RuntimeErrors
        missing = _missing(store, keys, exc, call)
        if missing:
            raise StatefulsetError(
                f"{call}: DP rank(s) {missing} (global rank(s) {[ranks[r] for r in missing]}) of the "
                f"data_parallel_group did not call {call} within {timeout:g} s; it is a collective: call it "
                f"on every DP rank (this wait is the loader's collective_timeout, default {DEFAULT_TIMEOUT:g} s)"
            ) from None
    if hasattr(store, "multi_get"):
        values = [v.decode() for v in store.multi_get(keys)]
        if len(set(values)) > 1:
            seen = ", ".join(f"DP rank {r}: {v}" for r, v in enumerate(values))
            raise StatefulsetError(f"{call}: the DP ranks passed different arguments ({seen}); pass the same on all")


def _missing(store: Any, keys: list[str], exc: RuntimeError, call: str) -> list[int]:
    try:
        return [r for r, key in enumerate(keys) if not store.check([key])]
    except RuntimeError:
        raise StatefulsetError(
            f"{call}: cannot reach torch.distributed's store to meet the other ranks: {exc}"
        ) from exc
