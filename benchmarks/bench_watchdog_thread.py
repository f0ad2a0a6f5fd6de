"""What the watchdog costs with ``num_workers=0``: batches built on a helper thread, the wait bounded.

With no workers the trainer builds each micro-batch itself; for the watchdog to notice a stalled
read the build runs on a helper thread (statefulset.loading.watchdog.InProcessSource), and each
batch then costs a request and an answer between two threads. This measures the trainer's time
per batch with the watchdog on (the default, 60 s) and off (``watchdog_timeout_seconds=None``:
the trainer's own thread, as before), alternating, over small batches where the hand-off weighs
most (a 4 x 129 micro-batch of a local native-packed corpus): wall time and this process's CPU
time per batch (on a loaded machine the CPU time is the steadier figure). Also the hand-off
alone: ``InProcessSource.get`` against a plain ``next`` over an iterator that costs nothing.

    python benchmarks/bench_watchdog_thread.py [--repeats 5] [--batches 20000]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

BATCH, SEQ = 4, 128


def per_batch_us(spec: str, watchdog: float | None, batches: int) -> tuple[float, float]:
    from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    loader = get_savable_loader(
        get_train_dataset(spec, batch_size=BATCH, worker_config=wc), watchdog_timeout_seconds=watchdog
    )
    for _ in range(200):  # warm: caches, first-batch costs
        next(loader)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        next(loader)
    return (time.perf_counter() - start) / batches * 1e6, (time.process_time() - cpu) / batches * 1e6


def handoff_us(threaded: bool, items: int) -> float:
    import itertools

    from statefulset.loading.watchdog import InProcessSource

    iterator = itertools.repeat(None)
    get = InProcessSource(iterator).get if threaded else (lambda _period: next(iterator))
    start = time.perf_counter()
    for _ in range(items):
        get(60.0)
    return (time.perf_counter() - start) / items * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=20000)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "bench_watchdog_thread.json"))
    parser.add_argument("--quick", action="store_true", help="smoke run (3 runs of 500 batches)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.batches = 3, 500
        args.out = os.path.join(HERE, "out", "quick", "bench_watchdog_thread.json")

    import torch
    from benchenv import environment, git_state, load_average, spread

    from statefulset.tools.demo import demo_spec

    torch.set_num_threads(1)
    spec = demo_spec(tempfile.mkdtemp(prefix="bench-watchdog-"), documents=20000, seq_length=SEQ)
    runs: dict[str, list[float]] = {f"{k}_{m}": [] for k in ("watchdog_thread", "no_watchdog") for m in ("wall", "cpu")}
    handoff: dict[str, list[float]] = {"thread": [], "plain_next": []}
    for r in range(args.repeats):
        order = [("watchdog_thread", 60.0), ("no_watchdog", None)]
        for label, watchdog in order if r % 2 == 0 else order[::-1]:
            wall, cpu = per_batch_us(spec, watchdog, args.batches)
            runs[f"{label}_wall"].append(wall)
            runs[f"{label}_cpu"].append(cpu)
        handoff["thread"].append(handoff_us(True, args.batches))
        handoff["plain_next"].append(handoff_us(False, args.batches))
    summary = {label: spread(values) for label, values in runs.items()}
    handoff_summary = {label: spread(values) for label, values in handoff.items()}
    result = {
        "environment": environment(),
        "git": git_state(),
        "load": load_average(),
        "batch": [BATCH, SEQ + 1],
        "batches_per_run": args.batches,
        "us_per_batch_runs": runs,
        "us_per_batch": summary,
        "handoff_us_runs": handoff,
        "handoff_us": handoff_summary,
        "overhead_us_per_batch": {
            "wall": summary["watchdog_thread_wall"]["median"] - summary["no_watchdog_wall"]["median"],
            "cpu": summary["watchdog_thread_cpu"]["median"] - summary["no_watchdog_cpu"]["median"],
            "handoff": handoff_summary["thread"]["median"] - handoff_summary["plain_next"]["median"],
        },
    }
    from provenance import write_results

    write_results("bench_watchdog_thread", result, path=args.out, quick=args.quick)
    print(f"num_workers=0, micro-batch {BATCH} x {SEQ + 1}, {args.batches} batches, {args.repeats} runs each")
    for label, sp in {**summary, **{f"handoff_{k}": v for k, v in handoff_summary.items()}}.items():
        print(f"  {label}: median {sp['median']:.1f} us (min {sp['min']:.1f}, max {sp['max']:.1f})")
    print(f"  watchdog thread, per batch (medians): {result['overhead_us_per_batch']}")


if __name__ == "__main__":
    main()
