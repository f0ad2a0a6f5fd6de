"""One exact pass over several finite sources, interleaved by size: the validation and test blend.

:class:`~statefulset.index.native.blend_tree.BlendSchedule` rounds each node's share to 2^-32,
which keeps a training blend within a few samples of its weights but not *exactly* on them: over
one pass of ``sum(sizes)`` positions a source may be served once more than it holds (a repeat)
while another is one short (a skip). A validation pass must serve every sample of every source
exactly once (CONTRACT §4), so this schedule walks the same balanced tree with integer shares:
at a node whose left side holds ``L`` of the node's ``T`` samples, position ``p < T`` goes left
when ``floor((p+1)·L/T) > floor(p·L/T)`` and becomes ``floor(p·L/T)`` there, else
``p - floor(p·L/T)`` on the right. Over ``[0, T)`` that sends exactly ``L`` positions left and
numbers them ``0..L-1`` (and ``0..T-L-1`` on the right), so each source's local positions are a
permutation-free ``0..size-1``: no repeat, no skip, sources interleaved evenly by size.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy

from statefulset.errors import StatefulsetError

# Below this many samples, p·L stays inside int64 and the walk is vectorised.
_VECTOR_LIMIT = 3_000_000_000


class _Node(NamedTuple):
    source: int = -1
    left_size: int = 0
    size: int = 0
    left: _Node | None = None
    right: _Node | None = None


def _build(sizes: list[int], first: int) -> _Node:
    if len(sizes) == 1:
        return _Node(source=first, size=sizes[0])
    middle = len(sizes) // 2
    left, right = _build(sizes[:middle], first), _build(sizes[middle:], first + middle)
    return _Node(left_size=left.size, size=left.size + right.size, left=left, right=right)


class OnePassBlend:
    """Which source serves position ``p`` of one pass (``0 <= p < sum(sizes)``), and its local position."""

    def __init__(self, sizes: list[int]) -> None:
        if any(int(s) < 0 for s in sizes) or not any(int(s) > 0 for s in sizes):
            raise StatefulsetError(f"one-pass blend: sizes must be non-negative and not all zero, got {sizes}")
        self.sizes = [int(s) for s in sizes]
        self._live = [i for i, s in enumerate(self.sizes) if s > 0]
        self._tree = _build([self.sizes[i] for i in self._live], 0)
        self.total = self._tree.size

    @property
    def weights(self) -> list[float]:
        return [float(s) for s in self.sizes]

    def counts(self, n: int) -> list[int]:
        """How many of the positions ``[0, n)`` each source serves (``n`` is capped at one pass)."""
        out = [0] * len(self.sizes)
        self._count(self._tree, min(max(int(n), 0), self.total), out)
        return out

    def _count(self, node: _Node, n: int, out: list[int]) -> None:
        if node.left is None:
            out[self._live[node.source]] += n
            return
        left = n * node.left_size // node.size
        self._count(node.left, left, out)
        self._count(node.right, n - left, out)  # type: ignore[arg-type]

    def locate(self, positions: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
        p = numpy.asarray(positions, dtype=numpy.int64)
        if p.size and (int(p.min()) < 0 or int(p.max()) >= self.total):
            raise StatefulsetError(f"one-pass blend: positions must lie in [0, {self.total})")
        source = numpy.empty(p.size, dtype=numpy.int64)
        local = numpy.empty(p.size, dtype=numpy.int64)
        flat = p.reshape(-1)
        if self.total < _VECTOR_LIMIT:
            self._descend(self._tree, flat, numpy.arange(p.size), source, local)
        else:  # beyond int64 products: the same walk on Python ints
            for i, q in enumerate(flat.tolist()):
                source[i], local[i] = self._walk(q)
        return numpy.asarray(self._live)[source].reshape(p.shape), local.reshape(p.shape)

    def _descend(self, node: _Node, p, slots, source_out, local_out) -> None:
        if node.left is None:
            source_out[slots] = node.source
            local_out[slots] = p
            return
        before = p * node.left_size // node.size
        go_left = (p + 1) * node.left_size // node.size > before
        if go_left.any():
            self._descend(node.left, before[go_left], slots[go_left], source_out, local_out)
        go_right = ~go_left
        if go_right.any():
            self._descend(node.right, (p - before)[go_right], slots[go_right], source_out, local_out)  # type: ignore[arg-type]

    def _walk(self, p: int) -> tuple[int, int]:
        node = self._tree
        while node.left is not None:
            before = p * node.left_size // node.size
            if (p + 1) * node.left_size // node.size > before:
                node, p = node.left, before
            else:
                node, p = node.right, p - before  # type: ignore[assignment]
        return node.source, p
