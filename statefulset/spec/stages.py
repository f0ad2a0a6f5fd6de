"""``stages:``: a data schedule, mixtures that change at given global sample positions (docs/schedules.md).

Stage ``k`` governs positions ``[start_k, start_{k+1})`` (the last one, every later position).
A stage names its sources like ``data_path`` does (one prefix, a mapping prefix → weight, a
Megatron list); a source is the same source in every stage that names its prefix, and keeps its
own place across stages (:mod:`statefulset.streams.stages`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

Blend = list[tuple[str, float | None]]


class StageSpec(BaseModel):
    """One stage of a schedule: where it begins and what it reads."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    start: int
    data_path: Any

    @field_validator("start")
    @classmethod
    def _start(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"must be a non-negative global sample position, got {v}")
        return v


def check_stages(stages: list[StageSpec], packing: str, blend: Any) -> str | None:
    """What is wrong with a schedule (naming the stage and the key), or None. ``blend`` parses a data_path."""
    if packing not in ("native", "bestfit"):
        return (
            f"key 'stages': data schedules need packing native or bestfit (every sample a function of its "
            f"position); this spec has packing {packing}"
        )
    if not stages:
        return "key 'stages': give at least one stage"
    if stages[0].start != 0:
        return f"key 'stages[0].start': the first stage must start at 0, got {stages[0].start}"
    for k in range(1, len(stages)):
        if stages[k].start <= stages[k - 1].start:
            return (
                f"key 'stages[{k}].start': starts must increase, got {stages[k].start} after "
                f"{stages[k - 1].start} (stages[{k - 1}])"
            )
    return None


def parse_stage_blends(stages: list[StageSpec], blend: Any) -> list[Blend]:
    """Each stage's data_path as a Blend, or ValueError naming the stage."""
    out = []
    for k, stage in enumerate(stages):
        if isinstance(stage.data_path, list | tuple | dict) and not stage.data_path:
            raise ValueError(f"key 'stages[{k}].data_path': the stage reads nothing; give a prefix or prefix -> weight")
        try:
            parsed = blend(stage.data_path)
        except ValueError as exc:
            raise ValueError(f"key 'stages[{k}].data_path': {exc}") from None
        prefixes = [p for p, _ in parsed]
        if len(set(prefixes)) != len(prefixes):
            raise ValueError(f"key 'stages[{k}].data_path': a prefix is named twice")
        out.append(parsed)
    return out


def union_of(blends: list[Blend]) -> Blend:
    """Every prefix any stage names, first appearance first, unweighted: the sources a staged stream opens."""
    seen: dict[str, None] = {}
    for parsed in blends:
        for prefix, _ in parsed:
            seen.setdefault(prefix, None)
    return [(prefix, None) for prefix in seen]
