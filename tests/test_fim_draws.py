"""FIM's draws from the raw Philox stream equal numpy's own ``binomial(1, p)`` and
``integers(0, n + 1, size=2)``, and leave the generator where numpy's calls leave it: random
sequences of both, probabilities at and near 0, 0.5 and 1, ranges near 2**32 (where Lemire's
rejection is frequent), and a generator holding a buffered 32-bit half on entry."""

from __future__ import annotations

import random

import numpy
import pytest

from statefulset.transforms.fim_draws import CallDraws, RawDraws, draws_of


def _ops(r: random.Random) -> list[tuple[str, float | int]]:
    ops: list[tuple[str, float | int]] = []
    for _ in range(r.randint(1, 30)):
        if r.random() < 0.5:
            p = r.choice([0.0, 1.0, 0.5, 0.3, 0.7, 0.1, 0.9, 1e-9, 1 - 1e-9, 0.5 + 1e-16, r.random()])
            ops.append(("binomial", p))
        else:
            n = r.choice([0, 1, 2, 7, 100, 2049, r.randint(0, 2**32 - 2), 2**32 - 2, 3 * 2**30, 2**31 + 1])
            ops.append(("pair", n))
    return ops


def _after(g: numpy.random.Generator) -> tuple:
    return (
        g.integers(0, 1 << 40, size=3).tolist(),
        g.random(),
        g.integers(0, 5, size=1).tolist(),
        g.bit_generator.state,
    )


@pytest.mark.parametrize("seed", range(4))
def test_raw_draws_are_numpys(seed):
    r = random.Random(seed)
    for _ in range(300):
        key = r.getrandbits(128)
        ops = _ops(r)
        ours, theirs = (numpy.random.Generator(numpy.random.Philox(key=key)) for _ in range(2))
        if r.random() < 0.3:  # a buffered 32-bit half on entry
            ours.integers(0, 10, size=1)
            theirs.integers(0, 10, size=1)
        draws = draws_of(ours)
        assert isinstance(draws, RawDraws)
        got = [draws.binomial(x) if op == "binomial" else draws.pair(int(x)) for op, x in ops]
        draws.finish()
        want = [
            int(theirs.binomial(1, x)) if op == "binomial" else theirs.integers(0, x + 1, size=2).tolist()
            for op, x in ops
        ]
        assert got == want, ops
        a, b = _after(ours), _after(theirs)
        assert a[:3] == b[:3]
        assert str(a[3]) == str(b[3])


def test_other_generators_are_drawn_call_by_call():
    g = numpy.random.default_rng(5)
    draws = draws_of(g)
    assert isinstance(draws, CallDraws)
    got = [draws.binomial(0.5), draws.pair(10)]
    draws.finish()
    h = numpy.random.default_rng(5)
    assert got == [int(h.binomial(1, 0.5)), h.integers(0, 11, size=2).tolist()]
