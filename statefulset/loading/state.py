"""The loader state: a cursor into the stream layout, as plain, versioned, self-checking data.

Layout (Megatron's pretraining sampler): a loader on DP rank ``r`` of ``W`` with micro-batch
size ``B`` gives, as its ``t``-th batch, the samples at global positions
``base + (t·W + r)·B + j`` for ``j < B``. So a rank's whole state is ``batches`` (how many
batches the trainer took) plus the layout it was taken under; workers, prefetching and pinned
buffers never enter it. When every rank took the same number of batches, positions below
``base + batches·W·B`` are consumed and none above, which is what lets a state restore into
another DP size, batch size or worker count: the new layout starts at that position.

A state is a dict of ints and strings, well under 1 KB, that ``torch.load(weights_only=True)``,
JSON and msgpack (:func:`encode` / :func:`decode`) all carry. Every field of an untrusted state
is checked before use; anything that does not fit raises ``StatefulsetError`` naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy

from statefulset.errors import StatefulsetError
from statefulset.loading.state_refusals import RefusalWords, past_stages_problem
from statefulset.shards.digests import changed_shards
from statefulset.streams.members import well_formed

logger = logging.getLogger("statefulset")

FORMAT = "statefulset.loader"
# 2: identities cover each shard's .bin as well as its .idx (statefulset.shards.digests), and
# identity holds "shards". Version 1 (statefulset 0.1.0) states are still read: see check_identity.
VERSION = 2

_IDENTITY_KEYS = {
    "packing": str,
    "split": str,
    "split_ratios": (str, type(None)),
    "seq_length": int,
    "seed": int,
    "num_samples": (int, type(None)),
    "data": str,
}
# Present for packing bestfit ("pad_id", "bestfit") and for data schedules ("stages": [start,
# digest] of every stage); states of the other specs stay as they were. "shards" (a few hex
# digits per source, statefulset.shards.digests.shard_checks) names the shards that changed when
# a restore is refused: in every state of version 2, in none of version 1.
# "task_encoder": the encoder's identity (statefulset.loading.encoder_state compares it, so that a
# changed encoder can be allowed).
_OPTIONAL_IDENTITY_KEYS = {"pad_id": int, "bestfit": int, "stages": list, "shards": str, "task_encoder": str}
# Present while few: the sources behind "data" / each stage, so that a refusal can say which weight
# or range differs (statefulset.streams.members); descriptive only, never compared on their own.
_DESCRIPTIVE_KEYS = {"members": False, "stage_members": True}
_MAX_SHARDS_TEXT = 1024
_MAX_STAGES = 100  # a state travels in a fixed 4 KiB slot (statefulset.parallel.exchange)
_INT_KEYS = ("dp_rank", "dp_size", "batch_size", "base", "batches", "num_workers")
_KEYS = {"format", "version", "identity", *_INT_KEYS}
_MAX_POSITION = 2**62  # positions stay far inside int64 whatever the arithmetic


@dataclass(frozen=True)
class Cursor:
    """Where a rank's loader is in the stream layout."""

    base: int
    batches: int
    dp_rank: int
    dp_size: int
    batch_size: int

    def positions(self, t: int) -> numpy.ndarray:
        """Global positions of this rank's batch ``t`` (counted from ``base``)."""
        first = self.base + (t * self.dp_size + self.dp_rank) * self.batch_size
        return numpy.arange(first, first + self.batch_size, dtype=numpy.int64)

    @property
    def consumed(self) -> int:
        """First global position not consumed, when every rank took ``batches`` batches."""
        return self.base + self.batches * self.dp_size * self.batch_size


def make_state(identity: dict[str, Any], cursor: Cursor, num_workers: int) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "identity": dict(identity),
        "dp_rank": cursor.dp_rank,
        "dp_size": cursor.dp_size,
        "batch_size": cursor.batch_size,
        "base": cursor.base,
        "batches": cursor.batches,
        "num_workers": num_workers,
    }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_state(state: Any, where: str = "state") -> dict[str, Any]:
    """Validate the structure of an untrusted state; return it unchanged."""
    if not isinstance(state, dict):
        raise StatefulsetError(f"{where}: a loader state is a dict, got {type(state).__name__}")
    if state.get("format") != FORMAT:
        raise StatefulsetError(f"{where}: not a statefulset loader state (format {state.get('format')!r})")
    version = state.get("version")
    if not _is_int(version) or version < 1:
        raise StatefulsetError(f"{where}: field 'version' must be a positive int, got {version!r}")
    if version > VERSION:
        raise StatefulsetError(
            f"{where}: state format version {version} is newer than this statefulset understands ({VERSION}); "
            "upgrade statefulset"
        )
    unknown = sorted(set(state) - _KEYS, key=str)
    missing = sorted(_KEYS - set(state))
    if unknown or missing:
        parts = ([f"unknown field(s) {unknown}"] if unknown else []) + ([f"missing {missing}"] if missing else [])
        raise StatefulsetError(f"{where}: " + ", ".join(parts))
    for key in _INT_KEYS:
        value = state[key]
        if not _is_int(value) or not 0 <= value < _MAX_POSITION:
            raise StatefulsetError(f"{where}: field '{key}' must be a non-negative int, got {value!r}")
    if state["dp_size"] < 1 or state["batch_size"] < 1:
        raise StatefulsetError(f"{where}: dp_size and batch_size must be positive")
    if state["dp_rank"] >= state["dp_size"]:
        raise StatefulsetError(f"{where}: dp_rank {state['dp_rank']} is outside dp_size {state['dp_size']}")
    cursor = Cursor(state["base"], state["batches"], state["dp_rank"], state["dp_size"], state["batch_size"])
    if cursor.consumed + cursor.dp_size * cursor.batch_size >= _MAX_POSITION:
        raise StatefulsetError(f"{where}: position {cursor.consumed} is out of range")
    identity = state["identity"]
    allowed = set(_IDENTITY_KEYS) | set(_OPTIONAL_IDENTITY_KEYS) | set(_DESCRIPTIVE_KEYS)
    if not isinstance(identity, dict) or not set(_IDENTITY_KEYS) <= set(identity) <= allowed:
        raise StatefulsetError(
            f"{where}: field 'identity' must hold {sorted(_IDENTITY_KEYS)} (and may hold "
            f"{sorted(_OPTIONAL_IDENTITY_KEYS)})"
        )
    for key, kind in {**_IDENTITY_KEYS, **_OPTIONAL_IDENTITY_KEYS}.items():
        if key not in identity:
            continue
        value = identity[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise StatefulsetError(f"{where}: field 'identity.{key}' has the wrong type ({type(value).__name__})")
    if "stages" in identity:
        _check_stages(identity["stages"], where)
    for key, nested in _DESCRIPTIVE_KEYS.items():
        if key in identity and not well_formed(identity[key], nested):
            raise StatefulsetError(f"{where}: field 'identity.{key}' must list [digest, first, stop, weight] entries")
    if ("shards" in identity) != (version >= 2):
        raise StatefulsetError(f"{where}: field 'identity.shards' is {'missing' if version >= 2 else 'unknown'} in a "
                               f"state of version {version}")  # fmt: skip
    if "shards" in identity and len(identity["shards"]) > _MAX_SHARDS_TEXT:
        raise StatefulsetError(f"{where}: field 'identity.shards' holds over {_MAX_SHARDS_TEXT} characters")
    return state


def _check_stages(stages: list[Any], where: str) -> None:
    if not 1 <= len(stages) <= _MAX_STAGES:
        raise StatefulsetError(f"{where}: field 'identity.stages' must hold 1 to {_MAX_STAGES} stages")
    previous = -1
    for k, entry in enumerate(stages):
        if (
            not isinstance(entry, list | tuple)
            or len(entry) != 2
            or not _is_int(entry[0])
            or not isinstance(entry[1], str)
            or len(entry[1]) != 16
            or not previous < entry[0] < _MAX_POSITION
        ):
            raise StatefulsetError(
                f"{where}: field 'identity.stages[{k}]' must be [start, 16-hex digest], starts increasing"
            )
        previous = entry[0]


def cursor_of(state: dict[str, Any]) -> Cursor:
    return Cursor(state["base"], state["batches"], state["dp_rank"], state["dp_size"], state["batch_size"])


def check_identity(
    state: dict[str, Any],
    identity: dict[str, Any],
    where: str,
    sources: Sequence[str] = (),
    legacy_data: str | None = None,
    warn: bool = True,
) -> None:
    """Refuse a state taken on other data, naming every field that differs, and in words which source did.

    A data schedule's stages are compared only as far as the past goes: the stages that began
    before the state's position must be the same; later ones may be added, changed or removed.
    ``sources``: the stream's prefixes, in the order of ``identity["shards"]``. ``legacy_data``:
    "data" as statefulset 0.1.0 computed it (``.idx`` only), which a state of that version (version 1,
    no "shards") may match: it then restores, with a WARNING that its ``.bin`` files go unchecked.
    """
    saved = state["identity"]
    keys = [*_IDENTITY_KEYS, *_OPTIONAL_IDENTITY_KEYS]
    skipped = ("stages", "shards", "task_encoder")
    differs = [key for key in keys if key not in skipped and saved.get(key) != identity.get(key)]
    named = changed_shards(saved.get("shards"), identity.get("shards"), list(sources))
    legacy = state["version"] == 1
    if "data" in differs and legacy and legacy_data is not None and saved["data"] == legacy_data:
        differs.remove("data")
        if warn:
            logger.warning(
                "statefulset: %s: the state was saved by statefulset 0.1.0, whose identity covered the shards' .idx "
                "files only: restoring it without checking that the .bin files hold the tokens it was saved on",
                where,
            )  # fmt: skip
    # This stream's sources by content digest (members are listed in the order of ``sources``).
    names = {m[0]: prefix for m, prefix in zip(identity.get("members") or [], sources, strict=False)}
    words = RefusalWords(saved, identity, named, legacy, names)
    problems = []
    if ("stages" in saved) != ("stages" in identity):
        # A schedule's "data" is "stages": the field that says so replaces it. Another packing says
        # it alone (megatron has no schedules).
        if "data" in differs:
            differs.remove("data")
        if "packing" not in differs:
            differs.append("stages")
    elif "stages" in saved:
        problem = past_stages_problem(saved["stages"], identity["stages"], cursor_of(state).consumed, words)
        if problem:
            problems.append(problem)
    if differs:
        details = "; ".join(words.field(key) for key in differs)
        problems.insert(0, f"the state does not fit this dataset ({details})")
    if problems:
        raise StatefulsetError(f"{where}: " + "; and ".join(problems))


def fit_rank_state(
    state: Any,
    identity: dict[str, Any],
    dp_rank: int,
    dp_size: int,
    batch_size: int,
    sources: Sequence[str] = (),
    legacy_data: str | None = None,
) -> Cursor:
    """The cursor to resume from a state saved by this very DP rank, in the same layout.

    ``sources``, ``legacy_data``: see :func:`check_identity`.
    """
    where = f"state for DP rank {dp_rank}"
    check_state(state, where)
    check_identity(state, identity, where, sources, legacy_data)
    if state["dp_size"] != dp_size or state["dp_rank"] != dp_rank:
        raise StatefulsetError(
            f"{where}: the state was saved by DP rank {state['dp_rank']} of {state['dp_size']}, this loader is "
            f"DP rank {dp_rank} of {dp_size}; restore a changed DP layout with restore_state_global"
        )
    if state["batch_size"] != batch_size:
        raise StatefulsetError(
            f"{where}: batch_size differs (state {state['batch_size']}, loader {batch_size}); "
            "restore a changed batch size with restore_state_global"
        )
    return cursor_of(state)


def fit_global_states(
    states: Any,
    identity: dict[str, Any],
    dp_size: int,
    batch_size: int,
    sources: Sequence[str] = (),
    legacy_data: str | None = None,
) -> list[Cursor]:
    """Every new DP rank's cursor from the states of every saving DP rank: one check of the list, O(W)."""
    if not isinstance(states, list | tuple):
        raise StatefulsetError(f"global state: expected the list of every DP rank's state, got {type(states).__name__}")
    if not states:
        raise StatefulsetError("global state: the list of DP rank states is empty (one per rank expected)")
    for i, state in enumerate(states):
        check_state(state, f"global state, entry {i}")
        check_identity(state, identity, f"global state, entry {i}", sources, legacy_data, warn=i == 0)
        if state["dp_rank"] != i or state["dp_size"] != len(states):
            raise StatefulsetError(
                f"global state, entry {i}: saved by DP rank {state['dp_rank']} of {state['dp_size']}, "
                f"but the list holds {len(states)} states (one per DP rank, in DP-rank order)"
            )
    first = states[0]
    for i, state in enumerate(states[1:], start=1):
        for key in ("batch_size", "base"):
            if state[key] != first[key]:
                raise StatefulsetError(f"global state: {key} of DP rank {i} ({state[key]}) differs from rank 0's")
    if len(states) == dp_size and first["batch_size"] == batch_size:
        return [cursor_of(s) for s in states]  # same layout: every rank resumes exactly where it was
    taken = [s["batches"] for s in states]
    if len(set(taken)) > 1:
        shown = ", ".join(f"rank {i}: {n}" for i, n in enumerate(taken[:16])) + (", ..." if len(taken) > 16 else "")
        raise StatefulsetError(
            "global state: ranks consumed different numbers of batches "
            f"({shown}); a changed DP size or batch size needs a state where every rank took the same number"
        )
    consumed = cursor_of(first).consumed
    return [Cursor(consumed, 0, r, dp_size, batch_size) for r in range(dp_size)]


def fit_global_state(
    states: Any,
    identity: dict[str, Any],
    dp_rank: int,
    dp_size: int,
    batch_size: int,
    sources: Sequence[str] = (),
    legacy_data: str | None = None,
) -> Cursor:
    """The cursor for this rank from the states of every DP rank, possibly saved in another layout."""
    return fit_global_states(states, identity, dp_size, batch_size, sources, legacy_data)[dp_rank]


# -- msgpack codec for users who store states outside torch ---------------------------------------
def encode(state: dict[str, Any]) -> bytes:
    """A state (rank or global list) as msgpack bytes."""
    return msgpack.packb(state, use_bin_type=True)


def decode(data: bytes) -> Any:
    """Bytes from :func:`encode` back to the state; damaged bytes raise ``StatefulsetError``."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise StatefulsetError(f"state bytes expected, got {type(data).__name__}")
    if len(data) > 1 << 20:
        raise StatefulsetError(f"state bytes: {len(data)} bytes is far more than any loader state")
    try:
        value = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        detail = str(exc) or type(exc).__name__
        raise StatefulsetError(f"state bytes ({len(data)} bytes) are not a msgpack state: {detail}") from None
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_state(item, f"decoded global state, entry {i}")
    else:
        check_state(value, "decoded state")
    return value
