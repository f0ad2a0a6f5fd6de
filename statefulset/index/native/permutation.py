"""Keyed pseudo-random permutations of ``[0, n)`` in O(1) memory.

``KeyedPermutation(n, key)[i]`` is computed on the fly: a balanced Feistel network over the
smallest even number of bits covering ``n`` (a bijection of ``[0, 4^k)``), with cycle walking
until the value falls inside ``[0, n)`` (which keeps it a bijection of ``[0, n)``; fewer than
four steps on average since ``4^k < 4n``). No table is ever built, so a permutation of 10^12
items costs the same as one of 10.

Every operation is vectorised over numpy arrays of indices; ``uint64`` arithmetic wraps, which
the mixing function relies on.
"""

from __future__ import annotations

import numpy

from statefulset.errors import StatefulsetError
from statefulset.index import compiled
from statefulset.index.native.keys import derive_key

ROUNDS = 6


def _mix_array(z: numpy.ndarray) -> numpy.ndarray:
    z = z ^ (z >> numpy.uint64(30))
    z = z * numpy.uint64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> numpy.uint64(27))
    z = z * numpy.uint64(0x94D049BB133111EB)
    return z ^ (z >> numpy.uint64(31))


def half_bits(n: int) -> int:
    """Bits per Feistel half for a domain of ``n``: half the smallest even width covering ``n``."""
    bits = max(2, (n - 1).bit_length())
    return (bits + bits % 2) // 2


class KeyedPermutation:
    """A bijection of ``[0, n)`` chosen by ``key``; ``inverse`` undoes it."""

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = int(n)
        self._half = half_bits(self.n)
        self._low_mask = numpy.uint64((1 << self._half) - 1)
        self._round_keys = [numpy.uint64(derive_key(key, r)) for r in range(ROUNDS)]
        self._key_array = numpy.array(self._round_keys, dtype=numpy.uint64)

    def _rounds(self, x: numpy.ndarray, keys: list[numpy.uint64]) -> numpy.ndarray:
        half, mask = numpy.uint64(self._half), self._low_mask
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ (_mix_array(right ^ k) & mask)
        return (left << half) | right

    def _walk(self, x: numpy.ndarray, keys: list[numpy.uint64]) -> numpy.ndarray:
        y = self._rounds(x, keys)
        outside = y >= numpy.uint64(self.n)
        while outside.any():
            y[outside] = self._rounds(y[outside], keys)
            outside = y >= numpy.uint64(self.n)
        return y

    def _inverse_rounds(self, x: numpy.ndarray, keys: list[numpy.uint64]) -> numpy.ndarray:
        half, mask = numpy.uint64(self._half), self._low_mask
        left, right = x >> half, x & mask
        for k in reversed(keys):
            left, right = right ^ (_mix_array(left ^ k) & mask), left
        return (left << half) | right

    def __call__(self, index: numpy.ndarray | int) -> numpy.ndarray:
        """The permuted value of each index (int64 array, same shape)."""
        x = numpy.asarray(index, dtype=numpy.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"index outside [0, {self.n})")
        compiled = _compiled_feistel(x, self.n, self._half, self._key_array)
        return compiled if compiled is not None else self._numpy(x)

    def _numpy(self, x: numpy.ndarray) -> numpy.ndarray:
        return self._walk(x.astype(numpy.uint64).reshape(-1), self._round_keys).reshape(x.shape).astype(numpy.int64)

    def __getitem__(self, index: int) -> int:
        return int(self(numpy.array([index]))[0])

    def inverse(self, value: numpy.ndarray | int) -> numpy.ndarray:
        x = numpy.asarray(value, dtype=numpy.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"value outside [0, {self.n})")
        compiled = _compiled_feistel(x, self.n, self._half, self._key_array, inverse=True)
        return compiled if compiled is not None else self._numpy_inverse(x)

    def _numpy_inverse(self, x: numpy.ndarray) -> numpy.ndarray:
        flat = x.astype(numpy.uint64).reshape(-1)
        y = self._inverse_rounds(flat, self._round_keys)
        outside = y >= numpy.uint64(self.n)
        while outside.any():
            y[outside] = self._inverse_rounds(y[outside], self._round_keys)
            outside = y >= numpy.uint64(self.n)
        return y.reshape(x.shape).astype(numpy.int64)

    def __len__(self) -> int:
        return self.n


def _compiled_feistel(
    x: numpy.ndarray, n: int, half: int, keys: numpy.ndarray, inverse: bool = False
) -> numpy.ndarray | None:
    """:class:`KeyedPermutation`'s rounds with cycle walking, compiled.

    ``x``: int64 values already checked to lie in ``[0, n)``. Returns None when the kernels are
    unavailable, so the caller runs its numpy version.
    """
    lib = compiled.library()
    if lib is None:
        return None
    flat = numpy.ascontiguousarray(x, dtype=numpy.int64).reshape(-1)
    out = numpy.empty_like(flat)
    if lib.sf_feistel(flat, flat.size, n, half, keys, keys.size, int(inverse), out) != 0:
        raise StatefulsetError(f"internal: the Feistel kernel refused n={n}, half={half} or a value outside [0, {n})")
    return out.reshape(numpy.shape(x))
