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
