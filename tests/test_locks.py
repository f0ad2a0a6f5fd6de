"""Lock files (``STATEFULSET_LOCK=file``, or filesystems without ``flock``): atomic creation, guarded
removal, owners judged by node and process identity, drafts of killed creators swept.

Real processes and files throughout. The races are gated, not timed: the process that must be
caught in its window waits there on a file the test creates, so the race always lands.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from waiting import wait_for

from statefulset.errors import StatefulsetError
from statefulset.shards import liveness, locks


@pytest.fixture
def file_locks(monkeypatch):
    monkeypatch.setenv("STATEFULSET_LOCK", "file")


# The first holder, stopped right after its lock file appears (by O_EXCL creation or by link,
# whichever the implementation uses) until the test creates <gates>/go.
GATED_HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from statefulset.shards import locks
    lock, gates = sys.argv[1], sys.argv[2]
    held = lock + ".held"

    def gate():
        open(os.path.join(gates, "window"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(gates, "go")):
            if time.monotonic() > deadline:
                sys.exit("the test never opened the gate")
            time.sleep(0.005)

    real_open, real_link = os.open, os.link

    def gated_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if os.fspath(path) == held and flags & os.O_CREAT:
            gate()
        return fd

    def gated_link(source, target, *args, **kwargs):
        real_link(source, target, *args, **kwargs)
        if os.fspath(target) == held:
            gate()

    os.open, os.link = gated_open, gated_link
    with locks.exclusive(lock, "subject", "testing"):
        open(os.path.join(gates, "A-in"), "w").close()
    """
)

WAITER = textwrap.dedent(
    """
    import logging, os, sys
    from statefulset.shards import locks
    logging.basicConfig(level=logging.INFO)
    lock, gates = sys.argv[1], sys.argv[2]
    with locks.exclusive(lock, "subject", "testing"):
        open(os.path.join(gates, "B-in"), "w").close()
    """
)


def test_a_lock_file_is_never_seen_without_its_owner(tmp_path, file_locks):
    """C5: the lock file appeared empty and was filled later; a waiter that read it in between took
    it for the leftover of a holder that died at once, removed it and held the lock too.
    (Fails on 5cf6a81: the waiter enters while the first holder holds the lock.)"""
    lock, gates = str(tmp_path / "x.lock"), tmp_path / "gates"
    gates.mkdir()
    first = subprocess.Popen([sys.executable, "-c", GATED_HOLDER, lock, str(gates)])
    log = tmp_path / "waiter.log"
    waiter = None
    try:
        wait_for(lambda: (gates / "window").exists(), "the first holder's lock file to appear")
        with open(log, "w") as err:
            waiter = subprocess.Popen([sys.executable, "-c", WAITER, lock, str(gates)], stderr=err)
        wait_for(
            lambda: (gates / "B-in").exists() or "waiting for another process" in log.read_text(),
            "the waiter to enter or to wait",
        )
        assert not (gates / "B-in").exists(), "the waiter took a lock its holder had just created"
        (gates / "go").touch()
        assert first.wait(timeout=60) == 0
        assert waiter.wait(timeout=60) == 0, log.read_text()
        assert (gates / "A-in").exists() and (gates / "B-in").exists()
        assert "stale lock" not in log.read_text()
        assert not os.path.exists(lock + ".held")
    finally:
        for proc in (first, waiter):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


KILLED_CREATOR = textwrap.dedent(
    """
    import os, sys, time
    from statefulset.shards import locks

    def stopped_link(source, target, *args, **kwargs):
        open(sys.argv[2], "w").close()
        time.sleep(120)  # killed here, between its draft and the link

    os.link = stopped_link
    with locks.exclusive(sys.argv[1], "subject", "testing"):
        pass
    """
)


def drafts(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith((".draft", ".broken")))


def test_drafts_of_killed_creators_are_swept(tmp_path, file_locks):
    lock, window = str(tmp_path / "x.lock"), tmp_path / "window"
    killed = subprocess.Popen([sys.executable, "-c", KILLED_CREATOR, lock, str(window)])
    try:
        wait_for(window.exists, "the creator to write its draft")
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    left = drafts(tmp_path)
    assert len(left) == 1 and f".{killed.pid}." in left[0], left
    # A draft of a live process of this node, and one of another node with a fresh mtime: kept.
    live = tmp_path / f"x.lock.held.{liveness.node_token()}.{os.getpid()}.0123456789ab.draft"
    live.write_text("{}")
    other = tmp_path / "x.lock.held.elsewhere-0011223344.7.0123456789ab.draft"
    other.write_text("{}")
    old = tmp_path / "x.lock.held.elsewhere-0011223344.8.0123456789ab.broken"
    old.write_text("{}")
    past = time.time() - locks.STALE_S - 60
    os.utime(old, (past, past))
    with locks.exclusive(lock, "subject", "testing") as held:
        assert held
    assert drafts(tmp_path) == sorted([live.name, other.name])
    assert not os.path.exists(lock + ".held")


def test_a_holder_removes_only_its_own_lock_file(tmp_path, file_locks, caplog):
    """A holder whose lock was taken over (judged stale) must not remove its successor's lock.
    (Fails on 5cf6a81: the first holder's release unlinks whatever file has the name.)"""
    lock = str(tmp_path / "x.lock")
    successor = json.dumps({"node": "elsewhere//", "host": "elsewhere", "pid": 7, "start": 1, "token": "ab"})
    with caplog.at_level(logging.WARNING, logger="statefulset"), locks.exclusive(lock, "subject", "testing") as held:
        assert held
        replacement = tmp_path / "replacement"
        replacement.write_text(successor)
        os.replace(replacement, lock + ".held")  # what a waiter that broke it would leave
    assert (tmp_path / "x.lock.held").read_text() == successor
    assert "was taken over by another process while this one held it" in caplog.text


def _record(**fields) -> str:
    return json.dumps({"host": socket.gethostname(), "since": time.time(), "token": "00", **fields})


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_a_container_sharing_the_hostname_is_judged_by_its_heartbeat(tmp_path, file_locks, monkeypatch):
    """C12: another container of this hostname has its own pid namespace: its holder's pid means
    nothing here, so a fresh heartbeat keeps its lock. (Fails on 5cf6a81: a pid missing here on
    "this host" broke the lock at once.)"""
    monkeypatch.setenv("STATEFULSET_CACHE_WAIT", "1")
    lock = str(tmp_path / "x.lock")
    host, boot, _ = liveness.node().split("/")
    other_container = f"{host}/{boot}/4026531999"
    assert other_container != liveness.node()
    with open(lock + ".held", "w") as f:
        f.write(_record(node=other_container, pid=_dead_pid(), start=1))
    with (
        pytest.raises(StatefulsetError, match=r"^subject: waited 1 s for another process testing"),
        locks.exclusive(lock, "subject", "testing"),
    ):
        pass
    # The same lock once its heartbeat stopped STALE_S ago (on the filesystem's clock): taken over.
    past = liveness.server_now(str(tmp_path)) - locks.STALE_S - 5
    os.utime(lock + ".held", (past, past))
    with locks.exclusive(lock, "subject", "testing") as held:
        assert held


def test_a_reused_pid_is_not_the_holder(tmp_path, file_locks, monkeypatch):
    """The holder's pid now belongs to another process (a later start time): the holder is dead.
    (Fails on 5cf6a81: any live process with that pid kept the lock until its heartbeat aged.)"""
    monkeypatch.setenv("STATEFULSET_CACHE_WAIT", "5")
    lock = str(tmp_path / "x.lock")
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        start = liveness.start_time(other.pid)
        assert start is not None
        with open(lock + ".held", "w") as f:
            f.write(_record(node=liveness.node(), pid=other.pid, start=start - 1))
        with locks.exclusive(lock, "subject", "testing") as held:
            assert held
    finally:
        other.stdin.close()
        other.wait()


def test_a_live_holder_of_this_node_keeps_its_lock(tmp_path, file_locks, monkeypatch):
    monkeypatch.setenv("STATEFULSET_CACHE_WAIT", "1")
    lock = str(tmp_path / "x.lock")
    with open(lock + ".held", "w") as f:
        f.write(_record(node=liveness.node(), pid=os.getpid(), start=liveness.start_time(os.getpid())))
    past = time.time() - locks.STALE_S - 60  # even with an old heartbeat: the process itself runs
    os.utime(lock + ".held", (past, past))
    with pytest.raises(StatefulsetError, match="waited 1 s"), locks.exclusive(lock, "subject", "testing"):
        pass


def test_an_unreadable_young_lock_file_is_live(tmp_path, file_locks, monkeypatch):
    """What a filesystem without hard links shows in the instant between creation and content."""
    monkeypatch.setenv("STATEFULSET_CACHE_WAIT", "1")
    lock = str(tmp_path / "x.lock")
    open(lock + ".held", "w").close()
    with pytest.raises(StatefulsetError, match="waited 1 s"), locks.exclusive(lock, "subject", "testing"):
        pass


def test_identities():
    node = liveness.node()
    assert node.count("/") == 2 and node.startswith(socket.gethostname() + "/")
    assert liveness.process_alive(os.getpid(), liveness.start_time(os.getpid()))
    assert not liveness.process_alive(_dead_pid(), None)
    assert liveness.alive({"node": "elsewhere//", "pid": 1}) is None
    assert abs(liveness.server_now(".") - time.time()) < 60  # a local folder: our own clock


def test_the_clock_of_a_folder_that_cannot_be_probed_is_ours(tmp_path):
    missing = str(tmp_path / "missing")  # as a read-only folder: no probe file can be made there
    assert abs(liveness.server_now(missing) - time.time()) < 60
    assert not os.path.exists(missing)
