"""``statefulset inspect SPEC --at P``: where a run stands at a position: its stage, each source's share and epochs.

For planning the next stage of a data schedule (docs/schedules.md): how many samples each source
has given so far, what share of the run that is, and how far into its own epochs it is. Works for
any native or bestfit train stream (one stage when the spec has no ``stages``); O(stages x sources).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from statefulset.errors import StatefulsetError
from statefulset.streams.opening import open_stream
from statefulset.streams.standing import standing, weights_at


@dataclass
class SourceStanding:
    prefix: str
    samples: int  # drawn by the positions [0, P)
    share_so_far: float
    weight_now: float  # its normalised weight in the stage governing P (0 when that stage does not read it)
    samples_per_epoch: int
    epochs: float  # samples / samples_per_epoch


@dataclass
class ScheduleReport:
    spec: str
    position: int
    stage: int
    stage_start: int
    next_start: int | None
    sources: list[SourceStanding] = field(default_factory=list)
    valid: bool = True

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        until = f"until {self.next_start:,}" if self.next_start is not None else "to the end"
        lines = [f"{self.spec} at position {self.position:,}: stage {self.stage} (from {self.stage_start:,} {until})"]
        width = max(len(s.prefix) for s in self.sources)
        for s in self.sources:
            lines.append(
                f"  {s.prefix:<{width}}  {s.samples:>12,} samples  {s.share_so_far:7.2%} so far  "
                f"weight now {s.weight_now:.3f}  epoch {s.epochs:.3f} of {s.samples_per_epoch:,} samples"
            )
        return "\n".join(lines)


def schedule_report(spec: str | os.PathLike[str], position: int) -> ScheduleReport:
    """The train stream's standing at ``position`` (a global sample position, e.g. step x global batch)."""
    if position < 0:
        raise StatefulsetError(f"--at must be a non-negative position, got {position}")
    stream: Any = open_stream(spec, "train")
    if not hasattr(stream, "source_positions"):
        raise StatefulsetError(f"{os.fspath(spec)}: --at needs packing native or bestfit (a stream of positions)")
    k, _ = weights_at(stream, position)
    start = int(stream.starts[k]) if hasattr(stream, "starts") else 0
    following = int(stream.starts[k + 1]) if hasattr(stream, "starts") and k + 1 < len(stream.starts) else None
    report = ScheduleReport(os.fspath(spec), position, k, start, following)
    for s in standing(stream, position) or []:
        report.sources.append(
            SourceStanding(
                s.prefix, s.samples, s.samples / position if position else 0.0, s.weight, s.samples_per_epoch, s.epochs
            )
        )
    return report
