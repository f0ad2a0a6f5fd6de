"""Helpers shared by the benchmark scripts: memory readings, load, quiet-machine waits, summaries.

Results files are written through ``provenance.write_results`` (commit, machine, versions).
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time

from provenance import cpu_model, memory_gib, version


def environment() -> dict[str, object]:
    """Machine and versions, read without importing torch or megatron (so it is cheap)."""
    return {
        "cpu": cpu_model(),
        "vcpus": os.cpu_count(),
        "ram_gib": memory_gib(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": version("numpy") or "not installed",
        "torch": version("torch") or "not installed",
        "megatron-core": version("megatron-core") or "not installed",
        "statefulset": version("statefulset") or "not installed",
    }


def git_state() -> dict[str, str]:
    """Which code was measured: HEAD, and uncommitted changes to the library (empty when clean)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, check=False)
        return done.stdout.strip()

    return {"head": git("rev-parse", "HEAD"), "dirty": git("status", "--porcelain", "--", "statefulset")}


def load_average() -> list[float]:
    """1/5/15-minute load: on a 2-vCPU machine anything else running shows up in the timings."""
    return [round(x, 2) for x in os.getloadavg()]


def vm_status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak RSS) of this process, in KiB."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0), so a later peak measures only what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def environment_markdown(env: dict[str, object]) -> str:
    return (
        f"Machine: {env['vcpus']} vCPU {env['cpu']}, {env['ram_gib']} GiB RAM, Linux {env['kernel']}. "
        f"Python {env['python']}, numpy {env['numpy']}, torch {env['torch']}, "
        f"megatron-core {env['megatron-core']}, statefulset {env['statefulset']}."
    )


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all processes, from /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(
    max_wait: float, threshold: float, sample: float = 1.0, pause: float = 4.0, say: bool = False
) -> float:
    """Wait (up to ``max_wait`` s) until other processes use less than ``threshold`` cores; returns seconds waited.

    Each check measures the machine's busy CPU over ``sample`` seconds, then sleeps ``pause``.
    """
    start = time.perf_counter()
    while True:
        b0, t0 = busy_cpu_s(), time.perf_counter()
        time.sleep(sample)
        used = (busy_cpu_s() - b0) / (time.perf_counter() - t0)
        waited = time.perf_counter() - start
        if used < threshold or waited > max_wait:
            return waited
        if say:
            print(f"  machine busy ({used:.2f} cores used by others), waiting", file=sys.stderr)
        time.sleep(pause)
