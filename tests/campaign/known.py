"""Findings of the campaign that another change is fixing: the short form tolerates them, the long
form reports them apart. Remove an entry when its fix lands (the short form then fails if it comes back).

Each entry: the issue item, what was seen, and a predicate on (case, result) that recognises it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Known:
    item: str  # the issue item that covers it, e.g. "issue 24 §1 remote .bin pinning"
    seen: str  # what the campaign saw
    matches: Callable[[dict, dict], bool]


# Removed when the fixes landed: remote .bin reads pinned to the opened ETag, local files checked
# against the opened inode/size/mtime, identity covering the .bin (the campaign's seeds 95, 179 and
# 116 end with named errors since; they were silent differences before).
# Removed when its fix landed (e4b09dc): preprocessing's upload to S3 behind the fault proxy waiting
# in fs.put_file past the case's bound (seeds 166, 100017); every fsspec call is bounded since.
KNOWN: list[Known] = []


def known(case: dict, result: dict) -> Known | None:
    """The KNOWN entry that explains this finding, if any."""
    for entry in KNOWN:
        if entry.matches(case, result):
            return entry
    return None
