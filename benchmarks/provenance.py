"""Where a benchmark figure comes from: every script in ``benchmarks/`` writes its results through here.

A results file holds one run. ``write_results`` stamps it with ``provenance()``: the commit and
whether the tree was dirty, the date, the machine (CPU model, cores, memory, kernel) and the
package versions. Scripts with several sections stamp each one with ``stamp(section)`` as it
finishes, so a section measured at another moment says so. ``alternate`` runs the variants of a
comparison in turn (A B A B ...) at least three times and ``summary`` gives median and spread;
a ratio is the median of the per-round ratios, with its own spread.

``docs/benchmarks.md`` is generated from these files by ``benchmarks/report.py``, which reads the
machine line back with ``machine_line``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Callable
from importlib import metadata
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
QUICK = os.path.join(HERE, "out", "quick")  # git-ignored: smoke runs never replace a committed result
MIN_RUNS = 3
PACKAGES = ("numpy", "torch", "statefulset", "megatron-core", "torchdata", "tokenizers")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return float("nan")


def version(dist: str) -> str | None:
    """The installed version of ``dist``, or None when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_gib": memory_gib(), "kernel": platform.release()}


def versions(extra: tuple[str, ...] = ()) -> dict[str, str]:
    """Python and the packages of ``PACKAGES`` + ``extra`` (anchors included) that are installed."""
    found = {"python": platform.python_version()}
    for dist in (*PACKAGES, *extra):
        v = version(dist)
        if v is not None:
            found[dist] = v
    return found


OUTPUTS = ("benchmarks/results/", "benchmarks/out/", "docs/")


def git() -> dict[str, Any]:
    """HEAD and whether the tree differs from it (``dirty_files``: the changed paths, at most 20)."""

    def run(*args: str) -> str:
        try:
            done = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=False, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.rstrip()  # not strip(): a porcelain line starts with a space

    changed = [line[3:] for line in run("status", "--porcelain", "--untracked-files=no").splitlines()]
    # Outputs of earlier runs (results files, generated docs and charts) are not code the run measured.
    code = [path for path in changed if not path.startswith(OUTPUTS)]
    return {"commit": run("rev-parse", "HEAD") or "unknown", "dirty": bool(code), "dirty_files": changed[:20]}


def speed_probe(rounds: int = 5) -> dict[str, float]:
    """How fast this machine was at the moment of the stamp: a fixed pure-Python loop (ms) and a
    64 MiB memory copy (GB/s), medians of ``rounds``. The same VM has run ~2x slower on one day than
    on another (every row alike), so two runs' absolute figures compare only next to their probes;
    ratios within one run do not need them."""
    import time

    import numpy

    def loop() -> float:
        t = time.perf_counter()
        total = 0
        for i in range(1_000_000):
            total += i & 7
        return (time.perf_counter() - t) * 1e3

    src = numpy.ones(2**23, dtype=numpy.float64)  # 64 MiB
    dst = numpy.empty_like(src)

    def copy() -> float:
        t = time.perf_counter()
        numpy.copyto(dst, src)
        return src.nbytes / (time.perf_counter() - t) / 1e9

    copy()  # the first copy faults the destination's pages in
    return {
        "python_loop_ms": round(statistics.median(loop() for _ in range(rounds)), 1),
        "copy_gb_per_s": round(statistics.median(copy() for _ in range(rounds)), 1),
    }


def provenance(extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """What a reader needs to trust a figure: code, date, machine, versions, the load and the
    machine's speed at the time."""
    return {
        "git": git(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(extra),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "speed_probe": speed_probe(),
    }


def stamp(section: dict[str, Any], extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """``section`` with its own ``provenance`` (for scripts whose sections run at different moments)."""
    return {**section, "provenance": provenance(extra)}


def write_results(
    name: str, data: dict[str, Any], extra: tuple[str, ...] = (), path: str | None = None, quick: bool = False
) -> str:
    """Write one run's results to ``benchmarks/results/<name>.json`` (or ``path``), stamped; returns the path.

    The file is replaced, never merged into: a file holds one run. ``quick`` runs (smoke sizes) go
    to ``benchmarks/out/quick/`` instead, so they never replace a committed result.
    """
    folder = QUICK if quick else RESULTS
    target = path or os.path.join(folder, name if name.endswith(".json") else f"{name}.json")
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    record = {
        "provenance": {**provenance(extra), "quick": quick},
        **{k: v for k, v in data.items() if k != "provenance"},
    }
    tmp = f"{target}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, default=plain)
        f.write("\n")
    os.replace(tmp, target)
    return target


def plain(value: Any) -> Any:
    """JSON for numpy scalars, sets and tuples; anything else as its string."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, set | tuple):
        return list(value)
    return str(value)


def summary(values: list[float]) -> dict[str, Any]:
    """Median and spread (min, max) of repeated measurements, with the runs themselves."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def alternate(variants: dict[str, Callable[[], float]], runs: int = MIN_RUNS) -> dict[str, dict[str, Any]]:
    """Run each variant ``runs`` times in turn (A B C A B C ...); median and spread of each.

    Alternating spreads a change in machine load over all variants instead of one.
    """
    if runs < MIN_RUNS:
        raise ValueError(f"alternate: {runs} runs; a figure needs at least {MIN_RUNS}")
    measured: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(runs):
        for name, fn in variants.items():
            measured[name].append(float(fn()))
    return {name: summary(values) for name, values in measured.items()}


def ratio(numerator: dict[str, Any], denominator: dict[str, Any]) -> dict[str, Any]:
    """The per-round ratio of two ``alternate`` results (same round paired), as a ``summary``."""
    pairs = zip(numerator["runs"], denominator["runs"], strict=True)
    return summary([a / b for a, b in pairs if b])


def machine_line(record: dict[str, Any]) -> str:
    """One line for the docs: machine, versions, commit, date; from a stamp or the older blocks."""
    prov = record.get("provenance")
    if prov is None and "environment" in record:
        env, gitinfo = record["environment"], record.get("git") or record.get("git_at_start") or {}
        head = gitinfo.get("head") or gitinfo.get("commit") or ""
        dirty = bool(gitinfo.get("dirty"))
        code = (
            f"commit `{head[:7]}`{' (library modified during the run)' if dirty else ''}"
            if head
            else "commit not recorded"
        )
        return (
            f"Machine: {env.get('vcpus')} vCPU {env.get('cpu')}, {env.get('ram_gib')} GiB RAM, "
            f"Linux {env.get('kernel')}. "
            f"Python {env.get('python')}, numpy {env.get('numpy')}, torch {env.get('torch')}, "
            f"statefulset {env.get('statefulset')}. Code: {code}; date not recorded{_legacy_load(record)}."
        )
    if prov is None:
        return (
            "Machine, commit and date: **not recorded** (this results file predates the provenance stamp); "
            "the figures are to re-measure."
        )
    m, v, g = prov["machine"], prov["versions"], prov["git"]
    dirty = " plus uncommitted changes" if g.get("dirty") else ""
    packages = ", ".join(f"{k} {val}" for k, val in v.items() if k != "python")
    probe = prov.get("speed_probe")
    speed = (
        f"; speed probe {probe['python_loop_ms']} ms a fixed Python loop, {probe['copy_gb_per_s']} GB/s memory copy"
        if probe
        else ""
    )
    return (
        f"Machine: {m['cores']} cores {m['cpu']}, {m['memory_gib']} GiB RAM, Linux {m['kernel']}. "
        f"Python {v['python']}, {packages}. Code: commit `{g['commit'][:7]}`{dirty}; run {prov['date'][:10]}, "
        f"load average {prov['load_average'][0]}{speed}."
    )


def _legacy_load(record: dict[str, Any]) -> str:
    """The load average an older results file kept at its top level (taken at the end of its run)."""
    load = record.get("load")
    if isinstance(load, list | tuple) and load:
        return f", load average {load[0]} at the end of the run"
    return ""
