"""FaultTolerantLoader under torchft 0.2 (docs/torchft.md), with real parts: torchft's lighthouse on
loopback, replica groups as processes on gloo training a tiny model (examples/torchft_replicas.py),
SIGKILLs landing mid-step (a gate the harness waits on), restarts that heal from their peers, a
commit made to fail on every replica. Exactly once is checked from what each replica logged.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import logging
import multiprocessing
import os
import random
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import numpy
import pytest
import torch
from campaign.procs import alive, describe, wait_gone
from encoders import Nested
from quorums import ScriptedQuorum
from waiting import wait_for

from statefulset import StatefulsetError, WorkerConfig, get_train_dataset
from statefulset.integrations.torchft import FaultTolerantLoader
from statefulset.tools.demo import demo_spec

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchft_replicas.py"
os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and manager servers: no log line per quorum


def _example():
    spec = importlib.util.spec_from_file_location("torchft_replicas", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return demo_spec(str(tmp_path_factory.mktemp("corpus")), documents=600)


def test_random_kills_restarts_and_a_failed_commit_consume_every_sample_exactly_once(spec, tmp_path):
    """Three replica groups of two ranks each (threads, as torchft's own tests run them; examples/ runs
    groups of one) for 200 steps; twice a random one SIGKILLed mid-step (after it took its batch) and
    started again (it heals from its peers); one commit failed everywhere. Every replica-batch below the
    frontier was consumed by exactly one committed step, each rank with its rows (n·W + r)·B + j."""
    seed = random.randrange(2**32)
    example = _example()
    summary = example.story(str(tmp_path), spec, steps=200, kills=2, seed=seed, group_size=2)
    assert summary["steps"] == 200, (seed, summary)
    assert len(summary["kills"]) == 2, (seed, summary)
    # Each restart healed (served batches that did not count) before it took part again.
    assert summary["healing_steps"] >= 2, (seed, summary)
    assert summary["trained"] == summary["distinct"] == summary["samples"], (seed, summary)


class _Replica:
    """One replica group of one rank in this process: a lighthouse of its own and a torchft Manager."""

    def __init__(self) -> None:
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.coordination import LighthouseServer

        self.lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.model = torch.nn.Linear(2, 1)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
            load_state_dict=self.model.load_state_dict,
            state_dict=self.model.state_dict,
            min_replica_size=1,
            replica_id="alone",
            lighthouse_addr=self.lighthouse.address(),
            store_addr="127.0.0.1",
            store_port=self.store.port,
            rank=0,
            world_size=1,
            hostname="127.0.0.1",
            timeout=timedelta(seconds=30),
            quorum_timeout=timedelta(seconds=60),
            connect_timeout=timedelta(seconds=30),
            init_sync=False,
        )

    def close(self) -> None:
        self.manager.shutdown(wait=False)
        self.lighthouse.shutdown()


@pytest.fixture
def replica():
    made = _Replica()
    yield made
    made.close()


def test_one_replica_steps_through_the_stream_and_serves_a_failed_step_again(spec, replica, caplog):
    """Alone, replica-batch n is step n; a failed commit serves the same rows again, from the trainer
    process, and keeps the workers' prefetch (no plan change is logged); a group rank takes its rows."""
    wc = WorkerConfig(rank=1, world_size=2, num_workers=1)  # rank 1 of a replica group of 2
    loader = FaultTolerantLoader(get_train_dataset(spec, batch_size=3, worker_config=wc), replica.manager)
    m = replica.manager
    seen = []
    with caplog.at_level(logging.INFO, logger="statefulset"):
        for step in range(6):
            m.start_quorum()
            batch = next(loader)
            seen.append((loader.last.step, loader.last.replica_batch, batch["sample_id"].tolist()))
            if step == 3:
                m.report_error(RuntimeError("commit made to fail"))
            assert m.should_commit() == (step != 3)
    expected_n = [0, 1, 2, 3, 3, 4]
    assert [n for _, n, _ in seen] == expected_n
    assert [s for s, _, _ in seen] == [0, 1, 2, 3, 3, 4]
    for _, n, ids in seen:
        assert ids == [(n * 2 + 1) * 3 + j for j in range(3)]  # (n·W + r)·B + j
    assert m.batches_committed() == 5
    assert not [r for r in caplog.records if "prefetched batches dropped" in r.getMessage()]


def test_next_before_start_quorum_is_refused(spec, replica):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    loader = FaultTolerantLoader(get_train_dataset(spec, batch_size=2, worker_config=wc), replica.manager)
    with pytest.raises(StatefulsetError, match="start_quorum"):
        next(loader)


def test_bad_arguments_are_refused(spec, replica):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    ds = get_train_dataset(spec, batch_size=2, worker_config=wc)
    with pytest.raises(StatefulsetError, match="lacks start_quorum"):
        FaultTolerantLoader(ds, object())
    with pytest.raises(StatefulsetError, match="get_train_dataset"):
        FaultTolerantLoader([1, 2], replica.manager)
    with pytest.raises(StatefulsetError, match="prefetch_factor"):
        FaultTolerantLoader(ds, replica.manager, prefetch_factor=0)
    with pytest.raises(StatefulsetError, match="worker_config"):
        FaultTolerantLoader(ds, replica.manager, worker_config=wc)


def test_a_quorum_change_retargets_the_same_workers_and_never_serves_their_stale_prefetch(spec):
    """Quorums 3 -> 2 (this replica keeping its rank) -> 2 (rank 1 -> 0) -> 3 -> 1 participants, a
    failed commit in between: the same two worker processes serve the whole run (no fork at a
    change), and every row served is the dataset's row at the position the quorum places it (text
    compared), although at each change the workers held batches built for the old plan (gated: the
    change waits until they have built ahead). A change that leaves this replica its rank gets the
    prefetched batch, and so does the change 2 -> 3 that moves it from rank 0 to 2 (its new batch is
    the old plan's next but one, which the trainer already received: the bundle of 4 taken at step
    14); the trainer builds only the first step, the other changes that move it, and the repeated
    step, on its own thread (local files, no task encoder: no helper thread to wake)."""
    import threading

    quorum = ScriptedQuorum(3, 1)
    wc = WorkerConfig(rank=1, world_size=2, num_workers=2)  # rank 1 of a replica group of 2
    ds = get_train_dataset(spec, batch_size=3, worker_config=wc)
    before = set(threading.enumerate())
    loader = FaultTolerantLoader(ds, quorum, prefetch_factor=2)
    script = [(3, 1)] * 5 + [(2, 1)] * 5 + [(2, 0)] * 5 + [(3, 2)] * 5 + [(1, 0)] * 4
    pids = None
    for step, (participants, rank) in enumerate(script):
        if (participants, rank) != (quorum.participants, quorum.rank):
            pool = loader.workers
            wait_for(lambda pool=pool: pool.built_ahead() >= 2, "the workers to build the old plan ahead", 60)
        quorum.participants, quorum.rank = participants, rank
        batch = next(loader)
        n = loader.last.replica_batch
        assert n == quorum.committed + rank
        ids = batch["sample_id"].tolist()
        assert ids == [(n * 2 + 1) * 3 + j for j in range(3)]  # (n·W + r)·B + j
        for j, p in enumerate(ids):
            assert torch.equal(batch["text"][j], torch.as_tensor(ds[p]["text"])), (step, n, p)
        pids = pids or loader.worker_pids()
        assert loader.worker_pids() == pids and len(pids) == 2, step
        quorum.commit(ok=step != 17)  # step 17 fails: the same rows at step 18
    assert loader.workers.discarded > 0  # the old plans' prefetch was there, and dropped
    assert loader.built_here == 4  # steps 0, 10, 18 (the repeat) and 20
    # Built on the trainer's own thread, watched by the guard: no helper thread was started.
    started = {t.name for t in set(threading.enumerate()) - before if t.name.startswith("statefulset")}
    assert started == {"statefulset-torchft-watch"}  # torch's queue feeders aside
    assert sorted(p.pid for p in multiprocessing.active_children()) == sorted(pids)
    del loader, batch, pool
    gc.collect()
    wait_for(lambda: not multiprocessing.active_children(), "the dropped loader's workers to exit", 30)


TRAINER = """
import json, os, sys, time
from statefulset import WorkerConfig, get_train_dataset
from statefulset.integrations.torchft import FaultTolerantLoader

class Quorum:  # torchft's answers for one quorum of 2, this replica rank 1
    def start_quorum(self): pass
    def num_participants(self): return 2
    def participating_rank(self): return 1
    def is_participating(self): return True
    def batches_committed(self): return 0
    def current_step(self): return 0

if sys.argv[4] == "start":  # gate: the workers are still starting when the trainer is killed
    os.register_at_fork(after_in_child=lambda: time.sleep(5))
if sys.argv[4] == "checked":  # gate: each worker waits, after its check of the trainer, until the test killed it
    from statefulset.shards import storage_stats
    attach = storage_stats.attach
    def gated(*args):
        for _ in range(1200):
            if os.path.exists(sys.argv[2] + ".killed"):
                break
            time.sleep(0.1)
        attach(*args)
    storage_stats.attach = gated
wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
loader = FaultTolerantLoader(get_train_dataset(sys.argv[1], batch_size=2, worker_config=wc), Quorum())
for _ in range(int(sys.argv[3])):  # the first is built in the trainer, the next by the workers
    next(loader)
open(sys.argv[2], "w").write(json.dumps(loader.worker_pids()))
time.sleep(600)
"""


@pytest.mark.parametrize(
    ("batches", "gate"),
    [(1, "start"), (3, "none"), (1, "checked")],
    ids=["while-workers-start", "after-workers-served", "after-the-workers-checked-their-trainer"],
)
def test_the_workers_die_with_a_trainer_killed_by_sigkill(spec, tmp_path, batches, gate):
    """The persistent workers outlive plans, not their trainer: SIGKILLed, it leaves none behind,
    whether the workers had served batches or were still starting (the first batch is the trainer's;
    gate "start": each forked child sleeps 5 s before it runs anything, so the kill lands during the
    start; gate "checked": each worker waits after its own check that the trainer lives, before
    torch's watch of its parent begins, until the trainer is killed: torch's watch then takes init
    for the trainer, and the worker stayed, polling for requests, before statefulset watched on)."""
    out = tmp_path / "pids.json"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, spec, str(out), str(batches), gate])
    try:
        wait_for(lambda: out.exists() and out.read_text(), "the trainer to write its worker pids", 120)
        pids = json.loads(out.read_text())
        assert len(pids) == 2 and all(alive(p) for p in pids)
    finally:
        trainer.kill()
        trainer.wait(timeout=30)
        Path(str(out) + ".killed").write_text("")  # the gated workers go on
    # torch's workers look at their parent every 5 s (MP_STATUS_CHECK_INTERVAL) and leave.
    left = {p: describe(p) for p in wait_gone(pids, 60)}
    for p in left:  # not left behind by a failing run either
        os.kill(p, signal.SIGKILL)
    assert not left, f"workers still running 60 s after their trainer was SIGKILLed: {left}"


class AddsNoise:
    """Changes the tokens in place (keyed draws): batches keep the dataset's layout, so they travel in the ring."""

    def encode_sample(self, sample, rng):
        sample.text = sample.text + rng.integers(0, 100, size=sample.text.shape)
        return sample


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor | numpy.ndarray):
        return value.tolist()
    return value


@pytest.mark.parametrize("encoder", [AddsNoise, Nested])
def test_encoded_batches_through_re_targeted_workers_are_the_trainers_own(spec, encoder):
    """With a task encoder, what the workers serve across quorum changes (through the ring, or packed)
    is what the trainer process builds for the same steps without workers."""
    served = []
    for workers in (0, 2):
        quorum = ScriptedQuorum(3, 1)
        wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
        loader = FaultTolerantLoader(
            get_train_dataset(spec, batch_size=4, worker_config=wc, task_encoder=encoder()), quorum
        )
        taken = []
        for step in range(30):
            if step in (10, 20):
                quorum.participants, quorum.rank = (2, 0) if step == 10 else (3, 2)
            taken.append(_plain(next(loader)))
            quorum.commit()
        loader.close()
        served.append(taken)
    assert served[0] == served[1]


class HoldsSample:
    """An identity encoder that holds sample ``held`` until ``gate`` is set (a stalled read, on the
    trainer's helper thread: FaultTolerantLoader builds off-plan steps there)."""

    def __init__(self, gate, held: int) -> None:
        self.gate, self.held = gate, held

    def encode_sample(self, sample):
        if sample.sample_id == self.held:
            self.gate.wait(60)
        return sample


def test_a_group_joining_below_a_lone_replica_gets_it_a_batch_its_workers_built(spec):
    """A replica alone (stride 1) is joined by a group below it: its batch is now the next but one of
    its plan, which the trainer already holds (the workers' bundles of one batch, then 2, then 4:
    after step 4 the trainer holds three). It is served from there (the trainer builds nothing), the
    one before it is dropped unserved, and every row is the dataset's at the position the quorum
    places it; so are the next plan's rows."""
    quorum = ScriptedQuorum(1, 0)
    ds = get_train_dataset(spec, batch_size=3, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=2))
    loader = FaultTolerantLoader(ds, quorum, prefetch_factor=2)
    served = []
    for step in range(10):
        if step == 5:
            quorum.participants, quorum.rank = 2, 1
        batch = next(loader)
        n = loader.last.replica_batch
        assert n == quorum.committed + quorum.rank
        ids = batch["sample_id"].tolist()
        assert ids == [n * 3 + j for j in range(3)]
        assert batch["text"].tolist() == [ds[p]["text"].tolist() for p in ids], (step, n)
        served.append(n)
        quorum.commit()
    assert served == [0, 1, 2, 3, 4, 6, 8, 10, 12, 14]
    assert loader.built_here == 1  # the first step only: step 5's batch came from the workers
    loader.close()


def test_a_build_given_up_on_is_never_served_as_another_replica_batch(spec):
    """The watchdog gave up on replica-batch 0 while the trainer's helper thread still built it; the
    quorum then moved this replica to replica-batch 1. The late build of 0 comes first and is
    dropped: next() serves replica-batch 1's own rows (it served 0's before this was tagged)."""
    import threading

    gate = threading.Event()
    quorum = ScriptedQuorum(1, 0)
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)  # every step is built in the trainer
    ds = get_train_dataset(spec, batch_size=3, worker_config=wc, task_encoder=HoldsSample(gate, held=0))
    loader = FaultTolerantLoader(ds, quorum, watchdog_timeout_seconds=0.3, fail_on_timeout=True)
    with pytest.raises(StatefulsetError, match="replica-batch 0"):
        next(loader)
    quorum.participants, quorum.rank = 2, 1  # another quorum: this replica's batch is now 1
    gate.set()  # the build of replica-batch 0 finishes late
    batch = next(loader)
    assert loader.last.replica_batch == 1
    assert batch["sample_id"].tolist() == [3, 4, 5]
    assert batch["text"].tolist() == [ds[p].text.tolist() for p in (3, 4, 5)]


def test_a_stream_that_does_not_repeat_ends_after_its_last_whole_replica_batch(tmp_path):
    """A finite stream (packing megatron, 100 samples) without repeat: a replica-batch of W = 2 ranks of
    B = 3 rows is served while its rows lie inside the stream (replica-batches 0 .. 15, positions < 96),
    and the stable quorum's next step, which the plan's prefetch covers, ends the iteration instead."""
    spec = demo_spec(str(tmp_path), packing="megatron", documents=600, num_samples=100)
    wc = WorkerConfig(rank=1, world_size=2, num_workers=2)
    ds = get_train_dataset(spec, batch_size=3, worker_config=wc, repeat=False)
    assert len(ds.stream) == 100
    quorum = ScriptedQuorum(2, 1)
    loader = FaultTolerantLoader(ds, quorum)
    served = []
    with pytest.raises(StopIteration):
        for _ in range(20):
            quorum.start_quorum()
            batch = next(loader)
            served.append(loader.last.replica_batch)
            assert batch["sample_id"].tolist() == [(served[-1] * 2 + 1) * 3 + j for j in range(3)]
            quorum.commit()
    assert served == list(range(1, 16, 2))  # 17 would read positions 105 .. 107
    assert loader.built_here == 1  # the first step; the others came from the plan's workers
    loader.close()
