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
KNOWN: list[Known] = [
    Known(
        "issue 24 §1/§3: preprocessing I/O on S3, every wait bounded (open: found by the campaign, seeds 166, 100017)",
        "preprocess with inputs and output behind the fault proxy (dropped connections, or no fault) waits past the "
        "case's bound in the output upload: fs.put_file inside faults.with_retries, the fsspec call itself unbounded "
        "(the main thread in fsspec.asyn.sync, its I/O loop idle in select)",
        lambda case, result: (
            case["kind"] == "preprocess" and case["storage"] == "s3-proxy" and result["verdict"] == "hang"
        ),
    ),
]


def known(case: dict, result: dict) -> Known | None:
    """The KNOWN entry that explains this finding, if any."""
    for entry in KNOWN:
        if entry.matches(case, result):
            return entry
    return None
