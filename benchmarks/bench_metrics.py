"""What ``loader.metrics()`` costs: throughput reading it every step against never, and one read alone.

Counting is always on (two clock reads a batch in the trainer, an array add per storage request),
so "off" here is a loop that never reads the metrics, against loops that read ``loader.metrics()``
after every batch (a logger at ``log_interval=1``: the worst case) and after every 10th (torchtitan's
default ``log_freq``). 2 DataLoader workers over a local native-packed corpus with a two-stage
schedule, at micro-batches of 8 x 129 tokens (where a read weighs most) and 8 x 2049 (the size the
other loader benchmarks use):

- separate loops' batches/s, wall clock, alternating the loops (their runs spread by +-10%);
- within one loader (:func:`paired`): blocks of 1,000 batches that read alternate with blocks that do
  not (ABBA), so both sides share the workers, the caches and whatever else the machine does; per
  side the wall time, and the CPU time of the trainer process and of its DataLoader workers
  (nanoseconds from ``/proc``). On this 2-core machine the trainer and its two workers share the
  cores, so the CPU time a batch of all three is what throughput pays; it does not move with the
  scheduling that makes the wall clock spread by +-4% from run to run;
- counting on against off, the same way: the loader as it is against the same loader with
  ``Delivery.__next__`` swapped for one without its two clock reads and two adds;
- one ``metrics()`` call alone (at an unchanged position), and ``metrics(across_ranks=True)`` on one rank.

    python benchmarks/bench_metrics.py [--repeats 5] [--batches 3000] [--seq-lengths 128,2048]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

BATCH, WORKERS = 8, 2
STAGE = 5000  # the second stage's first position (staged_spec)
WARM = STAGE // BATCH + 75  # batches before measuring: workers started, caches warm, past the stage change
SEQ_LENGTHS = (128, 2048)  # micro-batches of 8 x 129 and 8 x 2049 tokens


def staged_spec(folder: str, seq_length: int) -> str:
    import yaml

    from statefulset.tools.demo import demo_spec

    with open(demo_spec(folder, documents=20000, seq_length=seq_length)) as f:
        plain = yaml.safe_load(f)
    blend = plain.pop("data_path")
    prefixes = list(blend) if isinstance(blend, dict) else blend[1::2]
    first = {p: float(i + 1) for i, p in enumerate(prefixes)}
    plain["stages"] = [{"start": 0, "data_path": first}, {"start": STAGE, "data_path": dict(reversed(first.items()))}]
    path = os.path.join(folder, "staged.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(plain, f)
    return path


def warmed(spec: str, every: int) -> tuple[Any, Any]:
    """A loader with 2 workers and its iterator, :data:`WARM` batches in (workers started, caches warm, past
    the stage change: a read that finds a new stage runs in Python, ~0.5 ms once a stage), then 3 reads
    ``every`` batches apart (none for 0): the first reads of a loader make its keys and hand the
    compiled read its state (0.2 ms to tens of ms, once), which a logger pays once, not every block."""
    from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

    wc = WorkerConfig(rank=0, world_size=1, num_workers=WORKERS)
    loader = get_savable_loader(get_train_dataset(spec, batch_size=BATCH, worker_config=wc))
    it = iter(loader)
    for step in range(WARM + 3 * every):
        next(it)
        if every and step >= WARM and (step - WARM) % every == 0:
            loader.metrics()
    return loader, it


def batches_per_second(spec: str, every: int, batches: int) -> float:
    loader, it = warmed(spec, every)
    start = time.perf_counter()
    for step in range(batches):
        next(it)
        if every and step % every == 0:
            loader.metrics()
    return batches / (time.perf_counter() - start)


def uncounted(delivery: Any) -> Any:
    """``Delivery.__next__`` without its counting (two clock reads and two adds a batch): swapped in for
    the blocks of the comparison with a build that does not count (:func:`paired`, ``counting``)."""
    return delivery._next()


def paired(spec: str, batches: int, every: int = 1, counting: bool = False, block: int = 1000) -> dict[str, float]:
    """One loader, blocks of ``block`` batches alternating between an "on" and an "off" side (ABBA: on,
    off, off, on, ...), so both see the same workers, caches and machine load. On reads the metrics
    after every ``every``-th batch (1: each; 10: a logger at ``log_interval`` 10), off never does; with
    ``counting``, on is the loader as it is (never reading) and off the same loader without counting
    (``Delivery.__next__`` swapped for :func:`uncounted`). Per side: wall seconds, this (the trainer)
    process's CPU time (all its threads) and its DataLoader workers' (``/proc/<pid>/task/*/schedstat``,
    nanoseconds). Returns off over on for each (wall: of the sums; CPU: of the median blocks'), the
    throughput ratio on / off when that resource is what bounds it, and the off side's CPU µs a batch."""
    from process_cpu import children, cpu_ns

    from statefulset.loading.delivery import Delivery

    loader, it = warmed(spec, 0 if counting else every)
    workers = children()  # forked DataLoader workers: this process's children (earlier loaders' idle ones too)
    wall = {True: 0.0, False: 0.0}
    cpu: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # a block's (trainer ns, + workers ns)
    counted = Delivery.__next__
    blocks = max(4, batches // block)
    try:
        for b in range(blocks):
            on = b % 4 in (0, 3)  # ABBA: a drift within the run falls on both sides alike
            if counting:
                Delivery.__next__ = counted if on else uncounted
            read = on and not counting
            own, others = cpu_ns(workers)
            start = time.perf_counter()
            for step in range(block):
                next(it)
                if read and step % every == 0:
                    loader.metrics()
            wall[on] += time.perf_counter() - start
            own_end, others_end = cpu_ns(workers)
            cpu[on].append((own_end - own, own_end - own + others_end - others))
    finally:
        Delivery.__next__ = counted
    # CPU: the median block of each side (a block that the machine's other work disturbed, as a
    # context switch that flushed the caches, weighs no more than one that it did not).
    trainer = {on: statistics.median(b[0] for b in blocks) / block / 1e3 for on, blocks in cpu.items()}
    total = {on: statistics.median(b[1] for b in blocks) / block / 1e3 for on, blocks in cpu.items()}
    return {
        "wall": wall[False] / wall[True],
        "trainer_cpu": trainer[False] / trainer[True],
        "total_cpu": total[False] / total[True],
        "off_trainer_cpu_us_per_batch": trainer[False],
        "off_total_cpu_us_per_batch": total[False],
    }


def read_in_loop_us(spec: str, batches: int, every: int = 1, block: int = 1000) -> float:
    """A read's cost inside the loop, after every batch: the trainer thread's CPU time around each read,
    less that around an empty bracket (blocks of ``block`` batches alternating ABBA in one loader, as in
    :func:`paired`). Unlike a read alone, it pays for what a batch between two reads pushed out of the
    caches; it resolves to ~0.1 µs, where the throughput ratios cannot."""
    loader, it = warmed(spec, every)
    clock, metrics = time.thread_time_ns, loader.metrics
    inside = {True: 0, False: 0}
    blocks = max(4, batches // block)
    for b in range(blocks):
        read, spent = b % 4 in (0, 3), 0
        for step in range(block):
            next(it)
            if step % every:
                continue
            if read:
                start = clock()
                metrics()
                spent += clock() - start
            else:
                start = clock()
                spent += clock() - start
        inside[read] += spent
    return (inside[True] - inside[False]) / (len(range(0, block, every)) * (blocks // 2)) / 1e3


def counting_ns(calls: int = 200_000) -> float:
    """What counting adds to a batch alone: ``Delivery.__next__``'s two clock reads and two adds (on a
    :class:`~statefulset.loading.metrics.Meter`, around a call as the batch's is) against the call alone."""
    from time import perf_counter

    from statefulset.loading.metrics import Meter

    meter = Meter()

    def batch() -> None:
        return None

    def counted() -> None:
        start = perf_counter()
        try:
            batch()
        finally:
            meter.wait += perf_counter() - start
        meter.batches += 1

    took = {}
    for fn in (counted, batch, counted, batch):
        start = time.thread_time_ns()
        for _ in range(calls):
            fn()
        took[fn] = min(took.get(fn, float("inf")), (time.thread_time_ns() - start) / calls)
    return took[counted] - took[batch]


def call_us(spec: str, across: bool, calls: int) -> float:
    from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    loader = get_savable_loader(get_train_dataset(spec, batch_size=BATCH, worker_config=wc))
    next(iter(loader))
    loader.metrics(), loader.metrics()  # the first reads make the keys and hand the compiled read its state
    start = time.perf_counter()
    for _ in range(calls):  # at an unchanged position: what every read does but the per-source rows
        loader.metrics(across)
    return (time.perf_counter() - start) / calls * 1e6


COMPARISONS = (("read_every_step", 1, False), ("read_every_10_steps", 10, False), ("counting", 0, True))
CADENCES = (1, 10, 100)  # a read in the loop every n batches (read_in_loop_us)
FIGURES = ("wall", "trainer_cpu", "total_cpu", "off_trainer_cpu_us_per_batch", "off_total_cpu_us_per_batch")


def measure(specs: dict[int, str], repeats: int, batches: int) -> tuple[dict, dict, dict]:
    """Every loop, comparison and call, ``repeats`` times, the loops' order alternating run by run."""
    modes = [("never_read", 0), ("read_every_step", 1), ("read_every_10_steps", 10)]
    runs = {seq: {label: [] for label, _ in modes} for seq in specs}
    pairs = {seq: {label: [] for label in [*(c[0] for c in COMPARISONS), *CADENCES]} for seq in specs}
    calls: dict[str, list[float]] = {"metrics_us": [], "metrics_across_ranks_us": [], "counting_ns": []}
    for r in range(repeats):
        for seq, spec in specs.items():
            for label, every in modes if r % 2 == 0 else modes[::-1]:
                runs[seq][label].append(batches_per_second(spec, every, batches))
            for label, every, counting in COMPARISONS:
                pairs[seq][label].append(paired(spec, batches, every=every, counting=counting))
            for n in CADENCES:
                pairs[seq][n].append(read_in_loop_us(spec, batches, every=n))
        first = next(iter(specs.values()))
        calls["metrics_us"].append(call_us(first, False, 2000))
        calls["metrics_across_ranks_us"].append(call_us(first, True, 2000))
        calls["counting_ns"].append(counting_ns())
    return runs, pairs, calls


def summarised(runs: dict, pairs: dict) -> dict[str, dict]:
    """By micro-batch ("8 x 129", "8 x 2049"): runs, medians, on / off ratios."""
    from benchenv import spread

    sizes = {}
    for seq, found in runs.items():
        summary = {label: spread(values) for label, values in found.items()}
        never = summary["never_read"]["median"]
        sizes[f"{BATCH} x {seq + 1}"] = {
            "batches_per_second_runs": found,
            "batches_per_second": summary,
            "throughput_ratio": {label: summary[label]["median"] / never for label in summary if label != "never_read"},
            # Read every step over never, within one loader (alternating blocks, ABBA), wall clock: one ratio a run.
            "paired_ratio_runs": [p["wall"] for p in pairs[seq]["read_every_step"]],
            "paired_ratio": spread([p["wall"] for p in pairs[seq]["read_every_step"]]),
            # Read every 10th step over never, the same way (a logger at log_interval 10).
            "paired_ratio_every_10_runs": [p["wall"] for p in pairs[seq]["read_every_10_steps"]],
            "paired_ratio_every_10": spread([p["wall"] for p in pairs[seq]["read_every_10_steps"]]),
            # The same blocks' CPU time (trainer; trainer + workers), and counting on against a loop without
            # it: off / on for each figure (paired), and the off side's CPU µs a batch.
            "paired": {
                label: {"runs": pairs[seq][label], **{f: spread([p[f] for p in pairs[seq][label]]) for f in FIGURES}}
                for label, _, _ in COMPARISONS
            },
            # A read's trainer CPU inside the loop, read every n batches (read_in_loop_us): one figure a run.
            "read_in_loop_us_runs": {f"every_{n}_steps": pairs[seq][n] for n in CADENCES},
            "read_in_loop_us": {f"every_{n}_steps": spread(pairs[seq][n]) for n in CADENCES},
        }
    return sizes


def accounted(sizes: dict[str, dict], counting: float) -> None:
    """Into each size: on / off throughput from the medians of what a read (in the loop, at its cadence:
    a read 10 batches after the last costs more than one right after it) and counting (``counting`` ns
    a batch, alone) add to the CPU time of a batch never reading, the trainer's and the trainer's and
    workers' together (the paired blocks' off side), for a read every 1, 10 and 100 steps."""
    for r in sizes.values():
        p = r["paired"]["read_every_step"]
        cpu = {k: p[f"off_{k}_cpu_us_per_batch"]["median"] for k in ("trainer", "total")}
        found: dict[str, dict[str, float]] = {}
        for n in CADENCES:
            read = r["read_in_loop_us"][f"every_{n}_steps"]["median"]
            found[f"read_every_{n}_steps"] = {k: c / (c + read / n) for k, c in cpu.items()}
        found["counting"] = {k: (c - counting / 1e3) / c for k, c in cpu.items()}
        r["accounted"] = found


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
    specs = {int(x): staged_spec(os.path.join(folder, x), int(x)) for x in args.seq_lengths.split(",")}
    runs, pairs, calls = measure(specs, args.repeats, args.batches)
    sizes = summarised(runs, pairs)
    call_summary = {label: spread(values) for label, values in calls.items()}
    accounted(sizes, call_summary["counting_ns"]["median"])
    result = {
        "environment": environment(),
        "git": git_state(),
        "load": load_average(),
        "batch_size": BATCH,
        "workers": WORKERS,
        "batches_per_run": args.batches,
        "sizes": sizes,
        "call_us_runs": calls,
        "call_us": call_summary,
    }
    from provenance import write_results

    write_results("bench_metrics", result, path=args.out, quick=args.quick)
    printed(result)


def printed(result: dict) -> None:
    print(f"{WORKERS} workers, {result['batches_per_run']} batches a run")
    for size, found in result["sizes"].items():
        print(f"  micro-batch {size}:")
        for label, sp in found["batches_per_second"].items():
            print(f"    {label}: median {sp['median']:.1f} batches/s (min {sp['min']:.1f}, max {sp['max']:.1f})")
        print(f"    throughput against never reading the metrics: {found['throughput_ratio']}")
        for label, p in found["paired"].items():
            cells = ", ".join(f"{f} {p[f]['median']:.4g} ({p[f]['min']:.4g}..{p[f]['max']:.4g})" for f in FIGURES)
            print(f"    paired {label}: {cells}")
        for label, sp in found["read_in_loop_us"].items():
            print(f"    a read in the loop, {label}: {sp['median']:.2f} µs ({sp['min']:.2f}..{sp['max']:.2f})")
        print(f"    accounted on / off: {found['accounted']}")
    for label, sp in result["call_us"].items():
        print(f"  {label}: median {sp['median']:.1f} (min {sp['min']:.1f}, max {sp['max']:.1f})")


if __name__ == "__main__":
    main()
