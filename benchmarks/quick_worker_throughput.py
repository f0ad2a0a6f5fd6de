"""Quick check of loader throughput with N workers: ``python benchmarks/quick_worker_throughput.py 2``.

Not the full benchmark (that is bench_loader.py): one process, 600 batches of 8 x 2049 tokens,
native packing over the first shard found under benchmarks/out/ (bench_loader.py writes one).
"""

from __future__ import annotations

import glob
import sys
import time

from statefulset import WorkerConfig, get_savable_loader, get_train_dataset


def main(workers: int, batches: int = 600) -> None:
    shards = sorted(glob.glob("benchmarks/out/**/*.idx", recursive=True))
    if not shards:
        sys.exit("no shard under benchmarks/out/: run benchmarks/bench_loader.py first")
    spec = {"data_path": shards[0][: -len(".idx")], "seq_length": 2048, "split": "100,0,0", "packing": "native"}
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    loader = iter(get_savable_loader(get_train_dataset(spec, batch_size=8, worker_config=wc)))
    next(loader)  # workers started and warm
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    seconds = time.perf_counter() - start
    print(f"workers={workers} {batches * 8 * 2048 / seconds / 1e6:.1f}M tok/s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
