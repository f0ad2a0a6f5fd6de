"""Opening a data schedule of 10 stages x 50 sources and reading at a late position: time and memory.

Each row runs in a fresh process (imports done before timing; the shards' facts already cached,
as on any node after ``statefulset prepare``): open the spec's train stream, then gather one batch
of 8 at position P. The claim (issue 15): time and memory are O(stages x sources), not O(P).

The anchor: megatron-core changes a mixture by building a new ``BlendedDataset`` index, whose size
is the number of samples it covers, so reaching position P costs a build of P entries
(``helpers_cpp.build_blending_indices`` with 50 weights, timed for P = 10^6 and 10^7 in the same
run). megatron-core caches that build on disk, so only the first run of a mixture pays it; the
load of the cached index (memory-mapped ``.npy``) is timed too. Every row: median and spread of
``--runs`` fresh processes after one warm-up. Nanotron's data stages and Energon restart their
datasets per stage instead.

    python benchmarks/bench_schedules.py            # full size
    python benchmarks/bench_schedules.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

STAGES, SOURCES = 10, 50


def make(folder: str) -> str:
    from statefulset import IndexedDatasetWriter

    rng = numpy.random.default_rng(0)
    prefixes = []
    for s in range(SOURCES):
        prefix = os.path.join(folder, f"source_{s:02d}")
        with IndexedDatasetWriter(prefix, numpy.uint16) as w:
            lengths = rng.geometric(1 / 300, 2000)
            w.add_documents(rng.integers(0, 60000, int(lengths.sum())).astype(numpy.uint16), lengths.tolist())
        for ext in (".bin", ".idx"):  # as a corpus written an hour ago: settled, so its facts are remembered
            past = time.time() - 3600
            os.utime(prefix + ext, (past, past))
        prefixes.append(prefix)
    stages = []
    for k in range(STAGES):
        weights = rng.random(SOURCES) * (rng.random(SOURCES) < 0.7)
        weights[k % SOURCES] += 0.1  # never all zero
        stages.append(
            {"start": k * 10**11, "data_path": {p: round(float(w), 4) for p, w in zip(prefixes, weights, strict=True)}}
        )
    spec = {"seq_length": 2048, "split": "1", "packing": "native", "stages": stages,
            "path_to_cache": os.path.join(folder, "cache")}  # fmt: skip
    path = os.path.join(folder, "schedule.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    # The same 50 sources without stages (the last stage's mixture): what opening the shards costs.
    flat = {**spec, "data_path": stages[-1]["data_path"]}
    del flat["stages"]
    with open(os.path.join(folder, "flat.json"), "w") as f:
        json.dump(flat, f)
    return path


def child(path: str, position: int, trace: bool) -> None:
    """One open and read; with ``trace``, Python's allocations instead of times (tracemalloc slows Python 2-5x)."""
    import tracemalloc

    from statefulset.streams.opening import open_stream

    with open(path) as f:
        spec = json.load(f)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if trace:
        tracemalloc.start()
    began = time.perf_counter()
    stream = open_stream(spec)
    opened = time.perf_counter() - began
    began = time.perf_counter()
    stream.gather(numpy.arange(position, position + 8))
    read = time.perf_counter() - began
    began = time.perf_counter()
    counts = stream.source_positions(position)
    standing = time.perf_counter() - began
    peak = tracemalloc.get_traced_memory()[1] if trace else 0
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    print(
        json.dumps(
            {
                "position": position,
                "open_s": opened,
                "read_s": read,
                "source_positions_s": standing,
                "python_peak_mb": peak / 2**20,
                "rss_growth_mb": grown / 1024,
                "drawn": sum(counts.values()),
            }
        )
    )


def megatron_blend(size: int, folder: str) -> dict | None:
    """megatron-core's build of a blend index over ``size`` samples, and its load once cached.

    megatron-core builds the index the first time a mixture is used and saves it under its cache
    path; later runs (and every rank but the builder) load the saved arrays memory-mapped. Both are
    timed, median of three.
    """
    try:
        from megatron.core.datasets import helpers_cpp
    except ImportError:
        return None
    from provenance import summary

    weights = numpy.random.default_rng(0).random(SOURCES)
    weights /= weights.sum()
    builds, loads = [], []
    for _ in range(3):
        index = numpy.zeros(size, dtype=numpy.int16)
        sample = numpy.zeros(size, dtype=numpy.int64)
        began = time.perf_counter()
        helpers_cpp.build_blending_indices(index, sample, weights, SOURCES, size, False)
        builds.append(time.perf_counter() - began)
        numpy.save(os.path.join(folder, "index.npy"), index)
        numpy.save(os.path.join(folder, "sample.npy"), sample)
        began = time.perf_counter()
        loaded = [numpy.load(os.path.join(folder, f"{n}.npy"), mmap_mode="r") for n in ("index", "sample")]
        int(loaded[0][size // 2]) + int(loaded[1][size // 2])
        loads.append(time.perf_counter() - began)
    return {"build_s": summary(builds), "cached_load_s": summary(loads)}


def _rows(path: str, position: int | str, runs: int) -> list[dict]:
    """One warm-up run (dropped), ``runs`` timed runs and one traced run, each a fresh process."""
    rows = []
    for mode in ("warm-up", *["time"] * runs, "trace"):
        at = str(position if position != "no stages" else 0)
        run = subprocess.run([sys.executable, __file__, "--child", path, at, "trace" if mode == "trace" else "time"],
                             check=True, capture_output=True, text=True, timeout=600)  # fmt: skip
        rows.append({**json.loads(run.stdout.strip().splitlines()[-1]), "mode": mode, "position": position})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=3, metavar=("SPEC", "POSITION", "TRACE"))
    parser.add_argument("--runs", type=int, default=3, help="timed fresh processes per row, after one warm-up")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 positions, 1 timed run")
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2] == "trace")
        return
    from provenance import summary, write_results

    if args.quick:
        args.runs = 1  # a smoke run: not a figure
    positions = (0, 10**12 - 5) if args.quick else (0, 10**6, 10**9, 10**12 - 5)
    sizes = (10**5, 10**6) if args.quick else (10**6, 10**7)
    with tempfile.TemporaryDirectory() as folder:
        path = make(folder)
        rows = [r for position in positions for r in _rows(path, position, args.runs)]
        rows += _rows(os.path.join(folder, "flat.json"), "no stages", args.runs)
        anchor = {str(size): megatron_blend(size, folder) for size in sizes}
    table = {}
    for position in dict.fromkeys(r["position"] for r in rows):
        timed = [r for r in rows if r["position"] == position and r["mode"] == "time"]
        traced = [r for r in rows if r["position"] == position and r["mode"] == "trace"]
        table[str(position)] = {k: summary([r[k] for r in timed]) for k in ("open_s", "read_s", "source_positions_s")}
        table[str(position)]["python_peak_mb"] = traced[0]["python_peak_mb"]
        table[str(position)]["rss_growth_mb"] = max(r["rss_growth_mb"] for r in timed)
    result = {"stages": STAGES, "sources": SOURCES, "timed_runs": args.runs, "warm_up_runs_dropped": 1,
              "quick": args.quick, "ours": table, "megatron_core_blend": anchor}  # fmt: skip
    print(json.dumps(result, indent=1))
    write_results("bench_schedules", result, extra=("megatron-core",), quick=args.quick)


if __name__ == "__main__":
    main()
