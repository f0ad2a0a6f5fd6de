"""Train/valid/test splits over a shard's sequences, exactly as megatron-core computes them."""

from __future__ import annotations

import itertools
import math
import re

import numpy

from statefulset.errors import StatefulsetError

SPLITS = ("train", "valid", "test")


def parse_split(text: str, where: str = "split") -> list[float]:
    """``"949,50,1"`` (any separators) → three ratios summing to 1, padded with zeros."""
    parts = [p for p in re.split(r"[,/:;\s]+", str(text).strip()) if p]
    if not parts or len(parts) > len(SPLITS):
        raise StatefulsetError(f"{where}: {text!r} needs one to three ratios like '949,50,1'")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise StatefulsetError(f"{where}: {text!r} is not a list of numbers like '949,50,1'") from None
    if any(v < 0 for v in values):
        raise StatefulsetError(f"{where}: {text!r} has a negative ratio")
    values += [0.0] * (len(SPLITS) - len(values))
    total = sum(values)
    if not math.isfinite(total) or total <= 0:
        raise StatefulsetError(f"{where}: {text!r} must have a positive total")
    # Same arithmetic as megatron-core's normalize(): float64 division by the float64 sum.
    w = numpy.array(values, dtype=numpy.float64)
    return (w / numpy.sum(w)).tolist()


def split_matrix(ratios: list[float]) -> list[tuple[float, float] | None]:
    """Book-ends of each split (cumulative sums); an empty split is None."""
    bounds = [0.0]
    for r in ratios:
        bounds.append(bounds[-1] + r)
    return [(lo, hi) if hi > lo else None for lo, hi in itertools.pairwise(bounds)]


def split_range(bookends: tuple[float, float] | None, count: int) -> tuple[int, int] | None:
    """The contiguous sequence ids ``[begin, end)`` of one split of ``count`` sequences."""
    if bookends is None:
        return None
    return round(bookends[0] * float(count)), round(bookends[1] * float(count))
