"""Loader throughput by worker count, local files: ``python benchmarks/quick_worker_throughput.py [PREFIX]``.

Not the full benchmark (that is bench_loader.py): for each of 0, 1, 2 and 4 workers, three fresh
processes iterate ``get_savable_loader`` (native packing, micro-batch 8 x 2049 tokens, seed 3)
for ``--batches`` batches after the first, the worker counts alternating (0 1 2 4 0 1 2 4 ...).
Median tokens/s with min and max, and the ratio to 0 workers per round (median, min, max),
are printed and written to ``benchmarks/results/quick_worker_throughput.json``. PREFIX defaults
to the 150M-token shard bench_object_storage.py writes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
DEFAULT = os.path.join(HERE, "out", "s3", "c150m")
WORKERS = (0, 1, 2, 4)


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


def _small_shard() -> str:
    """A 20,000-document shard for ``--quick`` (written once under benchmarks/out/quick)."""
    import numpy
    from corpus import make_corpus

    from statefulset import IndexedDatasetWriter

    prefix = os.path.join(HERE, "out", "quick", "workers", "c20k")
    if not os.path.exists(prefix + ".idx"):
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        tokens, lengths = make_corpus(20_000)
        with IndexedDatasetWriter(prefix, dtype=numpy.uint16) as w:
            w.add_documents(tokens, lengths)
    return prefix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", nargs="?", default=DEFAULT)
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each round runs every worker count once")
    parser.add_argument("--quick", action="store_true", help="a 20,000-document shard, 200 batches")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        job = json.loads(args.child)
        print(child(job["prefix"], job["workers"], job["batches"]))
        return
    from provenance import alternate, ratio, write_results

    if args.quick:
        args.prefix, args.batches = _small_shard(), 200
    if not os.path.exists(args.prefix + ".idx"):
        sys.exit(f"{args.prefix}.idx: no shard (run benchmarks/bench_object_storage.py once, or give a prefix)")

    def run(workers: int) -> float:
        job = json.dumps({"prefix": args.prefix, "workers": workers, "batches": args.batches})
        done = subprocess.run([sys.executable, __file__, "--child", job], capture_output=True, text=True,
                              check=True, timeout=1800)  # fmt: skip
        return float(done.stdout.strip().splitlines()[-1])

    rows = alternate({str(w): functools.partial(run, w) for w in WORKERS}, runs=args.repeats)
    over_zero = {w: ratio(rows[w], rows["0"]) for w in rows}
    write_results("quick_worker_throughput", {"prefix": os.path.basename(args.prefix), "batches": args.batches,
                                              "tokens_per_s": rows, "over_0_workers": over_zero},
                  quick=args.quick)  # fmt: skip
    print("| workers | tokens/s, median (min–max) | ÷ 0 workers, median (min–max) of rounds |\n|---|---|---|")
    for w, r in rows.items():
        q = over_zero[w]
        print(f"| {w} | {r['median'] / 1e6:.1f}M ({r['min'] / 1e6:.1f}–{r['max'] / 1e6:.1f}M) | "
              f"{q['median']:.2f} ({q['min']:.2f}–{q['max']:.2f}) |")  # fmt: skip


if __name__ == "__main__":
    main()
