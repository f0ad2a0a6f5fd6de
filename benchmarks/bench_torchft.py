"""FaultTolerantLoader's cost (issue 31): ``python benchmarks/bench_torchft.py [--quick]``.

Two figures, each over ``--repeats`` runs (median, min, max), the loaders alternated:

- **stable membership**: tokens/s of ``FaultTolerantLoader`` (rank 1 of 3 participating replica
  groups: its batches are every third replica-batch) against the plain savable loader on the same
  spec, batch and workers, ``--batches`` batches after a fifth as many untimed (worker start, first
  bundles). Target: at least 90%.
- **membership change**: every ``--change-every`` steps the quorum moves (3 participants, then 2,
  then 3 again; the replica's rank moves with it), so the prefetched plan is dropped. The data time
  (``next()``) of the first step after each change (median) against the mean data time of the other
  steps.
  Target: at most 2x. ``--compute-ms`` adds a training step's time between ``next()`` calls (0:
  the loop is bound by the loader, the hardest case for the workers). The refill is reported too:
  the second step after a change, the steady steps, and the extra data time of a whole stretch
  between changes over as many steady steps (what a change costs in all). The 2 -> 3 change moves
  the replica up by the old stride: its batch can be one the trainer already received from the
  workers; the first steps whose batch was built in the trainer are reported apart
  (``first_built_here``, ``ratio_built_here``: the cost of a change that no prefetch covers).

The manager is a stand-in answering the four questions the loader asks a ``torchft.Manager``
(``num_participants``, ``participating_rank``, ``is_participating``, ``batches_committed``) as
torchft does for the scripted quorums, so only the loader's time is measured; torchft's own
quorum and commit RPCs are the same for any loader. Real torchft runs are in tests/test_torchft.py.
Results: ``benchmarks/results/bench_torchft.json`` (``--quick``: ``benchmarks/out/quick/``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from quorums import ScriptedQuorum as Quorum  # noqa: E402  (torchft's Manager for a scripted quorum)


def _dataset(spec: str, batch: int, workers: int):
    from statefulset import WorkerConfig, get_train_dataset

    return get_train_dataset(
        spec, batch_size=batch, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=workers)
    )


def tokens_per_second(spec: str, kind: str, batch: int, workers: int, batches: int) -> float:
    from statefulset import get_savable_loader
    from statefulset.integrations.torchft import FaultTolerantLoader

    quorum = Quorum(3, 1)
    ds = _dataset(spec, batch, workers)
    loader = iter(get_savable_loader(ds)) if kind == "plain" else FaultTolerantLoader(ds, quorum)
    tokens, warm = 0, max(1, batches // 5)  # not timed: worker start, the first bundles
    for i in range(warm + batches):
        if i == warm:
            start = time.perf_counter()
        quorum.start_quorum()
        tokens += next(loader)["text"][:, :-1].numel() if i >= warm else 0
        quorum.commit()
    return tokens / (time.perf_counter() - start)


def _cpu_seconds(pid: int, thread: int | None = None) -> float:
    """CPU time of a process (or one of its threads) so far, from the kernel's schedstat (Linux)."""
    path = f"/proc/{pid}/task/{thread}/schedstat" if thread else f"/proc/{pid}/schedstat"
    with open(path) as f:
        return int(f.read().split()[0]) / 1e9


class CpuMeter:
    """``--cpu``: the CPU each step took in the trainer (all its threads), in its helper thread (the
    batches built in the trainer, when they are built there: with a task encoder or object storage;
    else on the trainer's own thread, 0 here) and in the workers, for a machine too loaded for wall
    clocks."""

    def __init__(self) -> None:
        self.rows: dict[str, list[tuple[float, float, float]]] = {"first": [], "second": [], "other": []}
        self.pids: list[int] = []
        self.helper: int | None = None

    def start(self, loader) -> tuple[float, float, float] | None:
        import threading

        if not self.pids:
            self.pids = loader.worker_pids()
            names = {t.name: t.native_id for t in threading.enumerate()}
            self.helper = names.get("statefulset-torchft-build")
        if not self.pids:
            return None
        helper = _cpu_seconds(os.getpid(), self.helper) if self.helper else 0.0
        return time.process_time(), helper, sum(_cpu_seconds(p) for p in self.pids)

    def stop(self, began: tuple[float, float, float] | None, kind: str) -> None:
        if began is not None:
            now = self.start(None)
            self.rows[kind].append(tuple(b - a for a, b in zip(began, now, strict=True)))  # type: ignore[arg-type]

    def summary(self) -> dict:
        out = {}
        for kind, rows in self.rows.items():
            pick = statistics.fmean if kind == "other" else statistics.median
            out[kind] = {k: pick(r[i] for r in rows) for i, k in enumerate(("trainer", "helper_thread", "workers"))}
        return out


def change_times(spec: str, batch: int, workers: int, steps: int, every: int, compute_ms: float, cpu: bool) -> dict:
    """Data time of the first step after each quorum change, and of the other steps (seconds).

    Also what the refill costs: the second step after a change (median; it waits for the stale
    results of the old plan and the new plan's first build), the steady steps (the mean of each
    stretch's steps from the tenth on) and the extra data time a whole stretch took over as many
    steady steps (its mean over stretches: what one change costs in all). ``cpu``: also the CPU of
    the first, second and other steps (CpuMeter), under ``"cpu"``."""
    from statefulset.integrations.torchft import FaultTolerantLoader

    quorum = Quorum(3, 1)
    loader = FaultTolerantLoader(_dataset(spec, batch, workers), quorum)
    meter = CpuMeter() if cpu else None
    stretches: list[list[float]] = []
    kinds: list[bool] = []  # per stretch: whether its first step's batch was built in the trainer
    for step in range(steps):
        if step and step % every == 0:  # 3 -> 2 -> 3 participants; the rank moves with them
            quorum.participants, quorum.rank = (2, 0) if quorum.participants == 3 else (3, 2)
        quorum.start_quorum()
        began = meter.start(loader) if meter is not None and step >= every else None
        built = loader.built_here
        start = time.perf_counter()
        next(loader)
        took = time.perf_counter() - start
        if meter is not None:
            meter.stop(began, ("first", "second")[step % every] if step % every < 2 else "other")
        if step >= every:  # the first stretch warms up (workers start)
            if step % every == 0:
                stretches.append([])
                kinds.append(loader.built_here > built)
            stretches[-1].append(took)
        quorum.commit()
        if compute_ms:
            time.sleep(compute_ms / 1000)
    loader.close()
    first = [s[0] for s in stretches]
    normal = [t for s in stretches for t in s[1:]]
    steady = statistics.fmean(t for s in stretches for t in s[10:])
    # A normal step's data time is the mean: batches arrive in bundles, so most next() calls only
    # pop one (microseconds) and the median would hide the build time.
    times = {
        "first_after_change": statistics.median(first),
        "normal": statistics.fmean(normal),
        "second_after_change": statistics.median(s[1] for s in stretches if len(s) > 1),
        "steady": steady,
        "extra_per_change": statistics.fmean(sum(s) - len(s) * steady for s in stretches if len(s) == every),
    }
    # The 2 -> 3 change moves this replica from rank 0 to 2: its batch is then the old plan's next but
    # one, served from the workers' batches when the trainer already holds it, else built in the
    # trainer, as every 3 -> 2 change's is (at the default sizes the new plan's bundles, 1, 2, 4 and
    # then 7 batches, end exactly at the next change: none is served so). Each kind's median, and
    # the share built here.
    for key, pick in (("first_built_here", True), ("first_from_workers", False)):
        picked = [f for f, k in zip(first, kinds, strict=True) if k is pick]
        if picked:
            times[key] = statistics.median(picked)
    times["share_built_here"] = sum(kinds) / len(kinds)
    return times if meter is None else {**times, "cpu": meter.summary()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--documents", type=int, default=20000)
    parser.add_argument("--change-every", type=int, default=50)
    parser.add_argument("--compute-ms", type=float, default=0.0)
    parser.add_argument("--cpu", action="store_true", help="also the CPU of the steps after a change (Linux)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="smoke run (3 runs, small sizes)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.batches, args.seq_length, args.documents, args.change_every = 3, 200, 128, 2000, 20

    import torch
    from benchenv import environment, git_state, load_average, spread
    from provenance import write_results

    from statefulset.tools.demo import demo_spec

    torch.set_num_threads(1)
    folder = os.path.join(HERE, "out", "torchft", f"d{args.documents}-s{args.seq_length}")
    spec = demo_spec(folder, documents=args.documents, seq_length=args.seq_length)
    runs: dict[str, list[float]] = {"plain": [], "fault_tolerant": []}
    changes: dict[str, list[float]] = {"ratio": []}
    cpu_runs: list[dict] = []
    for r in range(args.repeats):
        for kind in ("plain", "fault_tolerant") if r % 2 == 0 else ("fault_tolerant", "plain"):
            runs[kind].append(tokens_per_second(spec, kind, args.batch, args.workers, args.batches))
        times = change_times(spec, args.batch, args.workers, args.batches, args.change_every, args.compute_ms, args.cpu)
        if "cpu" in times:
            cpu_runs.append(times.pop("cpu"))
        for key, value in times.items():
            changes.setdefault(key, []).append(value)
        changes["ratio"].append(times["first_after_change"] / times["normal"])
        if "first_built_here" in times:
            changes.setdefault("ratio_built_here", []).append(times["first_built_here"] / times["normal"])
    ratios = [f / p for f, p in zip(runs["fault_tolerant"], runs["plain"], strict=True)]
    result = {
        "environment": environment(),
        "git": git_state(),
        "load": load_average(),
        "batch": [args.batch, args.seq_length + 1],
        "workers": args.workers,
        "batches_per_run": args.batches,
        "change_every": args.change_every,
        "compute_ms": args.compute_ms,
        "tokens_per_second_runs": runs,
        "tokens_per_second": {k: spread(v) for k, v in runs.items()},
        "stable_ratio": spread(ratios),
        "change_seconds_runs": changes,
        "change": {k: spread(v) for k, v in changes.items()},
    }
    if cpu_runs:
        result["change_cpu_seconds_runs"] = cpu_runs
    out = write_results("bench_torchft", result, path=args.out, quick=args.quick)
    print(f"{args.workers} workers, batch {args.batch} x {args.seq_length + 1}, {args.repeats} runs; results {out}")
    for kind, sp in result["tokens_per_second"].items():
        print(f"  {kind}: median {sp['median']:.0f} tokens/s (min {sp['min']:.0f}, max {sp['max']:.0f})")
    sr, ch = result["stable_ratio"], result["change"]
    print(f"  stable membership: {sr['median']:.2f} of the plain loader's tokens/s (target >= 0.90)")
    print(
        f"  first batch after a change: {ch['first_after_change']['median'] * 1e3:.2f} ms against "
        f"{ch['normal']['median'] * 1e3:.2f} ms, ratio {ch['ratio']['median']:.2f} (target <= 2)"
    )
    if "ratio_built_here" in ch:
        print(
            f"  of which built in the trainer ({ch['share_built_here']['median']:.0%} of changes): "
            f"{ch['first_built_here']['median'] * 1e3:.2f} ms, ratio {ch['ratio_built_here']['median']:.2f}; "
            f"from the workers' batches: {ch.get('first_from_workers', {}).get('median', float('nan')) * 1e3:.2f} ms"
        )
    print(
        f"  the refill: second step after a change {ch['second_after_change']['median'] * 1e3:.2f} ms, steady steps "
        f"{ch['steady']['median'] * 1e3:.2f} ms; a change costs {ch['extra_per_change']['median'] * 1e3:.2f} ms "
        "of data time in all"
    )
    for kind in ("first", "second", "other") if cpu_runs else ():
        parts = {k: statistics.median(run[kind][k] for run in cpu_runs) * 1e3 for k in cpu_runs[0][kind]}
        shown = ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
        print(f"  CPU of the {kind} step(s) after a change, median of runs (ms): {shown}")


if __name__ == "__main__":
    main()
