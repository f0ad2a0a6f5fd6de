"""A killed ``preprocess --executor ray`` driver leaves none of the local Ray it started.

Real processes: the CLI in its own session, one task committed and the others held at the test
gate (so the kill always lands while Ray's workers and agents run), then the driver alone is
killed, with SIGKILL or SIGTERM. Every process that was below the driver (the GCS server, the
raylet, the dashboard and runtime-env agents, the workers, the guardian) must be gone within
``GONE_S``; before the guardian, the agents and idle workers were seen alive 30-90 s later.
Processes are read from ``/proc`` here, independently of the code under test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

START_S = 240  # a local Ray's start and the first task's commit, on a loaded 2-core machine
GONE_S = 20


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent, start time, state) of a process, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[1]), int(fields[19]), fields[0].decode()


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"


def _below(root: int) -> dict[int, tuple[int, str]]:
    """Every process below ``root``: pid -> (start time, command line)."""
    table = {int(p): _stat(int(p)) for p in os.listdir("/proc") if p.isdigit()}
    found: dict[int, tuple[int, str]] = {}
    todo = [root]
    while todo:
        parent = todo.pop()
        for pid, st in table.items():
            if st is not None and st[0] == parent and pid not in found:
                found[pid] = (st[1], _name(pid))
                todo.append(pid)
    return found


def _committed(parts) -> bool:
    return parts.exists() and any(n.endswith(".done") for n in os.listdir(parts))


def _alive(processes: dict[int, tuple[int, str]]) -> dict[int, str]:
    """The processes still running (same pid and start time, not a zombie)."""
    out = {}
    for pid, (start, name) in processes.items():
        st = _stat(pid)
        if st is not None and st[1] == start and st[2] != "Z":
            out[pid] = name
    return out


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_driver_leaves_no_ray_process(tmp_path, sig):
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(4000))
    gate = tmp_path / "gate"
    gate.write_text("1")  # task 0 commits, every later task waits at the gate
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "STATEFULSET_TEST_GATE": str(gate)}
    args = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out"), "--executor", "ray",
            "--task-bytes", "40000", "--chunk-bytes", "16384", "--quiet"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "statefulset", "preprocess", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, start_new_session=True)  # fmt: skip
    seen: dict[int, tuple[int, str]] = {}
    try:
        deadline = time.monotonic() + START_S
        while not _committed(tmp_path / "out.parts"):
            assert proc.poll() is None, proc.communicate(timeout=60)
            assert time.monotonic() < deadline, f"task 0 did not commit within {START_S} s"
            time.sleep(0.1)
        time.sleep(2 * 0.5)  # two of the guardian's scans: it has seen every process there now
        seen = _below(proc.pid)
        names = " | ".join(n for _, n in seen.values())
        assert "raylet" in names and "ray::run" in names, names  # ray::run: a worker running a held task
        os.kill(proc.pid, sig)  # the driver alone, as `kill PID` or the OOM killer would
        proc.wait(timeout=60)
        deadline = time.monotonic() + GONE_S
        while _alive(seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _alive(seen)
        assert not left, f"{len(left)} process(es) of the local Ray still run {GONE_S} s after the driver's " + (
            f"{sig.name}:\n" + "\n".join(f"{p}: {n}" for p, n in left.items())
        )
    finally:
        gate.unlink(missing_ok=True)
        for pid in _alive(seen):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
