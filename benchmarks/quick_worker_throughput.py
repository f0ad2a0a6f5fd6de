"""Loader throughput by worker count, local files: ``python benchmarks/quick_worker_throughput.py [PREFIX]``.

Not the full benchmark (that is bench_loader.py): for each of 0, 1, 2 and 4 workers, three fresh
processes iterate ``get_savable_loader`` (native packing, micro-batch 8 x 2049 tokens, seed 3)
for ``--batches`` batches after the first; the median tokens/s is printed with min and max and
the ratio to 0 workers. PREFIX defaults to the 150M-token shard bench_object_storage.py writes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "s3", "c150m")


def child(prefix: str, workers: int, batches: int) -> float:
    from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

    spec = {"data_path": prefix, "seq_length": 2048, "split": "100,0,0", "packing": "native", "seed": 3}
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    loader = iter(get_savable_loader(get_train_dataset(spec, batch_size=8, worker_config=wc)))
    next(loader)  # workers started and warm
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    return batches * 8 * 2048 / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", nargs="?", default=DEFAULT)
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        job = json.loads(args.child)
        print(child(job["prefix"], job["workers"], job["batches"]))
        return
    if not os.path.exists(args.prefix + ".idx"):
        sys.exit(f"{args.prefix}.idx: no shard (run benchmarks/bench_object_storage.py once, or give a prefix)")
    base = None
    print("| workers | tokens/s, median (min–max) | ÷ 0 workers |\n|---|---|---|")
    for workers in (0, 1, 2, 4):
        job = json.dumps({"prefix": args.prefix, "workers": workers, "batches": args.batches})
        runs = [
            float(subprocess.run([sys.executable, __file__, "--child", job], capture_output=True, text=True,
                                 check=True).stdout)
            for _ in range(args.repeats)
        ]  # fmt: skip
        median = statistics.median(runs)
        base = base or median
        print(
            f"| {workers} | {median / 1e6:.1f}M ({min(runs) / 1e6:.1f}–{max(runs) / 1e6:.1f}M) | {median / base:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
