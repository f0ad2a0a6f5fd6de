"""What ``loader.metrics()`` costs: throughput reading it every step against never, and one read alone.

Counting is always on (two clock reads a batch in the trainer, an array add per storage request),
so "off" here is a loop that never reads the metrics, against loops that read ``loader.metrics()``
after every batch (a logger at ``log_interval=1``: the worst case) and after every 10th. 2 DataLoader
workers over a local native-packed corpus with a two-stage schedule (the per-source values walk
the blend tree whenever the position moved), alternating the loops; at micro-batches of 8 x 129
tokens (where a read weighs most) and 8 x 2049 (the size the other loader benchmarks use). Also
the time of one ``metrics()`` call at a position that moved, and of ``metrics(across_ranks=True)``
on one rank. And the same ratio within one loader (``paired_ratio``): blocks of 1,000 batches that read
after every batch alternate with blocks that never read (ABBA), so both sides share the workers,
the caches and whatever else the machine does; the runs' spread of that ratio is much narrower.
The same paired ratio for reading after every 10th batch (a logger at ``log_interval`` 10).

    python benchmarks/bench_metrics.py [--repeats 5] [--batches 3000] [--seq-lengths 128,2048]
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

BATCH, WORKERS = 8, 2
SEQ_LENGTHS = (128, 2048)  # micro-batches of 8 x 129 and 8 x 2049 tokens


def staged_spec(folder: str, seq_length: int) -> str:
    import yaml

    from statefulset.tools.demo import demo_spec

    with open(demo_spec(folder, documents=20000, seq_length=seq_length)) as f:
        plain = yaml.safe_load(f)
    blend = plain.pop("data_path")
    prefixes = list(blend) if isinstance(blend, dict) else blend[1::2]
    first = {p: float(i + 1) for i, p in enumerate(prefixes)}
    plain["stages"] = [{"start": 0, "data_path": first}, {"start": 5000, "data_path": dict(reversed(first.items()))}]
    path = os.path.join(folder, "staged.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(plain, f)
    return path


def batches_per_second(spec: str, every: int, batches: int) -> float:
    from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

    wc = WorkerConfig(rank=0, world_size=1, num_workers=WORKERS)
    loader = get_savable_loader(get_train_dataset(spec, batch_size=BATCH, worker_config=wc))
    it = iter(loader)
    for _ in range(50):  # warm: workers started, caches
        next(it)
    start = time.perf_counter()
    for step in range(batches):
        next(it)
        if every and step % every == 0:
            loader.metrics()
    return batches / (time.perf_counter() - start)


def paired_ratio(spec: str, batches: int, every: int = 1, block: int = 1000) -> float:
    """Throughput reading the metrics after every ``every``-th batch (1: each; 10: a logger at
    ``log_interval`` 10) over never reading them, in one loader: blocks of ``block`` batches alternate
    (read, not, not, read, ...), so both see the same workers, caches and machine load; the ratio of
    the two sums of block times."""
    from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

    wc = WorkerConfig(rank=0, world_size=1, num_workers=WORKERS)
    loader = get_savable_loader(get_train_dataset(spec, batch_size=BATCH, worker_config=wc))
    it = iter(loader)
    for _ in range(50):
        next(it)
    seconds = {True: 0.0, False: 0.0}
    for b in range(max(2, batches // block)):
        read = b % 4 in (0, 3)  # ABBA: a drift within the run falls on both sides alike
        start = time.perf_counter()
        for step in range(block):
            next(it)
            if read and step % every == 0:
                loader.metrics()
        seconds[read] += time.perf_counter() - start
    return seconds[False] / seconds[True]


def call_us(spec: str, across: bool, calls: int) -> float:
    from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    loader = get_savable_loader(get_train_dataset(spec, batch_size=BATCH, worker_config=wc))
    next(iter(loader))
    meter = loader._options["meter"]
    start = time.perf_counter()
    for _ in range(calls):
        meter._place = None  # as if the position moved: the blend tree is walked each time
        loader.metrics(across)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--seq-lengths", default=",".join(map(str, SEQ_LENGTHS)), help="comma-separated")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "bench_metrics.json"))
    parser.add_argument("--quick", action="store_true", help="smoke run (3 runs of 200 batches)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.batches = 3, 200
        args.out = os.path.join(HERE, "out", "quick", "bench_metrics.json")

    import torch
    from benchenv import environment, git_state, load_average, spread

    torch.set_num_threads(1)
    folder = tempfile.mkdtemp(prefix="bench-metrics-")
    lengths = [int(x) for x in args.seq_lengths.split(",")]
    specs = {seq: staged_spec(os.path.join(folder, str(seq)), seq) for seq in lengths}
    modes = [("never_read", 0), ("read_every_step", 1), ("read_every_10_steps", 10)]
    runs = {seq: {label: [] for label, _ in modes} for seq in lengths}
    calls: dict[str, list[float]] = {"metrics_us": [], "metrics_across_ranks_us": []}
    paired: dict[int, list[float]] = {seq: [] for seq in lengths}
    paired_10: dict[int, list[float]] = {seq: [] for seq in lengths}
    for r in range(args.repeats):
        for seq in lengths:
            for label, every in modes if r % 2 == 0 else modes[::-1]:
                runs[seq][label].append(batches_per_second(specs[seq], every, args.batches))
            paired[seq].append(paired_ratio(specs[seq], args.batches))
            paired_10[seq].append(paired_ratio(specs[seq], args.batches, every=10))
        calls["metrics_us"].append(call_us(specs[lengths[0]], False, 2000))
        calls["metrics_across_ranks_us"].append(call_us(specs[lengths[0]], True, 2000))
    sizes = {}
    for seq in lengths:
        summary = {label: spread(values) for label, values in runs[seq].items()}
        sizes[f"{BATCH} x {seq + 1}"] = {
            "batches_per_second_runs": runs[seq],
            "batches_per_second": summary,
            "throughput_ratio": {
                label: summary[label]["median"] / summary["never_read"]["median"] for label, every in modes if every
            },
            # Read every step over never, within one loader (alternating blocks, ABBA): one ratio a run.
            "paired_ratio_runs": paired[seq],
            "paired_ratio": spread(paired[seq]),
            # Read every 10th step over never, the same way (a logger at log_interval 10).
            "paired_ratio_every_10_runs": paired_10[seq],
            "paired_ratio_every_10": spread(paired_10[seq]),
        }
    call_summary = {label: spread(values) for label, values in calls.items()}
    result = {
        "environment": environment(),
        "git": git_state(),
        "load": load_average(),
        "batch_size": BATCH,
        "workers": WORKERS,
        "batches_per_run": args.batches,
        "sizes": sizes,  # by micro-batch ("8 x 129", "8 x 2049"): runs, medians, on / off ratios
        "call_us_runs": calls,
        "call_us": call_summary,
    }
    from provenance import write_results

    write_results("bench_metrics", result, path=args.out, quick=args.quick)
    print(f"{WORKERS} workers, {args.batches} batches, {args.repeats} runs each")
    for size, found in sizes.items():
        print(f"  micro-batch {size}:")
        for label, sp in found["batches_per_second"].items():
            print(f"    {label}: median {sp['median']:.1f} batches/s (min {sp['min']:.1f}, max {sp['max']:.1f})")
        print(f"    throughput against never reading the metrics: {found['throughput_ratio']}")
        pr = found["paired_ratio"]
        print(f"    read every step / never, same loader: median {pr['median']:.3f} ({pr['min']:.3f}..{pr['max']:.3f})")
        pr = found["paired_ratio_every_10"]
        print(f"    read every 10th / never, same loader: median {pr['median']:.3f} ({pr['min']:.3f}..{pr['max']:.3f})")
    for label, sp in call_summary.items():
        print(f"  {label}: median {sp['median']:.1f} (min {sp['min']:.1f}, max {sp['max']:.1f})")


if __name__ == "__main__":
    main()
