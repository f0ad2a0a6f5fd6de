"""megatron-core 0.16's BlendedDataset: how many samples each part is built for, and the blend order.

The arithmetic follows BlendedMegatronDatasetBuilder and BlendedDataset step by step, because
the float64 rounding of each step decides the bits of the weights and hence the order:

- the builder normalises the weights (``w / sum(w)`` in float64) and asks each part for
  ``ceil(ceil(size·w_d)·1.005)`` samples (the 0.5% mid-level surplus);
- the blend is ``Σ_d ceil(size·w_d)`` long and BlendedDataset normalises the weights *again*;
- without weights, the parts are built for one epoch and blended by their lengths, either
  ``min(size, Σ len)`` of them or exhaustively (every sample of every part) when there is no size.

The greedy order itself (argmax of ``w_d·max(i, 1) − count_d``) runs compiled (``kernels.c``, see
:mod:`statefulset.index.compiled`) or in Python, with the same result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy

from statefulset.errors import StatefulsetError, check_int, check_int_array
from statefulset.index import compiled

_MAX_DATASETS = 32767  # dataset ids are int16
_MAX_EXACT = 2**53  # integers up to here convert to double exactly

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
    if len(weights) >= 32767:
        raise StatefulsetError(f"a megatron blend holds fewer than 32767 parts, got {len(weights)}")
    if size is None:
        index, sample = exhaustive_blending_indices(numpy.array(weights, dtype=numpy.int64))
    else:
        index, sample = blending_indices(numpy.array(weights, dtype=numpy.float64), size)
    # Stored with the entry, so that a warm open never counts the whole index again.
    counts = numpy.bincount(index, minlength=len(weights)).astype(numpy.int64)
    return {"dataset_index": index, "dataset_sample_index": sample, "counts": counts}


def check_budgets(arrays: dict[str, numpy.ndarray], lengths: list[int], names: list[str], split: str) -> numpy.ndarray:
    """megatron-core refuses a blend that asks a part for more samples than it has; so do we, by name.

    Returns the samples the blend draws from each part (stored with the blend; counted only for
    an entry written before they were).
    """
    counts = arrays.get("counts")
    if counts is None or len(counts) != len(lengths):
        counts = numpy.bincount(numpy.asarray(arrays["dataset_index"]), minlength=len(lengths))
    counts = numpy.asarray(counts)
    for name, asked, have in zip(names, counts.tolist(), lengths, strict=True):
        if asked > have:
            raise StatefulsetError(
                f"{name}: the {split} blend asks for {asked} samples but this part holds {have} "
                "(megatron-core raises IndexError here too; raise num_samples or change the weights)"
            )
    return counts


# -- the blend order: compiled kernel or the same arithmetic in Python ------------------------------
def _weights(weights: object) -> numpy.ndarray:
    try:
        array = numpy.asarray(weights, dtype=numpy.float64)
    except (TypeError, ValueError) as error:
        raise StatefulsetError(f"weights must be numbers: {error}") from None
    if array.ndim != 1 or not 1 <= array.size <= _MAX_DATASETS:
        raise StatefulsetError(f"weights must be a 1-D array of 1 to {_MAX_DATASETS} numbers, got shape {array.shape}")
    if not numpy.isfinite(array).all() or (array < 0).any():
        raise StatefulsetError(f"weights must be finite and non-negative, got {array.tolist()[:10]}")
    return numpy.ascontiguousarray(array)


def _blending_python(weights: list[float], size: int) -> tuple[list[int], list[int]]:
    counts = [0] * len(weights)
    ids = [0] * size
    samples = [0] * size
    rest = range(1, len(weights))
    for i in range(size):
        x = max(float(i), 1.0)
        best = 0
        best_error = weights[0] * x - float(counts[0])
        for d in rest:
            error = weights[d] * x - float(counts[d])
            if error > best_error:
                best_error = error
                best = d
        ids[i] = best
        samples[i] = counts[best]
        counts[best] += 1
    return ids, samples


def blending_indices(
    weights: numpy.ndarray, size: int, *, native: bool | None = None
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """megatron-core's ``build_blending_indices``: (dataset_index int16[size], dataset_sample_index int64[size]).

    Sample ``i`` goes to the dataset ``d`` with the largest ``weights[d] * max(i, 1) - count[d]``
    (the lowest ``d`` on ties), and its sample index is ``count[d]`` before the increment. The
    weights are used as given (not normalised).
    """
    array = _weights(weights)
    size = check_int("size", size, 0)
    lib = compiled.pick(native)
    if lib is None:
        ids, samples = _blending_python(array.tolist(), size)
        return numpy.array(ids, dtype=numpy.int16), numpy.array(samples, dtype=numpy.int64)
    dataset_index = numpy.empty(size, dtype=numpy.int16)
    dataset_sample_index = numpy.empty(size, dtype=numpy.int64)
    counts = numpy.zeros(array.size, dtype=numpy.int64)
    code = lib.sf_blending_indices(array, array.size, size, dataset_index, dataset_sample_index, counts)
    if code != 0:
        raise StatefulsetError(f"blending kernel failed with code {code}")
    return dataset_index, dataset_sample_index


def _exhaustive_python(sizes: list[int]) -> tuple[list[int], list[int]]:
    total = sum(sizes)
    weights = [float(s) / float(total) for s in sizes] if total else []
    active = [d for d, s in enumerate(sizes) if s > 0]
    counts = [0] * len(sizes)
    ids: list[int] = []
    samples: list[int] = []
    i = 0
    while active:
        x = max(float(i), 1.0)
        best_slot = 0
        best = active[0]
        best_error = weights[best] * x - float(counts[best])
        for slot in range(1, len(active)):
            d = active[slot]
            error = weights[d] * x - float(counts[d])
            if error > best_error:
                best_error = error
                best = d
                best_slot = slot
        ids.append(best)
        samples.append(counts[best])
        counts[best] += 1
        if counts[best] == sizes[best]:
            del active[best_slot]
        i += 1
    return ids, samples


def exhaustive_blending_indices(
    sizes: numpy.ndarray, *, native: bool | None = None
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """megatron-core's ``build_exhaustive_blending_indices``: exactly ``sizes[d]`` samples from dataset ``d``.

    The greedy rule of :func:`blending_indices` with weights ``sizes[d] / sum(sizes)``, over the
    datasets that still have samples left. Returns int16 and int64 arrays of length
    ``sum(sizes)``. Datasets of size zero are never picked: megatron-core would pick one and run
    past the end of its arrays; for positive sizes the result is megatron-core's.
    """
    array = check_int_array("sizes", sizes)
    if array.size > _MAX_DATASETS:
        raise StatefulsetError(f"at most {_MAX_DATASETS} datasets, got {array.size}")
    values = [int(v) for v in array.tolist()]
    if any(v < 0 for v in values):
        raise StatefulsetError(f"sizes must be non-negative, got {values[:10]}")
    total = sum(values)
    if total >= _MAX_EXACT:
        raise StatefulsetError(f"sum(sizes) = {total} is too large")
    lib = compiled.pick(native)
    if lib is None:
        ids, samples = _exhaustive_python(values)
        return numpy.array(ids, dtype=numpy.int16), numpy.array(samples, dtype=numpy.int64)
    k = array.size
    sizes64 = numpy.ascontiguousarray(array, dtype=numpy.int64)
    dataset_index = numpy.empty(total, dtype=numpy.int16)
    dataset_sample_index = numpy.empty(total, dtype=numpy.int64)
    counts = numpy.zeros(k, dtype=numpy.int64)
    weights = numpy.empty(k, dtype=numpy.float64)
    active = numpy.empty(k, dtype=numpy.int32)
    code = lib.sf_exhaustive_blending_indices(sizes64, k, dataset_index, dataset_sample_index, counts, weights, active)
    if code != 0:
        raise StatefulsetError(f"exhaustive blending kernel failed with code {code}")
    return dataset_index, dataset_sample_index
