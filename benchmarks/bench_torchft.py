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
  the loop is bound by the loader, the hardest case for the workers).

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


class Quorum:
    """What torchft's Manager answers for a scripted quorum: ``participants`` replica groups, this one
    of rank ``rank``; each commit adds ``participants`` to ``batches_committed`` (torchft's rule)."""

    def __init__(self, participants: int, rank: int) -> None:
        self.participants, self.rank, self.step, self.committed = participants, rank, 0, 0

    def start_quorum(self) -> None:
        pass

    def num_participants(self) -> int:
        return self.participants

    def participating_rank(self) -> int:
        return self.rank

    def is_participating(self) -> bool:
        return True

    def batches_committed(self) -> int:
        return self.committed

    def current_step(self) -> int:
        return self.step

    def commit(self) -> None:
        self.step += 1
        self.committed += self.participants


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


def change_times(spec: str, batch: int, workers: int, steps: int, every: int, compute_ms: float) -> dict:
    """Data time of the first step after each quorum change, and of the other steps (seconds)."""
    from statefulset.integrations.torchft import FaultTolerantLoader

    quorum = Quorum(3, 1)
    loader = FaultTolerantLoader(_dataset(spec, batch, workers), quorum)
    first, normal = [], []
    for step in range(steps):
        if step and step % every == 0:  # 3 -> 2 -> 3 participants; the rank moves with them
            quorum.participants, quorum.rank = (2, 0) if quorum.participants == 3 else (3, 2)
        quorum.start_quorum()
        start = time.perf_counter()
        next(loader)
        took = time.perf_counter() - start
        if step >= every:  # the first stretch warms up (workers start)
            (first if step % every == 0 else normal).append(took)
        quorum.commit()
        if compute_ms:
            time.sleep(compute_ms / 1000)
    # A normal step's data time is the mean: batches arrive in bundles, so most next() calls only
    # pop one (microseconds) and the median would hide the build time.
    return {"first_after_change": statistics.median(first), "normal": statistics.fmean(normal)}


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
    changes: dict[str, list[float]] = {"first_after_change": [], "normal": [], "ratio": []}
    for r in range(args.repeats):
        for kind in ("plain", "fault_tolerant") if r % 2 == 0 else ("fault_tolerant", "plain"):
            runs[kind].append(tokens_per_second(spec, kind, args.batch, args.workers, args.batches))
        times = change_times(spec, args.batch, args.workers, args.batches, args.change_every, args.compute_ms)
        for key, value in times.items():
            changes[key].append(value)
        changes["ratio"].append(times["first_after_change"] / times["normal"])
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


if __name__ == "__main__":
    main()
