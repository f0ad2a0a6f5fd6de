"""The local Ray that ``preprocess --executor ray`` starts ends with its driver, however the driver ends.

``ray.init()`` with no address starts Ray's processes as children of the driver. Ray ties its GCS
server and raylet to the driver (``PR_SET_PDEATHSIG``), but their own children, the dashboard and
runtime-env agents and idle workers, only notice later that the raylet is gone, by their own
checks: after a SIGKILL of the driver they were seen alive for more than a minute, and a user
found two agents left running.

So before Ray starts, the driver starts a guardian: this file, run by the same Python with ``-I``
(no user site, no ``PYTHONPATH``, nothing but the standard library). Its standard input is a pipe
that only the driver holds. While the pipe is open, it records every process below the driver
that was not there before (pid and start time, from ``/proc``) every ``POLL_S`` seconds. At
end-of-file (the driver closed it after ``ray.shutdown()``, exited, or was killed by any signal,
SIGKILL included) it sends SIGKILL to every recorded process still alive with its recorded start
time (a pid reused since is left alone) and to their descendants, then exits. It ignores SIGINT,
SIGTERM and SIGHUP, which a terminal or a job scheduler sends to the whole process group, so that
it outlives the driver long enough to clean up; it has nothing else to wait for. Linux only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys

POLL_S = 0.5
STOP_TIMEOUT_S = 30.0  # a cleanup is a /proc scan and some kill() calls: seconds even on a loaded machine

log = logging.getLogger(__name__)


def process_table() -> dict[int, tuple[int, int]]:
    """``pid -> (parent pid, start time in clock ticks)`` of every process in ``/proc``."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue  # ended meanwhile
        fields = data[data.rindex(b")") + 2 :].split()  # the name in parentheses may hold spaces
        table[int(entry)] = (int(fields[1]), int(fields[19]))
    return table


def below(roots: set[int], table: dict[int, tuple[int, int]]) -> set[int]:
    """Every process whose chain of parents reaches one of ``roots`` (the roots excluded)."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found: set[int] = set()
    todo = [c for r in roots for c in children.get(r, [])]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return found


def children_of(pid: int) -> list[int]:
    return [p for p, (parent, _) in process_table().items() if parent == pid]


def guard(driver: int, excluded: set[int]) -> int:
    """The guardian's loop: record the driver's new descendants until end-of-file, then kill them."""
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_IGN)
    excluded = excluded | {os.getpid()}
    seen: dict[int, int] = {}
    while True:
        table = process_table()
        roots = {driver} | set(seen)
        for pid in below(roots, table) - excluded - below(excluded, table):
            seen.setdefault(pid, table[pid][1])
        ready, _, _ = select.select([0], [], [], POLL_S)
        if ready and not os.read(0, 4096):
            break  # end-of-file: the driver is done or dead
    table = process_table()
    alive = {pid for pid, start in seen.items() if pid in table and table[pid][1] == start}
    for pid in alive | below(alive, table):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return 0


class RayGuardian:
    """The driver's handle on its guardian process (see the module's docstring)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process

    @classmethod
    def start(cls) -> RayGuardian | None:
        if not sys.platform.startswith("linux"):
            log.info("preprocess: no guardian for the local Ray on %s (it reads /proc)", sys.platform)
            return None
        before = ",".join(str(p) for p in children_of(os.getpid()))
        process = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), before],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        return cls(process)

    def stop(self) -> None:
        """Closes the pipe (the guardian then kills what Ray left) and waits for the guardian, bounded."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("preprocess: the local Ray's guardian (pid %d) did not end within %.0f s of the run's "
                        "end; killed", self.process.pid, STOP_TIMEOUT_S)  # fmt: skip
            self.process.kill()
            self.process.wait(timeout=STOP_TIMEOUT_S)


if __name__ == "__main__":
    sys.exit(guard(int(sys.argv[1]), {int(p) for p in sys.argv[2].split(",") if p}))
