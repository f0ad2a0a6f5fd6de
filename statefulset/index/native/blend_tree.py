"""The native blend: which source serves stream position ``p``, and at which local position, in O(log K).

A blend splits the stream position by position down a balanced binary tree of the sources:
at a node whose left side carries the share ``a`` of the weight, position ``p`` goes left when
``floor((p+1)·a) > floor(p·a)``, and becomes local position ``floor(p·a)`` there (else
``p - floor(p·a)`` on the right). Each level keeps every prefix of the stream within one
sample of its share, so every source stays within ``ceil(log2 K)`` samples (plus rounding of
the weights to 2^-32) of ``weight × position``, at every position, in O(log K) time.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy

from statefulset.errors import StatefulsetError

_SCALE_BITS = 32
_SCALE = 1 << _SCALE_BITS
_LOW = numpy.uint64(_SCALE - 1)


def _floor_scaled(p: numpy.ndarray, share: int) -> numpy.ndarray:
    """floor(p · share / 2^32) exactly for int64 p ≥ 0 and share < 2^32, without overflow."""
    high = p >> _SCALE_BITS
    low = (p & (_SCALE - 1)).astype(numpy.uint64)
    return high * share + ((low * numpy.uint64(share)) >> numpy.uint64(_SCALE_BITS)).astype(numpy.int64)


class _Node(NamedTuple):
    """A node of the blend tree: leaves carry a source index, inner nodes a left share.

    A NamedTuple, not a frozen dataclass: a schedule of 10 stages x 50 sources builds ~1,000
    nodes at open, and a frozen dataclass's __init__ costs 4x more.
    """

    source: int = -1
    share: int = 0  # left share × 2^32
    left: _Node | None = None
    right: _Node | None = None


def _build_tree(weights: list[float], first: int) -> _Node:
    if len(weights) == 1:
        return _Node(source=first)
    middle = len(weights) // 2
    total = sum(weights)
    share = round(sum(weights[:middle]) / total * _SCALE)
    share = min(max(share, 0), _SCALE - 1)
    return _Node(
        share=share,
        left=_build_tree(weights[:middle], first),
        right=_build_tree(weights[middle:], first + middle),
    )


class BlendSchedule:
    """Which source serves global position ``p``, and at which local position, in O(log K)."""

    def __init__(self, weights: list[float]) -> None:
        live = [w for w in weights if w > 0]
        if not live:
            raise StatefulsetError("blend: all weights are zero")
        self.weights = [float(w) for w in weights]
        # Zero-weight sources never serve; keep their numbering for the caller.
        self._live = [i for i, w in enumerate(weights) if w > 0]
        self._tree = _build_tree(live, 0)

    def counts(self, n: int) -> list[int]:
        """How many of the positions ``[0, n)`` each source serves (zero-weight sources included), in O(K).

        At a node, the first ``n`` positions send ``floor(n·a)`` left (the sum of the per-position
        rule telescopes) and the rest right; the leaves get what reaches them.
        """
        out = [0] * len(self.weights)
        self._count(self._tree, int(n), out)
        return out

    def _count(self, node: _Node, n: int, out: list[int]) -> None:
        if node.left is None:
            out[self._live[node.source]] += n
            return
        left = (n >> _SCALE_BITS) * node.share + (((n & (_SCALE - 1)) * node.share) >> _SCALE_BITS)
        self._count(node.left, left, out)
        self._count(node.right, n - left, out)  # type: ignore[arg-type]

    def locate(self, positions: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
        p = numpy.asarray(positions, dtype=numpy.int64)
        if p.size and p.min() < 0:
            raise StatefulsetError("blend: negative stream position")
        source = numpy.empty(p.shape, dtype=numpy.int64)
        local = numpy.empty(p.shape, dtype=numpy.int64)
        self._descend(self._tree, p.reshape(-1), numpy.arange(p.size), source.reshape(-1), local.reshape(-1))
        return numpy.asarray(self._live)[source], local

    def _descend(self, node: _Node, p, slots, source_out, local_out) -> None:
        if node.left is None:
            source_out[slots] = node.source
            local_out[slots] = p
            return
        before = _floor_scaled(p, node.share)
        go_left = _floor_scaled(p + 1, node.share) > before
        if go_left.any():
            self._descend(node.left, before[go_left], slots[go_left], source_out, local_out)
        go_right = ~go_left
        if go_right.any():
            self._descend(node.right, (p - before)[go_right], slots[go_right], source_out, local_out)
