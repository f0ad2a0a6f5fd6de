"""Run every benchmark: ``--quick`` at a small size (a smoke run, so none rots), or at full size.

    python benchmarks/run_all.py --quick            # every script, small sizes, results to benchmarks/out/quick/
    python benchmarks/run_all.py                    # full sizes (hours; writes benchmarks/results/)
    python benchmarks/run_all.py --quick --only bench_packing bench_schedules

Each script runs as a child process with a bound (``--timeout``, per script). A script whose
outside requirement is missing (s3rver, loky) is skipped and named; any other failure makes the
run fail. A summary (script, status, seconds) goes to ``benchmarks/out/quick/run_all.json`` (or
``benchmarks/out/run_all.json``). Quick runs never replace a committed result, and their timings
are not figures: too small, one run each.

Every ``bench_*.py`` and ``quick_*.py`` script in ``benchmarks/`` must be listed in ``SCRIPTS``
(``tests/test_benchmarks_report.py`` checks it), with the arguments of its quick run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

# script -> arguments of its quick run (its full run takes none: the defaults are the full size).
SCRIPTS: dict[str, list[str]] = {
    "bench_write.py": ["--quick"],
    "bench_read.py": ["--quick"],
    "bench_preprocess.py": ["--quick"],
    "bench_preprocess_ray.py": ["--quick"],
    "bench_loader.py": ["--quick"],
    "bench_stream.py": ["--quick"],
    "bench_packing.py": ["--quick"],
    "bench_schedules.py": ["--quick"],
    "bench_scale.py": ["--quick"],
    "bench_collectives.py": ["--quick"],
    "bench_worker_start.py": ["--quick"],
    "bench_long_lines.py": ["--quick"],
    "bench_object_assembly.py": ["--quick"],
    "bench_object_storage.py": ["--quick"],
    "bench_request_cpu.py": ["--quick"],
    "bench_worker_pool.py": ["--quick"],
    "bench_watchdog_thread.py": ["--quick"],
    "bench_task_encoder.py": ["--quick"],
    "bench_fim.py": ["--quick"],
    "bench_metrics.py": ["--quick"],
    "bench_loss_masks.py": ["--quick"],
    "bench_torchtitan.py": ["--quick"],
    "bench_torchft.py": ["--quick"],
    "bench_torchft_sampler.py": ["--quick"],
    "bench_concurrent_open.py": [
        "--docs",
        "200000",
        "--runs",
        "1",
        "--out",
        "benchmarks/out/quick/concurrent",
        "--results",
        "benchmarks/out/quick/bench_concurrent_open.json",
    ],
    "bench_throttled_store.py": [
        "--tokens",
        "500000",
        "--workers",
        "0",
        "2",
        "--steps",
        "5",
        "--runs",
        "1",
        "--out",
        "benchmarks/out/quick/throttled_store.json",
    ],
    "quick_worker_throughput.py": ["--quick"],
}
# Modules that are not benchmarks: helpers, anchors run by a benchmark in another environment.
NOT_SCRIPTS = {
    "anchor_datatrove_tokenize.py", "anchor_olmo_packing.py", "benchenv.py", "corpus.py", "jsonl_corpus.py",
    "plots.py", "provenance.py", "report.py", "report_tables.py", "run_all.py", "campaign.py",
    "store_capacity.py", "process_cpu.py", "object_storage_table.py", "preprocess_ray_tables.py",
}  # fmt: skip


def missing_requirement(script: str) -> str | None:
    """Why ``script`` cannot run here (an outside program or package it needs), or None."""
    if script == "bench_object_storage.py":
        from s3_servers import s3rver_command

        if s3rver_command() is None:
            return "s3rver is not installed (npm install s3rver; S3RVER_BIN=...)"
    if script == "bench_worker_pool.py" and importlib.util.find_spec("loky") is None:
        return "loky is not installed (pip install --target /tmp/lokylib loky; PYTHONPATH=...)"
    return None


def listed() -> list[str]:
    """Every benchmark script in benchmarks/ (what SCRIPTS must cover)."""
    return sorted(name for name in os.listdir(HERE) if name.endswith(".py") and name.startswith(("bench_", "quick_")))


def run(script: str, quick: bool, timeout: float) -> dict:
    why = missing_requirement(script)
    if why:
        print(f"{script}: SKIPPED: {why}", flush=True)
        return {"script": script, "status": "skipped", "why": why}
    command = [sys.executable, os.path.join(HERE, script), *(SCRIPTS[script] if quick else [])]
    began = time.perf_counter()
    print(f"{script}: {' '.join(command[1:])}", flush=True)
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"script": script, "status": "timed out", "seconds": timeout, "why": f"no exit within {timeout:g} s"}
    seconds = time.perf_counter() - began
    status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
    print(f"{script}: {status} in {seconds:.1f} s", flush=True)
    row = {"script": script, "status": status, "seconds": round(seconds, 1)}
    if done.returncode != 0:
        row["stderr_tail"] = done.stderr[-3000:]
        print(row["stderr_tail"], file=sys.stderr)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run); without it, full sizes")
    parser.add_argument("--only", nargs="+", metavar="SCRIPT", help="run only these (name with or without .py)")
    parser.add_argument("--timeout", type=float, default=0, help="seconds per script (default 600 quick, 4 h full)")
    args = parser.parse_args()
    unlisted = sorted(set(listed()) - set(SCRIPTS))
    if unlisted:
        sys.exit(f"benchmarks/run_all.py: not in SCRIPTS (add each with its quick arguments): {', '.join(unlisted)}")
    names = [n if n.endswith(".py") else f"{n}.py" for n in args.only] if args.only else list(SCRIPTS)
    unknown = sorted(set(names) - set(SCRIPTS))
    if unknown:
        parser.error(f"unknown script(s) {', '.join(unknown)}; choose from {', '.join(SCRIPTS)}")
    timeout = args.timeout or (600 if args.quick else 4 * 3600)
    began = time.perf_counter()
    rows = [run(name, args.quick, timeout) for name in names]
    total = time.perf_counter() - began
    out = os.path.join(HERE, "out", "quick" if args.quick else "", "run_all.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"quick": args.quick, "seconds": round(total, 1), "rows": rows}, f, indent=1)
    failed = [r["script"] for r in rows if r["status"] not in ("ok", "skipped")]
    skipped = [r["script"] for r in rows if r["status"] == "skipped"]
    print(f"\n{len(rows)} scripts in {total:.0f} s; failed: {', '.join(failed) or 'none'}; "
          f"skipped: {', '.join(skipped) or 'none'}")  # fmt: skip
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
