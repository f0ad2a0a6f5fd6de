"""Keyed O(1)-memory permutations: bijections, inverses, and different orders for different keys."""

from __future__ import annotations

import numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from statefulset.index.native.keys import derive_key
from statefulset.index.native.permutation import KeyedPermutation


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), key=st.integers(0, 2**64 - 1))
def test_bijection_and_inverse(n, key):
    perm = KeyedPermutation(n, key)
    values = perm(numpy.arange(n))
    assert numpy.array_equal(numpy.sort(values), numpy.arange(n))
    assert numpy.array_equal(perm.inverse(values), numpy.arange(n))
    assert perm[n - 1] == values[n - 1]


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(2**40, 2**62),
    key=st.integers(0, 2**64 - 1),
    picks=st.lists(st.integers(0, 2**40 - 1), min_size=1, max_size=20),
)
def test_huge_domains_round_trip(n, key, picks):
    perm = KeyedPermutation(n, key)
    idx = numpy.array(picks, dtype=numpy.int64)
    out = perm(idx)
    assert ((out >= 0) & (out < n)).all()
    assert numpy.array_equal(perm.inverse(out), idx)


def test_keys_give_different_orders_that_look_shuffled():
    n = 10_000
    a = KeyedPermutation(n, derive_key(1234, 0))(numpy.arange(n))
    b = KeyedPermutation(n, derive_key(1234, 1))(numpy.arange(n))
    assert not numpy.array_equal(a, b)
    # Not a near-identity: few fixed points and low correlation with position.
    assert (a == numpy.arange(n)).sum() < 10
    assert abs(numpy.corrcoef(a, numpy.arange(n))[0, 1]) < 0.05
    assert derive_key(1, 2) != derive_key(2, 1)
