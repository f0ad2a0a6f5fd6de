"""The torchtitan loader's state in a DCP checkpoint: per-DP-rank keys, with the job's record on ``dp_rank_0``.

torchtitan's checkpointer saves the loader's ``state_dict()`` with torch.distributed.checkpoint
under ``dataloader.``. DCP keeps **one** copy of each key (its planner drops duplicates across
ranks), so torchtitan's own loader (``ParallelAwareDataloader``) keys each DP rank's state by
``dp_rank_{r}`` beside ``world_size``, and refuses to load into another DP size. On **load**, DCP
asks each rank's ``state_dict()`` which keys to read *before* it looks at the checkpoint, and a
key the checkpoint lacks is an error: a loader restarted on more DP ranks cannot ask for
``dp_rank_5`` of a job that had four.

So this layout, under ``dataloader.``:

- ``world_size`` (int): the DP size at save (torchtitan's name and meaning);
- ``dp_rank_0`` (bytes, msgpack): the job's **record**, written by global rank 0: every DP rank's
  loader state, gathered at save (one ``gather`` of fixed 4 KiB slots to rank 0, after a bounded
  meeting: :mod:`statefulset.parallel.exchange`, :mod:`statefulset.parallel.arrival`);
- ``dp_rank_{r}`` for ``r >= 1`` (bytes, msgpack): DP rank ``r``'s own loader state, as
  torchtitan lays its states out (written by that DP rank; its TP/PP peers hold the same state,
  and DCP keeps one). A restore does not need them; they are there to inspect.

Every rank's load asks for ``world_size`` and ``dp_rank_0`` only, which every checkpoint of this
loader has whatever its DP size (and torchtitan's own loader's too, so a checkpoint of that
loader reaches :func:`record_states`, which refuses it by name instead of DCP failing on a
missing key). Ranks that are TP/PP/CP peers of one DP rank must hold equal states; where two do
not, the record says so and a restore is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

from statefulset.errors import StatefulsetError
from statefulset.loading.state import decode as decode_state
from statefulset.loading.state import encode as encode_state
from statefulset.parallel.arrival import meet
from statefulset.parallel.exchange import gather_bytes

FORMAT = "statefulset.torchtitan"
VERSION = 1
RECORD_KEY = "dp_rank_0"
WORLD_KEY = "world_size"
MAX_RECORD_BYTES = 1 << 30  # 4 KiB per rank at most: 256k ranks


def rank_key(dp_rank: int) -> str:
    """The DCP key of a DP rank's state (torchtitan's ``ParallelAwareDataloader`` names)."""
    return f"dp_rank_{dp_rank}"


def encode_record(states: list[dict[str, Any]], dp_world_size: int, problems: list[str] | None = None) -> bytes:
    """The record ``dp_rank_0`` holds: every DP rank's state, in DP-rank order."""
    record = {
        "format": FORMAT,
        "version": VERSION,
        "dp_world_size": dp_world_size,
        "states": states,
        "problems": list(problems or []),
    }
    return msgpack.packb(record, use_bin_type=True)


def initial_record(state: dict[str, Any], dp_world_size: int) -> bytes:
    """The record of a loader that has handed out nothing: every rank's state at the start, built locally.

    A fresh loader's state is the same on every rank but for ``dp_rank`` (no batch taken, base
    0), so every rank builds the same bytes: DCP may keep any rank's copy.
    """
    return encode_record([{**state, "dp_rank": r} for r in range(dp_world_size)], dp_world_size)


def gather_record(state: dict[str, Any], dp_world_size: int, timeout: float | None) -> bytes | None:
    """Collective over the world: the record on global rank 0 (None elsewhere) from every rank's ``state``.

    Every rank of the job calls it (DCP's save calls ``state_dict()`` on every rank). Ranks with
    the same DP rank (TP/PP/CP peers) must send equal states; the record lists any that do not.
    """
    import torch.distributed as dist

    what = "StatefulsetDataLoader.state_dict"
    meet("torchtitan_state_dict", None, timeout, dp_world_size)
    gathered = gather_bytes(encode_state(state), 0, None, what=what)
    if gathered is None:
        return None
    first: dict[int, tuple[int, dict[str, Any]]] = {}
    problems: list[str] = []
    for global_rank, data in enumerate(gathered):
        got = decode_state(data)
        dp_rank = got.get("dp_rank") if isinstance(got, dict) else None
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_world_size:
            problems.append(f"global rank {global_rank} sent no state of a DP rank in [0, {dp_world_size})")
        elif dp_rank not in first:
            first[dp_rank] = (global_rank, got)
        elif first[dp_rank][1] != got:
            problems.append(
                f"global ranks {first[dp_rank][0]} and {global_rank} (both DP rank {dp_rank}) saved different "
                f"states ({first[dp_rank][1].get('batches')} and {got.get('batches')} batches taken)"
            )
    missing = [r for r in range(dp_world_size) if r not in first]
    if missing:
        problems.append(f"no rank of the world ({dist.get_world_size()} ranks) saved DP rank(s) {missing[:16]}")
    states = [first[r][1] for r in range(dp_world_size) if r in first]
    return encode_record(states, dp_world_size, problems)


def _looks_like_pickle(value: bytes) -> bool:
    return len(value) >= 2 and value[0] == 0x80 and value[1] <= 5  # pickle protocol 2-5's PROTO opcode


def record_states(state_dict: Any, where: str) -> list[dict[str, Any]]:
    """Every saving DP rank's state from a loaded ``state_dict``, or a ``StatefulsetError`` saying what it is."""
    if not isinstance(state_dict, Mapping) or RECORD_KEY not in state_dict:
        keys = sorted(map(str, state_dict)) if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise StatefulsetError(
            f"{where}: not a statefulset torchtitan loader state (no key '{RECORD_KEY}'; got {keys})"
        )
    value = state_dict[RECORD_KEY]
    if isinstance(value, bytes | bytearray) and _looks_like_pickle(bytes(value)):
        raise StatefulsetError(
            f"{where}: the checkpoint's dataloader state was saved by another loader: '{RECORD_KEY}' holds pickled "
            "bytes, the layout of torchtitan's own ParallelAwareDataloader (HuggingFaceTextDataLoader and friends: a "
            "torchdata StatefulDataLoader state), not a statefulset record. Its position cannot be carried over: "
            "resume with --checkpoint.exclude_from_loading dataloader to start this loader's stream at sample 0"
        )
    if not isinstance(value, bytes | bytearray):
        raise StatefulsetError(f"{where}: key '{RECORD_KEY}' holds a {type(value).__name__}, not a statefulset record")
    if len(value) > MAX_RECORD_BYTES:
        raise StatefulsetError(f"{where}: key '{RECORD_KEY}' holds {len(value)} bytes, more than any record")
    try:
        record = msgpack.unpackb(bytes(value), raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        detail = str(exc) or type(exc).__name__
        raise StatefulsetError(f"{where}: key '{RECORD_KEY}' is not a statefulset record ({detail})") from None
    return _check_record(record, state_dict.get(WORLD_KEY), where)


def _check_record(record: Any, world_size: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise StatefulsetError(f"{where}: key '{RECORD_KEY}' is not a statefulset torchtitan record")
    version = record.get("version")
    if not isinstance(version, int) or version < 1:
        raise StatefulsetError(f"{where}: the record's version {version!r} is not a positive int")
    if version > VERSION:
        raise StatefulsetError(
            f"{where}: the record's format version {version} is newer than this statefulset reads ({VERSION}); "
            "upgrade statefulset"
        )
    size, states, problems = record.get("dp_world_size"), record.get("states"), record.get("problems")
    if world_size != size:
        raise StatefulsetError(
            f"{where}: key '{WORLD_KEY}' ({world_size!r}) disagrees with the record's DP size {size!r}"
        )
    if problems:
        raise StatefulsetError(f"{where}: the checkpoint's loader states do not fit together: " + "; ".join(problems))
    if not isinstance(states, list) or len(states) != size:
        raise StatefulsetError(f"{where}: the record holds {type(states).__name__} for {size!r} DP ranks")
    return states
