"""Names of shards on disk: natural order, the shards of a folder, and the JSON key a name carries.

``preprocess`` (like Megatron's preprocess_data.py) names its output ``<prefix>_<key>_document``,
one shard per JSON key. A folder of such shards can hold several keys (``part_1_text_document``
next to ``part_1_title_document``); merging them all would interleave different fields in
one corpus, so :func:`refuse_mixed_keys` names the groups instead.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence
from typing import Any

from statefulset.errors import StatefulsetError

# ``<anything>_<key>_document`` (or ``_sentence``, Megatron's other level); a key containing
# underscores is known by its last part.
_KEYED = re.compile(r"_(?P<suffix>[^_]+_(?:document|sentence))$")
OTHER_NAMES = "(names without _<key>_document)"
MASK_SUFFIX = "_loss_mask"  # statefulset.shards.loss_masks: a shard's loss mask, named after it


def natural_key(text: str) -> list[Any]:
    """Sort key that orders ``part_2`` before ``part_10``."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", text)]


def find_prefixes(location: str) -> list[str]:
    """Shard prefixes in a folder (or matching a glob), in natural order; each needs .bin and .idx."""
    pattern = os.path.join(location, "*.idx") if os.path.isdir(location) else location
    if not pattern.endswith(".idx"):
        pattern += ".idx"
    prefixes = [p[: -len(".idx")] for p in glob.glob(pattern) if os.path.exists(p[: -len(".idx")] + ".bin")]
    # A loss-mask shard travels with its token shard (statefulset.shards.loss_masks), never as one of its own.
    present = set(prefixes)
    prefixes = [p for p in prefixes if not (p.endswith(MASK_SUFFIX) and p[: -len(MASK_SUFFIX)] in present)]
    return sorted(prefixes, key=natural_key)


def key_groups(prefixes: Sequence[str]) -> dict[str, list[str]]:
    """Prefixes by the ``<key>_document`` their name ends with, in first-seen order."""
    groups: dict[str, list[str]] = {}
    for prefix in prefixes:
        match = _KEYED.search(os.path.basename(prefix))
        groups.setdefault(match["suffix"] if match else OTHER_NAMES, []).append(prefix)
    return groups


def refuse_mixed_keys(prefixes: Sequence[str], where: str, override: str) -> None:
    """A ``StatefulsetError`` listing the groups when ``prefixes`` come from more than one JSON key."""
    groups = key_groups(prefixes)
    if len(groups) < 2:
        return
    shown = []
    for suffix, members in groups.items():
        names = [os.path.basename(p) for p in members]
        listed = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
        shown.append(f"{suffix}: {listed}")
    suffix = next(s for s in groups if s != OTHER_NAMES)
    example = os.path.join(os.path.dirname(groups[suffix][0]), "*_" + suffix)
    raise StatefulsetError(
        f"{where}: the shards come from {len(groups)} different JSON keys, which one merge would interleave "
        f"into one corpus: {'; '.join(shown)}. Merge one key at a time (for example --input '{example}'), "
        f"or pass {override} to merge them all"
    )
