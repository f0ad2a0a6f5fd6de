"""A bounded meeting before a collective: ranks that never come are named instead of hanging.

``save_state_global`` and ``restore_state_global`` are collectives over the DP group. A rank
that does not call them (a checkpoint hook behind ``if rank == 0``, a rank that raised just
before) would leave its peers inside ``gather_object`` / ``broadcast_object_list`` until the
process group's timeout (30 min for gloo, 10 for NCCL by default, often raised to hours), and
then with a message that does not say who was missing.

So before the collective, the ranks meet in torch.distributed's default store (the TCPStore or
FileStore of ``init_process_group``: no communicator is involved, so NCCL groups work the same
as gloo ones), with a constant number of store operations per rank, whatever the group size (at
16k DP ranks, a meeting where every rank read every peer's key would cost the one store server
2.7·10^8 reads):

1. set its arrival key (read only if the meeting times out, to name who is missing);
2. ``compare_set`` the call's argument (``global_dst_rank``, ``src_rank``) into one shared key:
   the first rank's value stays, and a rank that passed another one records the conflict;
3. ``add`` 1 to the arrival counter; the rank that brings it to the group size sets ``done``;
4. wait at most ``timeout`` seconds for ``done``, then check the conflict key.

On timeout a ``StatefulsetError`` names the DP ranks (and global ranks) that did not arrive; on a
conflict every rank raises, naming the two arguments.

Keys are ``statefulset/<call>/<group>/<n>/...``, where ``n`` counts this process's calls of
``<call>`` on that group: ranks making the same calls number them alike. At call ``n`` each rank
deletes its arrival key of call ``n - 2`` and rank 0 the shared keys of call ``n - 2``: every
peer has passed call ``n - 1``'s meeting by then, so nobody reads them any more.
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
    here = f"{base}/{n}"
    store = _get_default_store()
    mine = repr(argument)
    try:
        store.set(f"{here}/arrived/{me}", "1")
        agreed = store.compare_set(f"{here}/argument", "", mine).decode()
        if agreed != mine:
            store.set(f"{here}/conflict", f"DP rank {me} passed {mine}, another rank {agreed}")
        if store.add(f"{here}/count", 1) == len(ranks):
            store.set(f"{here}/done", "1")
        if n >= 2:
            old = f"{base}/{n - 2}"
            store.delete_key(f"{old}/arrived/{me}")
            if me == 0:
                for key in ("argument", "count", "done", "conflict"):
                    store.delete_key(f"{old}/{key}")
        store.wait([f"{here}/done"], datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:  # torch's store errors (timeouts included) are RuntimeErrors
        missing = _missing(store, [f"{here}/arrived/{r}" for r in range(len(ranks))], exc, call)
        if missing:
            raise StatefulsetError(
                f"{call}: DP rank(s) {missing} (global rank(s) {[ranks[r] for r in missing]}) of the "
                f"data_parallel_group did not call {call} within {timeout:g} s; it is a collective: call it "
                f"on every DP rank (this wait is the loader's collective_timeout, default {DEFAULT_TIMEOUT:g} s)"
            ) from None
        raise StatefulsetError(f"{call}: the meeting of the DP ranks failed: {exc}") from exc
    if store.check([f"{here}/conflict"]):
        raise StatefulsetError(
            f"{call}: the DP ranks passed different arguments ({store.get(f'{here}/conflict').decode()}); "
            "pass the same on all"
        )


def _missing(store: Any, keys: list[str], exc: RuntimeError, call: str) -> list[int]:
    try:
        return [r for r, key in enumerate(keys) if not store.check([key])]
    except RuntimeError:
        raise StatefulsetError(
            f"{call}: cannot reach torch.distributed's store to meet the other ranks: {exc}"
        ) from exc
