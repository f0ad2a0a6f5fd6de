"""InProcessSource (statefulset.loading.watchdog): num_workers=0's helper thread. A request builds
``per_request`` items ahead (the loader asks for 8 without a task encoder, 1 with one), the next
request goes out only when they are all taken, an error ends its request in order, and a wait that
timed out waits for the same item. Real threads; each wait is bounded (tests/waiting.py)."""

from __future__ import annotations

import subprocess
import sys
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


EXITING = """
import os, sys, threading, time
from statefulset.loading.watchdog import InProcessSource

started, finished = sys.argv[1], sys.argv[2]

def items():
    yield 0
    open(started, "w").close()
    time.sleep(0.5)  # still building when the main thread returns
    open(finished, "w").close()
    yield 1

source = InProcessSource(items(), per_request=2)
assert source.get(30) == 0
deadline = time.monotonic() + 30
while not os.path.exists(started) and time.monotonic() < deadline:
    time.sleep(0.005)
print("exiting", flush=True)
"""


def test_the_interpreter_exits_only_after_the_helper_finished_the_item_it_was_building(tmp_path):
    """A daemon helper thread still inside torch's C++ code while the interpreter finalised aborted the
    process (bench_loader's resume child, once in 80, after 4c79954 made the thread build ahead; 0 in
    120 before). At exit the thread now ends after its item (statefulset.loading.watchdog._stop_helpers).
    The exit lands while the item is being built: the main thread returns once it has started. Without
    the join the process ended mid-item and the item never finished (seen)."""
    started, finished = tmp_path / "started", tmp_path / "finished"
    run = subprocess.run([sys.executable, "-c", EXITING, str(started), str(finished)], capture_output=True,
                         text=True, timeout=BOUND_S)  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip() == "exiting", run.stderr
    assert started.exists() and finished.exists()
