"""A stream identity's members, and why a saved state does not fit a stream, in words.

Which stage, source, range or weight differs.

A stream's identity digests its sources (content digest, split range, weight) into ``data`` (or,
for a schedule, one digest per stage), which is all a restore needs to refuse. To say *what*
differs, an identity also carries the members themselves, compactly and only while the state stays small
(``members``: ``[digest, first, stop, weight]`` per source; ``stage_members``: the same per
stage), so that a refusal can read "stage 0: …/web has weight 0.5 in this spec, 0.9 in the
state" instead of two hashes. Names come from the loader's own spec (content digest → prefix);
a source the spec no longer reads is described by its digest and range.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

DIGEST_CHARS = 16
# Members ride in every state, and a state travels in a fixed 4 KiB slot
# (statefulset.parallel.exchange): they are left out while an identity would exceed this many
# bytes of msgpack with them (a 100-stage schedule's digests alone take ~2.7 KB).
IDENTITY_BUDGET = 2600


def members_of(digests: list[str], ranges: list[tuple[int, int]], weights: list[float | None]) -> list[list[Any]]:
    """``[digest, first, stop, weight]`` of each source: what its part of an identity depends on."""
    return [
        [d[:DIGEST_CHARS], int(r[0]), int(r[1]), None if w is None else float(w)]
        for d, r, w in zip(digests, ranges, weights, strict=True)
    ]


def trim(identity: dict[str, Any]) -> None:
    """Drop the descriptive members (stage members first) while the identity is over its budget."""
    for key in ("stage_members", "members"):
        if key in identity and len(msgpack.packb(identity, use_bin_type=True)) > IDENTITY_BUDGET:
            del identity[key]


def well_formed(value: Any, nested: bool) -> bool:
    """Whether an untrusted ``members`` (or, ``nested``, ``stage_members``) field has the right shape."""
    if not isinstance(value, list):
        return False
    groups = value if nested else [value]
    for group in groups:
        if not isinstance(group, list):
            return False
        for m in group:
            if not (
                isinstance(m, list)
                and len(m) == 4
                and isinstance(m[0], str)
                and all(isinstance(x, int) and not isinstance(x, bool) for x in m[1:3])
                and (m[3] is None or (isinstance(m[3], int | float) and not isinstance(m[3], bool)))
            ):
                return False
    return True


def _weight(w: Any) -> str:
    return "by size" if w is None else f"{w:g}"


def differences(saved: list[list[Any]], now: list[list[Any]], names: Mapping[str, str]) -> str:
    """The sources that differ between two member lists, in words (empty when they are the same)."""
    before = {m[0]: m for m in saved}
    after = {m[0]: m for m in now}
    name = lambda d: names.get(d, f"the source with content digest {d}")  # noqa: E731
    parts = []
    for d, (_, lo, hi, w) in after.items():
        if d not in before:
            continue
        _, slo, shi, sw = before[d]
        if (lo, hi) != (slo, shi):
            parts.append(f"{name(d)} reads the split range [{lo}, {hi}) in this spec, [{slo}, {shi}) in the state")
        if w != sw:
            parts.append(f"{name(d)} has weight {_weight(w)} in this spec, {_weight(sw)} in the state")
    new = [d for d in after if d not in before]
    gone = [d for d in before if d not in after]
    if len(new) == 1 and len(gone) == 1:
        parts.append(
            f"{name(new[0])} has other content than the state's source (digest {new[0]} now, {gone[0]} in the "
            "state): the shard was rewritten or replaced"
        )
    else:
        parts += [f"{name(d)} is read by this spec, not by the state" for d in new]
        parts += [
            f"a source with content digest {d} (sequences [{before[d][1]}, {before[d][2]})) was read by the state, "
            "not by this spec"
            for d in gone
        ]
    if not parts and [m[0] for m in saved] != [m[0] for m in now]:
        parts.append("the sources are listed in another order")
    return " and ".join(parts)  # never "; ": a refusal separates its fields with it
