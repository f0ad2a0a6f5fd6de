"""Live elasticity with torchft: replica groups killed and restarted mid-run, every sample trained exactly once.

Runs with no arguments on CPU (docs/torchft.md). It starts torchft's lighthouse on loopback and 3
replica groups as processes (one rank each, gloo, gradients averaged by ``manager.allreduce`` over a tiny model, a
``FaultTolerantLoader`` with 1 DataLoader worker), then, while they train for 60 steps:

1. SIGKILLs replica 1 in the middle of a step (after it took its batch, before the commit);
2. makes every replica's commit fail once (``manager.report_error`` before ``should_commit``);
3. starts replica 1 again, which heals from its peers and joins.

Each replica logs, for every step it runs, the replica-batch it was served (``loader.last``), the
sample ids it got, and whether its commit went through. The verdict: every replica-batch below the
committed frontier ``batches_committed()`` was consumed by exactly one committed step, with the
sample ids the layout puts there; the failed step's replica-batches were served again. Prints one
verdict line and exits 1 otherwise.

A replica group alone (what a job launcher starts, once per replica group)::

    python examples/torchft_replicas.py --replica 0 --lighthouse http://HOST:29510 --spec dataset.yaml \\
        --steps 1000 --log replica0.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

BATCH = 4  # rows per rank of a replica group
WAIT = 120.0  # the longest any wait of the harness lasts (seconds); each names what it waited for


# -- one replica group --------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """SIGKILL this process when the harness that started it ends (Linux), and watch for it elsewhere."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):  # absent, or being written
        return None


def _write_int(path: str, value: int) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(str(value))
    os.replace(path + ".tmp", path)


def _gate(path: str, step: int) -> None:
    """Wait here, mid-step, until the harness SIGKILLs this process (so the kill always lands here)."""
    _write_int(path, step)
    time.sleep(WAIT)
    raise SystemExit(f"replica gated at {path} was not killed within {WAIT:g} s")


def _hold(control: str, step: int) -> None:
    """Before a step at or past the harness's hold step, wait until the harness lifts the hold."""
    hold = os.path.join(control, "hold")
    first = _read_int(hold)
    if first is None or step < first:
        return
    deadline = time.monotonic() + WAIT
    while os.path.exists(hold):
        if time.monotonic() > deadline:
            raise SystemExit(f"the harness did not lift {hold} within {WAIT:g} s")
        time.sleep(0.01)


def _manager(args: argparse.Namespace, model, optimizer, store, rank: int):
    """A torchft Manager for rank ``rank`` of the replica group, talking to the harness's lighthouse."""
    from torchft import Manager, ProcessGroupGloo

    return Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)),
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), optimizer.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        min_replica_size=2,  # a majority of the 3 replica groups: no two quorums at once (split brain)
        replica_id=f"replica_{args.replica}",
        lighthouse_addr=args.lighthouse,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=rank,
        world_size=args.group_size,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=60),
        quorum_timeout=timedelta(seconds=WAIT),
        connect_timeout=timedelta(seconds=60),
        init_sync=False,  # the same seed gives every replica the same weights: no weight sync at step 0
    )


class SamplerBatches:
    """For the comparison only: torchft's own ``DistributedSampler`` (shard ``replica`` of 3) under a
    DataLoader. ``saved``: the number of batches this replica had finished, read at start (a per-replica
    loader checkpoint written every step, as torchtitan's fault-tolerant mode does), or None (no checkpoint)."""

    def __init__(self, dataset, replica: int, saved: int | None, workers: int) -> None:
        from torch.utils.data import DataLoader, Dataset
        from torchft.data import DistributedSampler

        class Positions(Dataset):
            def __len__(self) -> int:
                return 1_000_000

            def __getitem__(self, p: int):
                return dataset[p]

        sampler = DistributedSampler(Positions(), replica_rank=replica, num_replica_groups=3, group_rank=0,
                                     num_replicas=1, shuffle=False)  # fmt: skip
        order = list(sampler)[(saved or 0) * BATCH :]
        self.iterator = iter(DataLoader(Positions(), batch_size=BATCH, sampler=order, num_workers=workers))
        self.taken = saved or 0

    def __next__(self):
        self.taken += 1
        return next(self.iterator)


def replica(args: argparse.Namespace) -> None:
    """One replica group: ``--group-size`` ranks (threads of this process when more than one, as
    torchft's own tests run them), each data parallel over a tiny model, fed by a FaultTolerantLoader."""
    _die_with_parent()
    import torch
    from torch.distributed import TCPStore

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the replica group's; kept alive
    log = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # one line per write: whole lines
    if args.group_size == 1:
        _rank(args, 0, store, log)
    else:
        failed: list[BaseException] = []

        def run(rank: int) -> None:
            try:
                _rank(args, rank, store, log)
            except BaseException as exc:
                failed.append(exc)

        threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(args.group_size)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 3600
        while any(t.is_alive() for t in threads) and not failed:
            if time.monotonic() > deadline:
                raise SystemExit("the replica group's ranks ran for an hour: a hang")
            time.sleep(0.1)
        if failed:
            raise failed[0]
    os.close(log)


def _rank(args: argparse.Namespace, rank: int, store, log: int) -> None:
    """One rank of the replica group: the training loop, logging what it was served and committed."""
    import torch

    from statefulset import WorkerConfig, get_train_dataset
    from statefulset.integrations.torchft import FaultTolerantLoader

    torch.manual_seed(0)  # every replica starts from the same weights
    model = torch.nn.Linear(args.seq_length, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    manager = _manager(args, model, optimizer, store, rank)
    wc = WorkerConfig(rank=rank, world_size=args.group_size, num_workers=args.workers)  # within the replica group
    dataset = get_train_dataset(args.spec, batch_size=BATCH, worker_config=wc)
    saved = os.path.join(args.control, f"saved-{args.replica}")  # the sampler-checkpoint comparison's file
    if args.loader == "statefulset":
        loader = FaultTolerantLoader(dataset, manager)
    else:
        loader = SamplerBatches(dataset, args.replica, _read_int(saved) if args.loader == "sampler-ckpt" else None,
                                args.workers)  # fmt: skip
    me = {"replica": args.replica, "pid": os.getpid(), "group_rank": rank}
    os.write(log, (json.dumps({"event": "ready", **me}) + "\n").encode())
    kill = os.path.join(args.control, f"kill-{args.replica}")
    failed_once = False
    while manager.current_step() < args.steps:
        _hold(args.control, manager.current_step())
        manager.start_quorum()
        batch = next(loader)
        if isinstance(loader, FaultTolerantLoader):
            served = loader.last._asdict()
        else:
            served = {"step": manager.current_step(), "replica_batch": None, "counted": manager.is_participating(),
                      "participants": manager.num_participants(),
                      "committed_before": manager.batches_committed()}  # fmt: skip
        record = {**me, "t": time.time(), **served, "ids": batch["sample_id"].tolist()}
        os.write(log, (json.dumps({"event": "served", **record}) + "\n").encode())
        kill_at = _read_int(kill)
        if rank == 0 and kill_at is not None and served["counted"] and served["step"] >= kill_at:
            _gate(kill + ".gate", served["step"])
        text = batch["text"].float() / 256
        loss = torch.nn.functional.mse_loss(model(text[:, :-1]).squeeze(1), text[:, -1])
        loss.backward()
        for p in model.parameters():  # data parallelism across the replica groups: the mean gradient
            manager.allreduce(p.grad).wait()  # zeroed on a replica that is not participating
        injected = args.fail_commit_at == served["step"] and not failed_once
        if injected:
            failed_once = True
            manager.report_error(RuntimeError(f"commit made to fail at step {served['step']}"))
        committed = manager.should_commit()
        if committed:
            optimizer.step()
        optimizer.zero_grad()
        outcome = {**me, "step": served["step"], "committed": committed, "injected": injected,
                   "batches_committed": manager.batches_committed()}  # fmt: skip
        os.write(log, (json.dumps({"event": "commit", **outcome}) + "\n").encode())
        if isinstance(loader, SamplerBatches):
            _write_int(saved, loader.taken)  # the per-step loader checkpoint of the comparison
    # The loader's workers are forked once and re-targeted at each quorum change: no more than
    # its own are left.
    deadline = time.monotonic() + 30
    while len(multiprocessing.active_children()) > args.workers * args.group_size and time.monotonic() < deadline:
        time.sleep(0.05)
    children = len(multiprocessing.active_children())
    os.write(log, (json.dumps({"event": "final", **me, "children": children}) + "\n").encode())
    manager.shutdown(wait=False)


# -- the verdict -----------------------------------------------------------------------------------------


def attempts(records: list[dict]) -> list[tuple[dict, dict | None]]:
    """Each served record with the commit record that followed it in the same process (None: killed first)."""
    out, open_serves = [], {}
    for r in records:
        key = (r["replica"], r["pid"], r.get("group_rank", 0))
        if r["event"] == "served":
            if key in open_serves:
                out.append((open_serves[key], None))
            open_serves[key] = r
        elif r["event"] == "commit" and key in open_serves:
            out.append((open_serves.pop(key), r))
    out.extend((served, None) for served in open_serves.values())
    return out


def check_exactly_once(records: list[dict], batch_size: int = BATCH, group_size: int = 1) -> dict:
    """Raise AssertionError unless every replica-batch below the committed frontier was consumed by
    exactly one committed step, with the sample ids the layout puts there; return a summary.

    A committed step with ``k`` participants starting at ``C = batches_committed()`` consumes
    replica-batches ``C .. C+k-1``, one per participant; the steps must tile ``0 .. frontier``.
    """
    pairs = attempts(records)
    steps: dict[int, tuple[int, int]] = {}  # committed step -> (batches_committed before it, participants)
    frontier = 0
    for served, outcome in pairs:
        n = served["replica_batch"]
        first = (n * group_size + served["group_rank"]) * batch_size  # (n·W + r)·B
        assert served["ids"] == list(range(first, first + batch_size)), f"wrong rows for replica-batch {n}: {served}"
        if outcome is None or not outcome["committed"]:
            continue
        s, place = served["step"], (served["committed_before"], served["participants"])
        assert steps.setdefault(s, place) == place, f"step {s} committed in two quorums: {steps[s]} and {place}"
        assert outcome["batches_committed"] == sum(place), f"the commit of step {s} moved the frontier oddly"
        frontier = max(frontier, outcome["batches_committed"])
    edge = 0
    for s in sorted(steps):
        before, k = steps[s]
        assert before == edge, f"step {s} began at replica-batch {before} with the frontier at {edge}: lost or repeated"
        edge = before + k
    assert edge == frontier, f"the committed steps end at replica-batch {edge}, the managers say {frontier}"
    served_at = {
        (a["step"], a["committed_before"], a["participants"], a["replica_batch"], a["group_rank"]): a for a, _ in pairs
    }
    zeroed = []
    for s, (before, k) in steps.items():
        for n in range(before, before + k):
            for r in range(group_size):
                a = served_at.get((s, before, k, n, r))
                assert a is not None, f"rank {r}'s rows of replica-batch {n} (committed step {s}) were served to no one"
                if not a["counted"]:
                    zeroed.append(n)  # counted by torchft, gradients zeroed (init_sync at step 0)
    return {"steps": len(steps), "frontier": frontier, "samples": frontier * group_size * batch_size,
            "zeroed": sorted(zeroed)}  # fmt: skip


def read_logs(folder: str) -> list[dict]:
    records = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as f:
                records.extend(json.loads(line) for line in f if line.strip())
    return records


# -- the harness ------------------------------------------------------------------------------------------


class Run:
    """A lighthouse on loopback and replica groups as child processes; every wait bounded and named.

    The harness steers the replicas through files in ``control/``: ``kill-<replica>`` (a step: the
    replica stops mid-step at its first counted step from there, at a gate, and the harness
    SIGKILLs it there) and ``hold`` (a step: replicas wait before it until the file is removed, so
    the survivors cannot finish the run before a restarted replica has joined).
    """

    def __init__(
        self, folder: str, spec: str, steps: int, fail_commit_at: int | None = None, workers: int = 1,
        loader: str = "statefulset", group_size: int = 1,
    ) -> None:  # fmt: skip
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at INFO otherwise
        from torchft.coordination import LighthouseServer

        self.folder, self.spec, self.steps, self.workers = folder, spec, steps, workers
        self.fail_commit_at = fail_commit_at
        self.loader = loader
        self.group_size = group_size
        self.control = os.path.join(folder, "control")
        os.makedirs(self.control, exist_ok=True)
        # min_replicas 2 of 3: a majority, so two quorums never commit the same step (split brain).
        self.lighthouse = LighthouseServer(
            bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=1500
        )
        self.processes: dict[int, subprocess.Popen] = {}
        self.kills: list[tuple[int, int]] = []  # (replica, step it was killed in)

    def log(self, replica: int) -> str:
        return os.path.join(self.folder, f"replica{replica}.jsonl")

    def start(self, replica: int) -> None:
        command = [sys.executable, os.path.abspath(__file__), "--replica", str(replica),
                   "--lighthouse", self.lighthouse.address(), "--spec", self.spec, "--steps", str(self.steps),
                   "--log", self.log(replica), "--control", self.control, "--workers", str(self.workers),
                   "--loader", self.loader, "--group-size", str(self.group_size)]  # fmt: skip
        if self.fail_commit_at is not None:
            command += ["--fail-commit-at", str(self.fail_commit_at)]
        with open(os.path.join(self.folder, f"replica{replica}.out"), "a") as out:
            self.processes[replica] = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def committed_step(self) -> int:
        """The highest step any replica committed so far (-1: none)."""
        done = [r["step"] for r in read_logs(self.folder) if r["event"] == "commit" and r["committed"]]
        return max(done, default=-1)

    def ready(self, replica: int) -> bool:
        """Whether the replica's current process has built its manager and loader."""
        pid = self.processes[replica].pid
        return any(r["event"] == "ready" and r["pid"] == pid for r in read_logs(self.folder))

    def wait_for(self, what: str, ready) -> None:
        deadline = time.monotonic() + WAIT
        while not ready():
            for replica, p in self.processes.items():
                if p.poll() not in (None, 0, -signal.SIGKILL):
                    raise AssertionError(f"replica {replica} failed (exit {p.returncode}) while waiting for {what}:\n"
                                         + self.output(replica))  # fmt: skip
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {WAIT:g} s for {what}")
            time.sleep(0.02)

    def _write(self, name: str, value: int) -> None:
        _write_int(os.path.join(self.control, name), value)

    def kill_and_restart(self, replica: int, at_step: int) -> int:
        """SIGKILL ``replica`` mid-step at its first counted step from ``at_step``; let the others commit
        two steps without it; start it again and let it join. Returns the step it was killed in."""
        kill = os.path.join(self.control, f"kill-{replica}")
        self._write(f"kill-{replica}", at_step)
        self.wait_for(f"replica {replica} to stop at its kill gate (step {at_step} or later)",
                      lambda: os.path.exists(kill + ".gate"))  # fmt: skip
        gated = _read_int(kill + ".gate")
        self._write("hold", gated + 3)  # the others wait before step gated+3 until the restart joined
        p = self.processes[replica]
        p.kill()
        p.wait(timeout=WAIT)
        os.remove(kill)
        os.remove(kill + ".gate")
        self.kills.append((replica, gated))
        self.wait_for(f"the others to commit step {gated + 2} without replica {replica}",
                      lambda: self.committed_step() >= gated + 2)  # fmt: skip
        self.start(replica)
        self.wait_for(f"replica {replica} to start again", lambda: self.ready(replica))
        os.remove(os.path.join(self.control, "hold"))
        return gated

    def finish(self) -> None:
        """Wait for every replica to end after the last step (bounded), then stop the lighthouse."""
        try:
            self.wait_for(f"every replica to finish {self.steps} steps",
                          lambda: all(p.poll() is not None for p in self.processes.values()))  # fmt: skip
            bad = {r: p.returncode for r, p in self.processes.items() if p.returncode != 0}
            assert not bad, f"replicas ended badly: {bad}\n" + "\n".join(self.output(r) for r in bad)
        finally:
            self.close()

    def close(self) -> None:
        for p in self.processes.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=WAIT)
        self.lighthouse.shutdown()

    def output(self, replica: int) -> str:
        with open(os.path.join(self.folder, f"replica{replica}.out")) as f:
            return f.read()[-4000:]


def story(
    folder: str, spec: str, steps: int = 60, kills: int = 1, seed: int = 0, workers: int = 1,
    loader: str = "statefulset", group_size: int = 1,
) -> dict:  # fmt: skip
    """Three replica groups; ``kills`` times a random one killed mid-step and restarted; one commit
    made to fail on every replica. With our loader, raises AssertionError unless the run was exactly
    once; with torchft's sampler (``loader="sampler"``, ``"sampler-ckpt"``) only tallies what was trained."""
    rng = random.Random(seed)
    fail_at = rng.randrange(steps // 2, steps * 2 // 3)
    assert loader == "statefulset" or group_size == 1, "the sampler comparison runs replica groups of one rank"
    run = Run(folder, spec, steps, fail_commit_at=fail_at, workers=workers, loader=loader, group_size=group_size)
    try:
        for replica in range(3):
            run.start(replica)
        at = 0
        for _ in range(kills):
            at = rng.randrange(at + 5, at + 5 + (steps * 2 // 5 - at) // 2)
            at = run.kill_and_restart(rng.randrange(3), at)
    except BaseException:
        run.close()
        raise
    run.finish()
    records = read_logs(folder)
    summary = {"kills": run.kills, "failed_commit_at": fail_at, **tally(records)}
    if loader != "statefulset":
        return summary
    summary.update(check_exactly_once(records, group_size=group_size))
    failed = [(s, o) for s, o in attempts(records) if o is not None and o["injected"]]
    assert failed and not any(o["committed"] for _, o in failed), (
        f"the commit made to fail at step {fail_at} went through"
    )
    # The failed step was committed later from the same frontier: its replica-batches served again.
    steps_at = {s["step"]: s["committed_before"] for s, o in attempts(records) if o is not None and o["committed"]}
    for served, _ in failed:
        assert steps_at.get(served["step"]) == served["committed_before"], "a failed step was not served again"
    assert not summary["zeroed"], f"replica-batches counted with zeroed gradients: {summary['zeroed']}"
    assert summary["duplicated"] == 0 and summary["holes"] == 0, summary
    most = workers * group_size  # the loader's own workers, of each rank
    left = {r["replica"]: r["children"] for r in records if r["event"] == "final" and r["children"] > most}
    assert not left, f"more DataLoader workers than the loader's own alive at the end, per replica: {left}"
    return summary


def tally(records: list[dict]) -> dict:
    """What the committed steps trained on: samples, repeats, and holes below the highest one trained."""
    trained: list[int] = []
    for served, outcome in attempts(records):
        if outcome is not None and outcome["committed"] and served["counted"]:
            trained.extend(served["ids"])
    distinct = set(trained)
    top = max(distinct, default=-1)
    return {
        "trained": len(trained),
        "distinct": len(distinct),
        "duplicated": len(trained) - len(distinct),
        "holes": top + 1 - len(distinct),  # positions below the highest trained one never trained
        "healing_steps": sum(1 for s, _ in attempts(records) if not s["counted"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replica", type=int, help="run one replica group with this id")
    parser.add_argument("--lighthouse", help="the lighthouse's address")
    parser.add_argument("--spec", help="dataset spec (YAML)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log", help="JSON lines: what this replica was served and committed")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers of each rank")
    parser.add_argument("--group-size", type=int, default=1, help="ranks of the replica group (threads)")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--control", help="the harness's control folder (kill and hold files)")
    parser.add_argument("--loader", default="statefulset", choices=["statefulset", "sampler", "sampler-ckpt"],
                        help="sampler, sampler-ckpt: torchft's DistributedSampler (for docs/torchft.md)")  # fmt: skip
    parser.add_argument("--fail-commit-at", type=int, help="report an error before the commit of this step, once")
    args = parser.parse_args()
    if args.replica is not None:
        replica(args)
        return
    from statefulset.tools.demo import demo_spec

    with tempfile.TemporaryDirectory() as folder:
        spec = demo_spec(os.path.join(folder, "corpus"), documents=600)
        logs = os.path.join(folder, "logs")
        os.makedirs(logs)
        try:
            summary = story(logs, spec, steps=args.steps)
        except AssertionError as exc:
            print(f"torchft_replicas: FAILED: {exc}")
            sys.exit(1)
    print(
        f"torchft_replicas: OK: 3 replica groups, replica {summary['kills'][0][0]} killed in step "
        f"{summary['kills'][0][1]} and healed, "
        f"the commit of step {summary['failed_commit_at']} failed and was served again; {summary['steps']} "
        f"committed steps consumed replica-batches 0..{summary['frontier'] - 1} exactly once"
    )


if __name__ == "__main__":
    main()
