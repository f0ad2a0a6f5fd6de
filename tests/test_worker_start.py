"""Forked workers that never start (CPython gh-112275) are noticed within seconds and started again.

The real fault, a child deadlocked in ``PyOS_AfterFork_Child`` on a lock another thread of the
trainer held at the fork, comes about once in hundreds of forks (tests/test_dcp.py hit it). Here
it is made certain: a fork handler of this test process stops chosen children (SIGSTOP) before
they run a line of the DataLoader's worker, so from the trainer they look exactly like one that
deadlocked. The loader must start the workers again and deliver the very batches of an
undisturbed run, or give up with an error that says what happened, in bounded time.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import numpy
import pytest
import torch
from campaign.procs import alive, describe, stopped, wait_gone

from statefulset import IndexedDatasetWriter, StatefulsetError, WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.loading.worker_start import MAX_STARTS, forks, frozen_for_fork, start_timeout

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

# Fork n of this process (counted by the parent, so each child knows its own number) stops itself
# when n is in "stop"; "all" stops every child. Empty outside these tests.
_FREEZE: dict = {"n": 0, "stop": set(), "all": False, "pids": []}


def _count_fork() -> None:
    _FREEZE["n"] += 1


def _maybe_stop() -> None:
    if _FREEZE["all"] or _FREEZE["n"] in _FREEZE["stop"]:
        os.kill(os.getpid(), signal.SIGSTOP)


os.register_at_fork(before=_count_fork, after_in_child=_maybe_stop)


@pytest.fixture
def freeze(monkeypatch):
    monkeypatch.setenv("STATEFULSET_WORKER_START_TIMEOUT", "2")

    def arm(*forks_to_stop: int, every: bool = False) -> None:
        base = _FREEZE["n"]
        _FREEZE["stop"] = {base + k for k in forks_to_stop}
        _FREEZE["all"] = every

    yield arm
    _FREEZE["stop"], _FREEZE["all"] = set(), False


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    root = tmp_path_factory.mktemp("start")
    rng = numpy.random.default_rng(5)
    with IndexedDatasetWriter(root / "a") as w:
        for _ in range(400):
            w.add_document(rng.integers(0, 60000, int(rng.geometric(1 / 60))))
    return {"data_path": str(root / "a"), "seq_length": 1024, "packing": "native", "path_to_cache": str(root / "c")}


def _loader(spec, workers=2, batches_before=0):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    # 128 rows of 1,025 uint16 tokens: a batch of 256 KiB, so a worker hands over one batch at a time
    loader = get_savable_loader(get_train_dataset(spec, batch_size=128, worker_config=wc))
    if batches_before:
        loader.restore_state_rank({**loader.save_state_rank(), "batches": batches_before})
    return loader


def _take(loader, n):
    return [(b["sample_id"].clone(), b["text"].clone()) for _, b in zip(range(n), loader, strict=False)]


@pytest.mark.parametrize("stuck_fork", [1, 2], ids=["worker0", "worker1"])
def test_a_worker_stuck_at_birth_is_started_again_and_the_batches_are_exact(spec, freeze, caplog, stuck_fork):
    expected = _take(_loader(spec, workers=0), 12)
    freeze(stuck_fork)  # fork 1 is worker 0, fork 2 worker 1
    loader = _loader(spec)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        got = _take(loader, 12)
    elapsed = time.monotonic() - started
    for (ia, ta), (ib, tb) in zip(got, expected, strict=True):
        assert torch.equal(ia, ib) and torch.equal(ta, tb)
    worker = stuck_fork - 1
    assert f"DataLoader worker(s) {worker} (pid" in caplog.text and "gh-112275" in caplog.text
    assert "starting the workers again from micro-batch" in caplog.text
    assert elapsed < 30  # noticed after the 2 s start timeout, not the watchdog's minutes
    # The stuck process was killed, not left behind stopped.
    pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\)", caplog.text)]
    assert pids and not stopped(pids)


def test_a_resumed_loader_starts_again_from_its_own_next_batch(spec, freeze, caplog):
    expected = _take(_loader(spec, workers=0, batches_before=7), 6)
    freeze(1)
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        got = _take(_loader(spec, batches_before=7), 6)
    assert "from micro-batch 7" in caplog.text
    for (ia, ta), (ib, tb) in zip(got, expected, strict=True):
        assert torch.equal(ia, ib) and torch.equal(ta, tb)


def test_workers_that_never_start_end_in_an_error_that_says_why(spec, freeze):
    freeze(every=True)
    started = time.monotonic()
    with pytest.raises(StatefulsetError) as error:
        _take(_loader(spec), 1)
    text = str(error.value)
    assert f"did not start within 2 s of being forked, {MAX_STARTS} times in a row" in text
    assert "gh-112275" in text and "multiprocessing_context='forkserver'" in text
    assert time.monotonic() - started < MAX_STARTS * 2 + 20


def test_only_forked_workers_are_watched(monkeypatch):
    assert forks("fork") and not forks("spawn") and not forks("forkserver")
    assert not forks(torch.multiprocessing.get_context("spawn"))
    monkeypatch.setenv("STATEFULSET_WORKER_START_TIMEOUT", "soon")
    with pytest.raises(StatefulsetError, match="STATEFULSET_WORKER_START_TIMEOUT='soon': must be a positive number"):
        start_timeout()


class _FinalizerBlocksInAChild:
    """Like a torchft ManagerServer the trainer dropped but has not collected yet: its finaliser
    waits for threads that a fork does not copy, so it never returns in a forked child."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.cycle = self  # only the garbage collector frees it

    def __del__(self) -> None:
        if os.getpid() != self.owner:
            time.sleep(600)  # "forever"; the worker start watch kills the child long before


_COLLECT_IN_CHILD = {"on": False}


def _first_collection() -> None:
    # The gate: a forked child's first garbage collection, made certain (no later than its first
    # line of Python), where otherwise it comes after some hundreds of allocations.
    if _COLLECT_IN_CHILD["on"]:
        gc.collect()


os.register_at_fork(after_in_child=_first_collection)


def test_garbage_left_by_the_trainer_is_not_collected_in_a_forked_worker(spec, monkeypatch):
    """An object the trainer dropped but had not collected when the workers were forked is never
    finalised in a worker: its finaliser (a server's shutdown, a thread's join) would hang it."""
    monkeypatch.setenv("STATEFULSET_WORKER_START_TIMEOUT", "2")
    expected = _take(_loader(spec, workers=0), 4)
    gc.collect()
    gc.disable()  # so the parent keeps the garbage until the fork (as a trainer between collections)
    try:
        _FinalizerBlocksInAChild()
        _COLLECT_IN_CHILD["on"] = True
        got = _take(_loader(spec), 4)
    finally:
        _COLLECT_IN_CHILD["on"] = False
        gc.enable()
        gc.collect()  # finalised here, in the parent, where it returns at once
    for (ia, ta), (ib, tb) in zip(got, expected, strict=True):
        assert torch.equal(ia, ib) and torch.equal(ta, tb)


def test_the_fork_leaves_the_trainers_own_freeze_as_it_was():
    """The objects are thawed after the fork, unless the trainer had frozen objects itself (for
    memory sharing, as Python's docs advise): then they stay frozen."""
    gc.unfreeze()  # nothing frozen to begin with
    with frozen_for_fork():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with frozen_for_fork():
            pass
        assert gc.get_freeze_count() >= frozen
    finally:
        gc.unfreeze()


TRAINER = """
import json, os, sys, time
from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
loader = get_savable_loader(get_train_dataset(json.loads(sys.argv[1]), batch_size=4, worker_config=wc))
trainer = os.getpid()

def hold():  # the gate: each worker says it was forked, then waits until its trainer is gone
    open(os.path.join(sys.argv[2], str(os.getpid())), "w").close()
    deadline = time.monotonic() + 60
    while os.getppid() == trainer and time.monotonic() < deadline:
        time.sleep(0.02)

os.register_at_fork(after_in_child=hold)
iter(loader)  # forks the workers
time.sleep(600)
"""


def test_a_worker_whose_trainer_died_while_it_started_exits(spec, tmp_path):
    """torch's worker takes the parent it sees after its start for the trainer to watch: a trainer
    SIGKILLed while its workers were starting must not leave them running, adopted by init."""
    born = tmp_path / "born"
    born.mkdir()
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, json.dumps(spec), str(born)])
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2:
            assert trainer.poll() is None, f"the trainer exited with {trainer.returncode}"
            assert time.monotonic() < deadline, "waited 120 s for the trainer to fork its two workers"
            time.sleep(0.02)
            pids = [int(p.name) for p in born.iterdir()]
    finally:
        trainer.kill()  # while both workers are held in their start
        trainer.wait(timeout=30)
    try:
        left = {p: describe(p) for p in wait_gone(pids, 30)}
        assert not left, f"workers still running 30 s after their trainer was SIGKILLed: {left}"
    finally:
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


_IMPORT_LOCK_HELD = r"""
import importlib._bootstrap, json, sys, threading
from statefulset import WorkerConfig, get_savable_loader, get_train_dataset
assert "numpy.ctypeslib" not in sys.modules  # the kernels are not loaded yet: the first batch loads them
held, release = threading.Event(), threading.Event()

def hold():  # another thread of the trainer, inside the import the kernels need, for 3 s
    with importlib._bootstrap._ModuleLockManager("numpy.ctypeslib"):
        held.set()
        release.wait(3)

threading.Thread(target=hold, daemon=True).start()
held.wait()
wc = WorkerConfig(rank=0, world_size=1, num_workers=1)
loader = get_savable_loader(get_train_dataset(json.loads(sys.argv[1]), batch_size=2, worker_config=wc), timeout=20)
batch = next(iter(loader))
print("first batch", batch["sample_id"].tolist())
"""


def test_a_fork_while_another_thread_imports_what_the_kernels_need_does_not_hang_the_worker(spec, tmp_path):
    """A rank thread forked its workers while another rank's thread was importing numpy.ctypeslib (the
    first batch of the process loads the kernels): the worker inherited that module's import lock,
    held by a thread it does not have, and waited on it forever at its first batch (seen in
    tests/test_torchft.py's kill test under load, gdb). Gated: a thread holds the lock across the fork."""
    argv = [sys.executable, "-c", _IMPORT_LOCK_HELD, json.dumps(spec)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "first batch [0, 1]" in run.stdout
