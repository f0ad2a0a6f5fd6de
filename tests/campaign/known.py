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


def _silent(*faults: str) -> Callable[[dict, dict], bool]:
    return lambda case, result: result["verdict"] == "silent_difference" and case["fault"] in faults


KNOWN: list[Known] = [
    Known(
        "issue 24 §1: remote .bin reads are not pinned to the version opened (If-Match / version id)",
        "an S3 .bin overwritten after the loader opened it: later batches carry the new object's tokens, no error",
        _silent("replace_object"),
    ),
    Known(
        "issue 24 §1: local files replaced under a running job (size/mtime/inode checks)",
        "a local .bin rewritten in place or renamed over while the loader runs: other tokens, no error",
        _silent("replace_inplace", "replace_rename"),
    ),
]


def known(case: dict, result: dict) -> Known | None:
    """The KNOWN entry that explains this finding, if any."""
    for entry in KNOWN:
        if entry.matches(case, result):
            return entry
    return None
