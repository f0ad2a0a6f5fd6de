"""Time to the first batch with forked workers (watched for a stuck start) and with forkserver/spawn.

A forked DataLoader worker can deadlock at birth (CPython gh-112275; statefulset.loading.worker_start
notices it and starts the workers again). The other way out is a start method that never forks the
trainer: ``multiprocessing_context="forkserver"`` (workers fork from a single-threaded server) or
``"spawn"``. This measures what each costs where it matters, the first batch of a loader, in a
fresh process that has imported torch and statefulset and runs a thread of its own (as a trainer
with a process group does): the first loader of the process, then a second one in the same process
(a resumed or validation loader; forkserver's server is running by then). Also the steady rate,
to show the start watch costs nothing once the workers are up.

    python benchmarks/bench_worker_start.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

METHODS = ("fork", "forkserver", "spawn")
WORKERS, BATCH, SEQ = 2, 8, 2048


def child(spec: str, method: str, seconds: float) -> dict[str, float]:
    import threading

    import torch  # noqa: F401

    from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()  # a trainer is never single-threaded
    context = None if method == "fork" else method
    out: dict[str, float] = {}
    for label in ("first", "second"):
        wc = WorkerConfig(rank=0, world_size=1, num_workers=WORKERS)
        ds = get_train_dataset(spec, batch_size=BATCH, worker_config=wc)
        start = time.perf_counter()
        loader = get_savable_loader(ds, multiprocessing_context=context)
        next(loader)
        out[f"{label}_batch_s"] = time.perf_counter() - start
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        next(loader)
        count += 1
    out["batches_per_s"] = count / (time.perf_counter() - start)
    stop.set()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per start method")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed iteration per process")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "bench_worker_start.json"))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smoke run (1 process per method, 1 s)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.seconds = 1, 1.0
        args.out = os.path.join(HERE, "out", "quick", "bench_worker_start.json")
    if args.child:
        print(json.dumps(child(args.spec, args.child[0], float(args.child[1]))))
        return

    from benchenv import environment, git_state, load_average

    from statefulset.tools.demo import demo_spec

    folder = tempfile.mkdtemp(prefix="bench-worker-start-")
    spec = demo_spec(folder, documents=20000, seq_length=SEQ)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    for r in range(args.repeats):
        for method in METHODS[r % 3 :] + METHODS[: r % 3]:  # rotate the order
            done = subprocess.run(
                [sys.executable, __file__, "--child", method, str(args.seconds), "--spec", spec],
                capture_output=True,
                text=True,
                check=True,
            )
            runs[method].append(json.loads(done.stdout.strip().splitlines()[-1]))
    table = {}
    for method, rows in runs.items():
        table[method] = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    result = {"environment": environment(), "git": git_state(), "load": load_average(), "runs": runs, "median": table}
    from provenance import write_results

    write_results("bench_worker_start", result, path=args.out, quick=args.quick)
    fork = table["fork"]
    print(f"{WORKERS} workers, micro-batch {BATCH} x {SEQ + 1}; medians of {args.repeats} fresh processes\n")
    print("| start method | first loader: first batch | second loader: first batch | batches/s | vs fork |")
    print("|---|---|---|---|---|")
    for method, row in table.items():
        print(
            f"| {method} | {row['first_batch_s'] * 1000:.0f} ms | {row['second_batch_s'] * 1000:.0f} ms "
            f"| {row['batches_per_s']:.0f} | {row['first_batch_s'] / fork['first_batch_s']:.1f}x / "
            f"{row['second_batch_s'] / fork['second_batch_s']:.1f}x |"
        )


if __name__ == "__main__":
    main()
