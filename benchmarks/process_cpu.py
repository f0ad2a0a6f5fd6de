"""CPU seconds of this process and of its children (DataLoader workers), from ``/proc`` (Linux).

CPU per request is the figure a loaded machine does not change much, where tokens/s do: the
benchmarks of object storage report it beside their rates (docs/reading-benchmarks.md).
"""

from __future__ import annotations

import os
import time


def proc_cpu(field: int, value: int) -> dict[int, float]:
    """User and system CPU seconds so far of every live process whose /proc stat field ``field``
    (counted after the name: 1 is the ppid, 3 the session id) equals ``value``, by pid."""
    tick = os.sysconf("SC_CLK_TCK")
    found: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[field]) == value:  # fields after the name: state, ppid, ..., utime (11), stime (12)
            found[int(name)] = (int(fields[11]) + int(fields[12])) / tick
    return found


def tree_cpu() -> float:
    """User and system CPU seconds of this process and of its live children so far."""
    return time.process_time() + sum(proc_cpu(1, os.getpid()).values())


def children(pid: int | None = None) -> list[int]:
    """The live child processes of ``pid`` (default: this process), e.g. its forked DataLoader workers."""
    return sorted(proc_cpu(1, os.getpid() if pid is None else pid))


def task_cpu_ns(pid: int) -> int:
    """CPU nanoseconds so far of every live thread of process ``pid``, from ``/proc/<pid>/task/*/schedstat``
    (its first field: nanoseconds on a CPU; not clock ticks as in ``/proc/<pid>/stat``, so a
    measurement of milliseconds resolves). 0 for a process that is gone."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, IndexError, ValueError):  # a thread gone meanwhile
            continue
    return total


def cpu_ns(pids: list[int]) -> tuple[int, int]:
    """(this process's CPU nanoseconds, all threads; the CPU nanoseconds of the processes ``pids``) so far."""
    return time.process_time_ns(), sum(task_cpu_ns(pid) for pid in pids)
