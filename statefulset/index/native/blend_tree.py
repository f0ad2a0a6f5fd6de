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


def _flatten(tree: _Node, live: list[int]) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]]:
    """The tree as ``(node, share, left, right)`` for each inner node in pre-order (a parent before its
    children) and ``(node, source)`` for each leaf, nodes numbered in pre-order from the root (0)."""
    inner: list[tuple[int, int, int, int]] = []
    leaves: list[tuple[int, int]] = []

    def visit(node: _Node) -> int:
        number = len(inner) + len(leaves)
        if node.left is None:
            leaves.append((number, live[node.source]))
            return number
        slot = len(inner)
        inner.append((number, node.share, -1, -1))
        left = visit(node.left)
        right = visit(node.right)  # type: ignore[arg-type]
        inner[slot] = (number, node.share, left, right)
        return number

    visit(tree)
    return inner, leaves


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
        self._inner, self._leaves = _flatten(self._tree, self._live)

    def flat_nodes(self) -> list[tuple[int, int, int]]:
        """The tree for a compiled walk (``kernels.c``, ``sf_tree_locate``): for each node in pre-order
        from the root, ``(share, left, right)`` if inner, ``(-1 - source, 0, 0)`` for a leaf of ``source``
        (numbered as :meth:`locate` returns it)."""
        nodes = [(0, 0, 0)] * (len(self._inner) + len(self._leaves))
        for node, share, left, right in self._inner:
            nodes[node] = (share, left, right)
        for node, source in self._leaves:
            nodes[node] = (-1 - source, 0, 0)
        return nodes

    def counts(self, n: int) -> list[int]:
        """How many of the positions ``[0, n)`` each source serves (zero-weight sources included), in O(K).

        At a node, the first ``n`` positions send ``floor(n·a)`` left (the sum of the per-position
        rule telescopes) and the rest right; the leaves get what reaches them. The tree is walked
        as a flat list of inner nodes in pre-order (``metrics()`` asks after every batch): on
        Python ints, ``n·share >> 32`` is that floor exactly, at any ``n``.
        """
        reach = [0] * (len(self._inner) + len(self._leaves))
        reach[0] = int(n)
        for node, share, left, right in self._inner:
            m = reach[node]
            reach[left] = a = m * share >> _SCALE_BITS
            reach[right] = m - a
        out = [0] * len(self.weights)
        for node, source in self._leaves:
            out[source] = reach[node]
        return out

    def counts_many(self, n: numpy.ndarray) -> numpy.ndarray:
        """:meth:`counts` of each of the non-negative int64 ``n`` at once: an ``(len(n), K)`` int64 array."""
        reach = numpy.empty((len(self._inner) + len(self._leaves), len(n)), dtype=numpy.int64)
        reach[0] = n
        for node, share, left, right in self._inner:
            reach[left] = _floor_scaled(reach[node], share)
            numpy.subtract(reach[node], reach[left], out=reach[right])
        out = numpy.zeros((len(n), len(self.weights)), dtype=numpy.int64)
        for node, source in self._leaves:
            out[:, source] = reach[node]
        return out

    def locate(self, positions: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
        """``(source, local position)`` of every position, in the shape of ``positions``."""
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
