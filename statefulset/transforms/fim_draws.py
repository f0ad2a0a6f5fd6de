"""FIM's random draws, read from the raw Philox stream: the values ``Generator.binomial(1, p)`` and
``Generator.integers(0, n + 1, size=2)`` give, at a fraction of their per-call cost.

Fill-in-the-middle draws two to four numbers per segment, and a sample of short documents holds
dozens of segments: numpy's per-call overhead (~1 µs a ``binomial``, ~12 µs an ``integers``)
was most of token mode's cost. :class:`RawDraws` takes 64-bit outputs from the generator's
Philox in chunks (``random_raw``) and computes each draw as numpy's C code does (numpy's
``random_binomial`` inversion for ``n = 1``, and the Lemire bounded integers over its buffered
32-bit halves), then leaves the generator exactly where the per-call draws would have left it:
same counter and buffer, same buffered 32-bit half. ``tests/test_fim_pinned.py`` pins the outputs
and the generator's later draws to those of the per-call implementation. Any other bit generator
is drawn from call by call (:class:`CallDraws`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy

from statefulset.errors import StatefulsetError

_CHUNK = 32  # raw outputs taken at a time (a segment takes one to three)
_TO_DOUBLE = 1.0 / 9007199254740992.0  # numpy's next_double: the top 53 bits of a 64-bit output
_U32 = 0xFFFFFFFF


def inversion_constants(p: float) -> tuple[float, float]:
    """numpy's ``random_binomial_inversion`` for n = 1 and probability ``p`` (<= 0.5): ``qn = exp(n log q)``,
    the chance of 0, and ``(n - x + 1) p qn / (x q)`` for x = 1, the chance of 1 (same operations, same order)."""
    q = 1.0 - p
    qn = math.exp(1 * math.log(q))
    return qn, (1 * p * qn) / (1 * q)


class CallDraws:
    """The draws straight from the generator's methods (any bit generator)."""

    def __init__(self, rng: numpy.random.Generator) -> None:
        self.rng = rng

    def binomial(self, p: float) -> int:
        return int(self.rng.binomial(1, p))

    def pair(self, n: int) -> list[int]:
        """Two integers uniform in ``0..n`` (both ends included), in draw order."""
        return self.rng.integers(0, n + 1, size=2).tolist()  # type: ignore[no-any-return]

    def cut(self, n: int, spm_rate: float) -> tuple[int, int, int]:
        """``sorted(pair(n))`` then ``binomial(spm_rate)``: a FIM's cut points and its SPM choice."""
        lo, hi = sorted(self.pair(n))
        return lo, hi, self.binomial(spm_rate)

    def finish(self) -> None:
        pass


class RawDraws:
    """The same draws as :class:`CallDraws` for a Philox generator, computed from its raw outputs."""

    def __init__(self, rng: numpy.random.Generator) -> None:
        self.bits = rng.bit_generator
        self.start = self.bits.state
        self.has32, self.u32 = int(self.start["has_uint32"]), int(self.start["uinteger"])
        self.raw: list[int] = []
        self.at = 0
        self.taken = 0
        self._constants: dict[float, tuple[float, float]] = {}

    def _next64(self) -> int:
        if self.at == len(self.raw):
            self.raw = self.bits.random_raw(_CHUNK).tolist()
            self.at = 0
            self.taken += _CHUNK
        value = self.raw[self.at]
        self.at += 1
        return value

    def _next32(self) -> int:
        """Philox's ``next_uint32``: the buffered upper half of the last output, else the lower half of a new one."""
        if self.has32:
            self.has32 = 0
            return self.u32
        value = self._next64()
        self.has32, self.u32 = 1, value >> 32
        return value & _U32

    def _double(self) -> float:
        return (self._next64() >> 11) * _TO_DOUBLE

    def binomial(self, p: float) -> int:
        """``Generator.binomial(1, p)``: numpy's inversion (one uniform; another only after its rare reject)."""
        if p == 0.0:
            return 0  # numpy returns without a draw
        low = p if p <= 0.5 else 1.0 - p
        constants = self._constants.get(low)
        if constants is None:
            constants = self._constants[low] = inversion_constants(low)
        qn, second = constants
        if self.at < len(self.raw):  # the common case inline: a uniform at most qn + second is 0 or 1
            u = (self.raw[self.at] >> 11) * _TO_DOUBLE
            if u <= qn:
                self.at += 1
                return 0 if p <= 0.5 else 1
            if u - qn <= second:
                self.at += 1
                return 1 if p <= 0.5 else 0
        x, px, u = 0, qn, self._double()
        while u > px:
            x += 1
            if x > 1:  # past numpy's bound (min(n, ...) = 1): start again with a new uniform
                x, px, u = 0, qn, self._double()
            else:
                u -= px
                px = second
        return x if p <= 0.5 else 1 - x

    def _bounded(self, r: int) -> int:
        """numpy's ``buffered_bounded_lemire_uint32`` for the inclusive range ``0..r`` (r < 2**32 - 1)."""
        excl = r + 1
        m = self._next32() * excl
        left = m & _U32
        if left < excl:
            threshold = (_U32 - r) % excl
            while left < threshold:
                m = self._next32() * excl
                left = m & _U32
        return m >> 32

    def pair(self, n: int) -> list[int]:
        """``Generator.integers(0, n + 1, size=2)`` (int64): 32-bit Lemire draws while ``n`` fits."""
        if n == 0:
            return [0, 0]  # numpy fills without a draw
        if n >= _U32:
            raise StatefulsetError(f"internal: FillInTheMiddle cut points over a segment of {n} tokens")
        return [self._bounded(n), self._bounded(n)]

    def cut(self, n: int, spm_rate: float) -> tuple[int, int, int]:
        """``sorted(pair(n))`` then ``binomial(spm_rate)``: a FIM's cut points and its SPM choice."""
        if not self.has32 and self.at < len(self.raw) and 0 < n < _U32:
            # The common case inline: both halves of one output, each accepted at once by Lemire's method.
            value, excl = self.raw[self.at], n + 1
            first, second = (value & _U32) * excl, (value >> 32) * excl
            if (first & _U32) >= excl and (second & _U32) >= excl:
                self.at += 1
                self.u32 = value >> 32  # Philox keeps the half it handed out (has_uint32 is 0 again)
                lo, hi = first >> 32, second >> 32
                return (lo, hi, self.binomial(spm_rate)) if lo <= hi else (hi, lo, self.binomial(spm_rate))
        lo, hi = sorted(self.pair(n))
        return lo, hi, self.binomial(spm_rate)

    def finish(self) -> None:
        """Leave the generator as the per-call draws would have: outputs taken but not used given back."""
        used = self.taken - (len(self.raw) - self.at)
        same_half = (self.has32, self.u32) == (int(self.start["has_uint32"]), int(self.start["uinteger"]))
        if used == self.taken and same_half:
            return
        self.bits.state = self.start
        if used:
            self.bits.random_raw(used)
        if not same_half:
            state = self.bits.state
            state["has_uint32"], state["uinteger"] = self.has32, self.u32
            self.bits.state = state


def draws_of(rng: Any) -> RawDraws | CallDraws:
    """Raw-stream draws for the loader's Philox generators, call-by-call draws for any other generator."""
    if isinstance(rng, numpy.random.Generator) and type(rng.bit_generator) is numpy.random.Philox:
        return RawDraws(rng)
    return CallDraws(rng)
