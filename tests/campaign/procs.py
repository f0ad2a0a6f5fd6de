"""Processes of a case, read from /proc: descendants, members of a process group, their command lines."""

from __future__ import annotations

import contextlib
import os
import signal
import time


def children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(x) for x in f.read().split()]
    return found


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Running or stopped, not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def stopped(pids: list[int]) -> list[int]:
    """Those of ``pids`` that are live and stopped (SIGSTOP)."""
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    found.append(pid)
        except OSError:
            pass
    return found


def describe(pid: int) -> str:
    """A process's name, state, parent and kernel wait channel, for a failure message."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read()
        return f"{status['Name'].strip()} {status['State'].strip()} ppid {status['PPid'].strip()} wchan {wchan}"
    except (OSError, KeyError):
        return "gone"


def group_members(pgid: int) -> list[int]:
    """Live processes whose process group is ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            found.append(int(entry))
    return found


def new_workers(before: set[int]) -> list[int]:
    """Worker processes that appeared under this process since ``before`` (not a fork server or tracker)."""
    me = os.getpid()
    fresh = [p for p in descendants(me) if p not in before and "resource_tracker" not in cmdline(p)]
    return [p for p in fresh if not set(children(p)) & set(fresh)]  # a fork server has the workers as children


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive after waiting up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def kill_all(pids: list[int]) -> None:
    for p in pids:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
