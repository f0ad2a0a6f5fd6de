"""CPU seconds of this process and of its children (DataLoader workers), from ``/proc`` (Linux).

CPU per request is the figure a loaded machine does not change much, where tokens/s do: the
benchmarks of object storage report it beside their rates (docs/reading-benchmarks.md).
"""

from __future__ import annotations

import os
import time


def tree_cpu() -> float:
    """User and system CPU seconds of this process and of its live children so far."""
    total = time.process_time()
    me, tick = os.getpid(), os.sysconf("SC_CLK_TCK")
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == me:  # fields after the name: state, ppid, ..., utime (11), stime (12)
            total += (int(fields[11]) + int(fields[12])) / tick
    return total
