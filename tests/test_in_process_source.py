"""InProcessSource (statefulset.loading.watchdog): num_workers=0's helper thread. A request builds
``per_request`` items ahead (the loader asks for 8 without a task encoder, 1 with one), the next
request goes out only when they are all taken, an error ends its request in order, and a wait that
timed out waits for the same item. Real threads; each wait is bounded (tests/waiting.py)."""

from __future__ import annotations

import threading

import pytest
from waiting import wait_for

from statefulset.errors import StatefulsetError
from statefulset.loading.watchdog import InProcessSource, TimedOut

BOUND_S = 30.0


def _counting(built: list[int], fail_at: int | None = None, gate: threading.Event | None = None):
    for i in range(100):
        if gate is not None and not gate.wait(BOUND_S):
            raise AssertionError("the test never opened the gate")
        if i == fail_at:
            raise StatefulsetError(f"item {i} is bad")
        built.append(i)
        yield i


def test_a_request_builds_its_items_ahead_and_the_next_goes_out_once_they_are_taken():
    built: list[int] = []
    source = InProcessSource(_counting(built), per_request=3)
    assert source.get(BOUND_S) == 0
    wait_for(lambda: len(built) == 3, "the helper thread to build the request's 3 items", BOUND_S)
    assert [source.get(BOUND_S), source.get(BOUND_S)] == [1, 2]
    assert built == [0, 1, 2]  # nothing asked for while items of the request were still to be taken
    assert source.get(BOUND_S) == 3
    wait_for(lambda: len(built) == 6, "the second request's 3 items", BOUND_S)
    assert built == list(range(6))


def test_one_item_a_request_builds_only_what_is_asked_for():
    built: list[int] = []
    source = InProcessSource(_counting(built))  # per_request=1: the loader's choice with a task encoder
    assert [source.get(BOUND_S) for _ in range(3)] == [0, 1, 2]
    assert built == [0, 1, 2]


def test_an_error_ends_its_request_and_is_raised_after_the_items_before_it():
    built: list[int] = []
    source = InProcessSource(_counting(built, fail_at=2), per_request=8)
    assert [source.get(BOUND_S), source.get(BOUND_S)] == [0, 1]
    with pytest.raises(StatefulsetError, match="item 2 is bad"):
        source.get(BOUND_S)
    # A new request goes out; the generator ended with its error, so it says StopIteration.
    with pytest.raises(StopIteration):
        source.get(BOUND_S)
    assert built == [0, 1]


def test_a_wait_that_timed_out_waits_for_the_same_item():
    built: list[int] = []
    gate = threading.Event()
    source = InProcessSource(_counting(built, gate=gate), per_request=4)
    with pytest.raises(TimedOut):
        source.get(0.05)  # the gate is closed: the item cannot have come
    gate.set()
    assert [source.get(BOUND_S) for _ in range(6)] == list(range(6))
