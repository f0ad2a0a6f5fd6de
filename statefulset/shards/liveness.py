"""Who owns a lock or a temporary file, whether that owner still lives, and the shared filesystem's clock.

A pid alone names no process: containers that share a hostname each have their own pid
namespace (pid 7 in one is not pid 7 in the other), and a pid is reused once its process is
reaped. So an owner is recorded as

- its **node**: the hostname, the kernel's boot id (``/proc/sys/kernel/random/boot_id``, new at
  every boot) and the inode of its pid namespace (``/proc/self/ns/pid``): two processes can
  check each other's pids only when all three are equal;
- its **process**: the pid and the process's start time (field 22 of ``/proc/<pid>/stat``, in
  clock ticks since boot), so a pid that was reused is not taken for the owner.

:func:`alive` answers for an owner of this node (True or False) and refuses to guess for one of
another node (None): the caller then judges by a heartbeat, the mtime the owner refreshes.

Heartbeats are compared with :func:`server_now`, the clock of the filesystem holding the file
(nodes' clocks may differ from the file server's by more than a heartbeat): the mtime of a probe
file created and touched there, the same way an owner touches its heartbeat.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import socket
import time
from typing import Any

CLOCK_CACHE_S = 60.0  # how long one probe of a folder's clock is trusted
_node: str | None = None
_clock_offsets: dict[str, tuple[float, float]] = {}  # folder -> (offset, monotonic time measured)


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, ValueError):
        return ""


def node() -> str:
    """This node: ``<hostname>/<boot id>/<pid namespace inode>`` (the parts Linux cannot tell are empty)."""
    global _node
    if _node is None:
        try:
            namespace = str(os.stat("/proc/self/ns/pid").st_ino)
        except OSError:
            namespace = ""
        _node = f"{socket.gethostname()}/{_read('/proc/sys/kernel/random/boot_id')}/{namespace}"
    return _node


def node_token() -> str:
    """This node in a form fit for a file name: ``<hostname>-<10 hex digits of the node>``."""
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"
    return f"{host}-{hashlib.blake2b(node().encode(), digest_size=5).hexdigest()}"


def start_time(pid: int) -> int | None:
    """When process ``pid`` of this pid namespace started (clock ticks since boot); None when it
    does not exist or is a zombie (killed, not yet reaped: dead for us)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return _signal_probe(pid)  # no /proc, or one that hides other users' processes (hidepid)
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _signal_probe(pid: int) -> int | None:
    """Whether ``pid`` exists at all, when /proc cannot tell (0 stands for an unknown start time)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except (PermissionError, OverflowError):
        pass
    return 0


def owner() -> dict[str, Any]:
    """This process as an owner record (JSON-serialisable)."""
    pid = os.getpid()
    return {"node": node(), "host": socket.gethostname(), "pid": pid, "start": start_time(pid), "since": time.time()}


def alive(record: dict[str, Any]) -> bool | None:
    """Whether the owner ``record`` (from :func:`owner`) still runs; None when it is not of this node."""
    if not isinstance(record, dict) or record.get("node") != node():
        return None
    try:
        return process_alive(int(record["pid"]), record.get("start"))
    except (KeyError, TypeError, ValueError, OverflowError):
        return None


def process_alive(pid: int, start: int | None) -> bool:
    """Whether process ``pid`` of this node runs and is the one that started at ``start`` (None: any)."""
    if pid <= 0:
        return False
    now = start_time(pid)
    if now is None:
        return False
    return start is None or now == 0 or now == int(start)


def server_now(folder: str) -> float:
    """The current time on the clock of the filesystem holding ``folder`` (the local clock when it
    cannot be probed, e.g. a read-only folder)."""
    key = os.path.abspath(folder)
    cached = _clock_offsets.get(key)
    if cached is not None and time.monotonic() - cached[1] < CLOCK_CACHE_S:
        return time.time() + cached[0]
    probe = os.path.join(folder, f".statefulset-clock.{node_token()}.{os.getpid()}.{secrets.token_hex(6)}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        _clock_offsets[key] = (0.0, time.monotonic())  # not probed again for a while
        return time.time()
    try:
        os.utime(fd)  # as an owner's heartbeat does: on NFS the server sets the time
        offset = os.fstat(fd).st_mtime - time.time()
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)
    _clock_offsets[key] = (offset, time.monotonic())
    return time.time() + offset


def age(path: str, mtime: float) -> float:
    """Seconds since ``mtime`` (of file ``path``) on its filesystem's clock."""
    return server_now(os.path.dirname(path) or ".") - mtime
