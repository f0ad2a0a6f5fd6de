"""Six processes opening one unprepared 100B-token native spec at once: total CPU against one process.

CONTRACT §9: processes that open the same unprepared spec at the same time share the work that
grows with the corpus (one does it, the others wait for its result). This measures what is left:
the total CPU (user + system, whole processes: interpreter start, imports, the open and one
sample read, as ``getrusage(RUSAGE_CHILDREN)`` counts them) of six processes started together,
each with a fresh home (``XDG_CACHE_HOME``) and all sharing a fresh ``path_to_cache``, divided by
the total CPU of one such process alone. Target: < 2.5x. The CPU of the open alone
(``time.process_time`` around ``open_stream`` and the read) is reported beside it.

The corpus is bench_scale.py's: a real ``.idx`` for 50,000,000 documents (100.0B uint16 tokens,
~1 GB of index) and a sparse ``.bin`` of the matching size.

Run: ``python benchmarks/bench_concurrent_open.py [--docs 50000000] [--runs 3] [--out DIR]``;
``--profile DIR`` writes a cProfile of every process of the last run (what each does alone).
Results: ``benchmarks/results/bench_concurrent_open.json`` (median and spread over the runs).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_scale import write_corpus  # noqa: E402
from benchenv import environment, git_state  # noqa: E402

SEQ = 2048
TOGETHER_S = 3.0  # processes are started this long before the common start time, to import first


def child(spec: str, start: float, profile: str | None) -> dict:
    import numpy

    from statefulset.streams.opening import open_stream

    while time.time() < start:  # start the opens together, imports done
        time.sleep(0.001)
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    cpu0, t0 = time.process_time(), time.perf_counter()
    stream = open_stream(spec)
    stream.gather(numpy.array([12345]))
    cpu, seconds = time.process_time() - cpu0, time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(os.path.join(profile, f"open-{os.getpid()}.prof"))
    return {"open_cpu_s": cpu, "open_seconds": seconds}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _opens(spec: str, out: str, count: int, run: int, profile: str | None) -> dict:
    """``count`` fresh processes opening ``spec`` together; their total CPU and what the opens took."""
    start = time.time() + TOGETHER_S
    before = _children_cpu()
    procs = []
    for i in range(count):
        home = os.path.join(out, "homes", f"{run}-{count}-{i}-{time.monotonic_ns()}")
        argv = [sys.executable, __file__, "--child", spec, "--start", str(start)]
        procs.append(
            subprocess.Popen(
                argv + (["--profile", profile] if profile else []),
                env={**os.environ, "XDG_CACHE_HOME": home},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"an open failed:\n{stderr[-3000:]}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return {
        "total_cpu_s": _children_cpu() - before,
        "open_cpu_s": sum(r["open_cpu_s"] for r in results),
        "open_seconds_max": max(r["open_seconds"] for r in results),
    }


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=50_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--procs", type=int, default=6)
    parser.add_argument("--out", default=os.path.join(HERE, "out", "scale"))
    parser.add_argument("--profile", help="write a cProfile of every open of the last run into this folder")
    parser.add_argument("--results", default=os.path.join(HERE, "results", "bench_concurrent_open.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.start, args.profile)))
        return
    prefix = os.path.join(args.out, "corpus", "c")
    tokens = write_corpus(prefix, args.docs)
    print(f"corpus: {args.docs:,} documents, {tokens:,} tokens, .idx {os.path.getsize(prefix + '.idx'):,} B")
    cache = os.path.join(args.out, "cache-concurrent")
    spec = os.path.join(args.out, "concurrent.yaml")
    with open(spec, "w") as f:
        json.dump({"data_path": prefix, "seq_length": SEQ, "split": "100,0,0", "packing": "native",
                   "path_to_cache": cache}, f)  # fmt: skip
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    rows: dict[str, list] = {"one": [], "many": []}
    for run in range(args.runs):
        for key, count in (("one", 1), ("many", args.procs)):
            shutil.rmtree(cache, ignore_errors=True)
            shutil.rmtree(os.path.join(args.out, "homes"), ignore_errors=True)
            profile = args.profile if args.profile and run == args.runs - 1 else None
            rows[key].append(_opens(spec, args.out, count, run, profile))
        one, many = rows["one"][-1], rows["many"][-1]
        print(
            f"run {run}: one {one['total_cpu_s']:.2f} s CPU (open {one['open_cpu_s']:.2f} s), "
            f"{args.procs} at once {many['total_cpu_s']:.2f} s (opens {many['open_cpu_s']:.2f} s): "
            f"{many['total_cpu_s'] / one['total_cpu_s']:.2f}x"
        )
    ratios = [m["total_cpu_s"] / o["total_cpu_s"] for o, m in zip(rows["one"], rows["many"], strict=True)]
    open_ratios = [m["open_cpu_s"] / o["open_cpu_s"] for o, m in zip(rows["one"], rows["many"], strict=True)]
    report = {
        "benchmark": "bench_concurrent_open",
        "environment": environment(),
        "git": git_state(),
        "docs": args.docs,
        "tokens": tokens,
        "procs": args.procs,
        "runs": args.runs,
        "one_total_cpu_s": _spread([r["total_cpu_s"] for r in rows["one"]]),
        "many_total_cpu_s": _spread([r["total_cpu_s"] for r in rows["many"]]),
        "one_open_cpu_s": _spread([r["open_cpu_s"] for r in rows["one"]]),
        "many_open_cpu_s": _spread([r["open_cpu_s"] for r in rows["many"]]),
        "ratio_total_cpu": _spread(ratios),
        "ratio_open_cpu": _spread(open_ratios),
        "raw": rows,
    }
    from provenance import write_results

    write_results("bench_concurrent_open", report, path=args.results)
    r = report["ratio_total_cpu"]
    print(f"{args.procs} at once / one, total CPU: {r['median']:.2f}x (min {r['min']:.2f}, max {r['max']:.2f})")
    print(f"written to {args.results}")


if __name__ == "__main__":
    main()
