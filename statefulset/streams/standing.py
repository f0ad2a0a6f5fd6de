"""Where the train stream stands at a global position: each source's draws so far, weight there, epochs.

Exact and cheap: ``source_positions`` walks the blend tree (O(stages x log sources)); nothing is
counted per sample. For packing native and bestfit (a stream of positions); Megatron's packing
has no such tree, and :func:`standing` answers None for it. Used by ``statefulset inspect --at``
(:mod:`statefulset.tools.schedule_report`) and by ``loader.metrics()`` (:mod:`statefulset.loading.metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Standing:
    prefix: str
    samples: int  # drawn by the positions [0, P)
    weight: float  # its normalised weight at P (0 when the stage governing P does not read it)
    samples_per_epoch: int

    @property
    def epochs(self) -> float:
        """Passes over its samples so far (1.5: half-way through its second epoch)."""
        return self.samples / self.samples_per_epoch if self.samples_per_epoch else 0.0


def weights_at(stream: Any, position: int) -> tuple[int, list[float]]:
    """``(stage, each source's raw weight)`` at ``position`` (stage 0 for a stream without stages)."""
    if hasattr(stream, "stage_of"):
        k = stream.stage_of(position)
        weights = [0.0] * len(stream.sources)
        for s, w in zip(stream.stage_sources[k], stream.stage_weights[k], strict=True):
            weights[s] = w
        return k, weights
    return 0, list(stream.weights) if len(stream.sources) > 1 else [1.0]


def standing(stream: Any, position: int) -> list[Standing] | None:
    """Every source's standing at ``position``; None for a stream without ``source_positions``."""
    if not hasattr(stream, "source_positions"):
        return None
    counts = stream.source_positions(position)
    _, weights = weights_at(stream, position)
    total = sum(weights) or 1.0
    return [
        Standing(prefix, count, weight / total, int(source.windows))
        for (prefix, count), source, weight in zip(counts.items(), stream.sources, weights, strict=True)
    ]
