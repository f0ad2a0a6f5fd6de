"""megatron-core 0.16's BlendedDataset: how many samples each part is built for, and the blend order.

The arithmetic follows BlendedMegatronDatasetBuilder and BlendedDataset step by step, because
the float64 rounding of each step decides the bits of the weights and hence the order:

- the builder normalises the weights (``w / sum(w)`` in float64) and asks each part for
  ``ceil(ceil(size·w_d)·1.005)`` samples (the 0.5% mid-level surplus);
- the blend is ``Σ_d ceil(size·w_d)`` long and BlendedDataset normalises the weights *again*;
- without weights, the parts are built for one epoch and blended by their lengths, either
  ``min(size, Σ len)`` of them or exhaustively (every sample of every part) when there is no size.

The greedy order itself (argmax of ``w_d·max(i, 1) − count_d``) is in :mod:`statefulset.kernels`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy

from .errors import StatefulsetError

MID_LEVEL_SURPLUS = 0.005


def normalize(weights: list[float]) -> list[float]:
    """megatron-core's ``normalize``: float64 division by the float64 sum."""
    w = numpy.array(weights, dtype=numpy.float64)
    return (w / numpy.sum(w)).tolist()


@dataclass(frozen=True)
class BlendPlan:
    weights: list[float] | None  # normalised once (the builder's weights), None for a size blend
    size: int | None
    build_sizes: list[int | None]  # num_samples each part (a GPTDataset) is built for
    targets: list[int] | None  # samples each part is meant to give

    def blend_weights(self, lengths: list[int]) -> tuple[list[float] | list[int], int | None]:
        """(weights, size) as BlendedDataset receives and normalises them, given the parts' lengths."""
        if self.weights is not None:
            return normalize(self.weights), sum(self.targets or [])
        if self.size is not None:
            return normalize([float(n) for n in lengths]), min(self.size, sum(lengths))
        return [int(n) for n in lengths], None


def plan_blend(weights: list[float] | None, size: int | None, count: int | None = None) -> BlendPlan:
    """Part sizes for a blend of ``len(weights)`` parts (or ``count`` unweighted parts)."""
    if weights is None:
        if count is None:
            raise ValueError("an unweighted blend needs the number of parts")
        return BlendPlan(None, size, [None] * count, None)
    if size is None:
        raise StatefulsetError("a weighted megatron blend needs num_samples")
    w = normalize(weights)
    targets = [math.ceil(size * x) for x in w]
    buffers = [math.ceil(math.ceil(size * x) * (1 + MID_LEVEL_SURPLUS)) for x in w]
    return BlendPlan(w, size, buffers, targets)


def blend_indices(weights: list[float] | list[int], size: int | None) -> dict[str, numpy.ndarray]:
    """``dataset_index`` (int16) and ``dataset_sample_index`` (int64), as BlendedDataset builds them."""
    from . import kernels  # compiled on first use: only blends pay for it

    if len(weights) >= 32767:
        raise StatefulsetError(f"a megatron blend holds fewer than 32767 parts, got {len(weights)}")
    if size is None:
        index, sample = kernels.exhaustive_blending_indices(numpy.array(weights, dtype=numpy.int64))
    else:
        index, sample = kernels.blending_indices(numpy.array(weights, dtype=numpy.float64), size)
    return {"dataset_index": index, "dataset_sample_index": sample}


def check_budgets(dataset_index: numpy.ndarray, lengths: list[int], names: list[str], split: str) -> numpy.ndarray:
    """megatron-core refuses a blend that asks a part for more samples than it has; so do we, by name.

    Returns the samples the blend draws from each part.
    """
    counts = numpy.bincount(numpy.asarray(dataset_index), minlength=len(lengths))
    for name, asked, have in zip(names, counts.tolist(), lengths, strict=True):
        if asked > have:
            raise StatefulsetError(
                f"{name}: the {split} blend asks for {asked} samples but this part holds {have} "
                "(megatron-core raises IndexError here too; raise num_samples or change the weights)"
            )
    return counts
