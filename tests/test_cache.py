"""The index cache: content-keyed, one correct entry from concurrent builders, nothing from a crash."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy
import pytest
from waiting import wait_for

from statefulset import IndexedDataset, IndexedDatasetWriter, StatefulsetError
from statefulset.index import cache as cache_module
from statefulset.index.cache import IndexCache
from statefulset.shards.digests import shard_digest
from statefulset.streams.opening import open_stream


def write_shard(prefix, seed, docs=400):
    rng = numpy.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, numpy.uint16) as w:
        for _ in range(docs):
            w.add_document(rng.integers(0, 60000, int(rng.geometric(1 / 80))))


@pytest.fixture
def spec(tmp_path):
    write_shard(str(tmp_path / "a"), 1)
    write_shard(str(tmp_path / "b"), 2)
    return {
        "data_path": {str(tmp_path / "a"): 0.3, str(tmp_path / "b"): 0.7},
        "seq_length": 32,
        "num_samples": 20_000,
        "path_to_cache": str(tmp_path / "cache"),
    }


def entries(root):
    return sorted(n for n in os.listdir(root) if not n.endswith(".lock") and n not in ("facts", "kernels"))


def mapped(array: numpy.ndarray) -> bool:
    """Backed by a memory map: a numpy.memmap, or a plain view of one (the streams index plain views)."""
    while isinstance(array, numpy.ndarray):
        if isinstance(array, numpy.memmap):
            return True
        array = array.base
    return isinstance(array, mmap.mmap)


def test_second_open_loads_the_cached_arrays(spec):
    first = open_stream(spec)
    before = dict(cache_module.builds)
    second = open_stream(spec)
    assert cache_module.builds == before  # nothing rebuilt
    assert mapped(second.sources[0].document_index)  # read from the cache's file, not built
    numpy.testing.assert_array_equal(first.gather(numpy.arange(500)), second.gather(numpy.arange(500)))
    names = entries(spec["path_to_cache"])
    assert [n.split("-")[0] for n in names] == ["BlendedDataset", "GPTDataset", "GPTDataset"]
    with open(os.path.join(spec["path_to_cache"], names[0], "description.json")) as f:
        assert json.load(f)["description"]["size"] == len(first)


def test_retokenised_shard_never_reuses_stale_indices(spec, tmp_path):
    old = open_stream(spec).gather(numpy.arange(300))
    write_shard(str(tmp_path / "a"), 99)  # same prefix, new content: megatron-core would reuse its cache
    fresh = open_stream(spec)
    uncached = open_stream({**spec, "path_to_cache": None})
    numpy.testing.assert_array_equal(fresh.gather(numpy.arange(300)), uncached.gather(numpy.arange(300)))
    assert not numpy.array_equal(old, fresh.gather(numpy.arange(300)))
    assert len(entries(spec["path_to_cache"])) == 5  # one GPTDataset and the blend are new


def _settle(prefix: str, age: float = 60) -> None:
    """Date a shard's files ``age`` seconds back, as if written long ago."""
    past = time.time() - age
    for ext in (".idx", ".bin"):
        os.utime(prefix + ext, (past, past))


def test_digest_is_remembered_per_file_version(tmp_path):
    prefix = str(tmp_path / "s")
    write_shard(prefix, 3)
    memo = str(tmp_path / "memo")
    first = shard_digest(prefix, memo)
    assert not os.path.exists(memo)  # a file written just now may still change under the same mtime
    _settle(prefix)
    assert shard_digest(prefix, memo) == first
    assert len([n for n in os.listdir(memo) if n.endswith(".json")]) == 1
    write_shard(prefix, 4)
    _settle(prefix, age=30)
    assert shard_digest(prefix, memo) != first


def test_a_verified_shard_version_is_checked_again_once_it_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    prefix = str(tmp_path / "s")
    write_shard(prefix, 5)
    _settle(prefix)
    IndexedDataset(prefix)  # checked in full and remembered
    assert os.listdir(tmp_path / "xdg" / "statefulset" / "memo")
    IndexedDataset(prefix)  # O(1) checks only
    with open(prefix + ".idx", "r+b") as f:  # a pointer rewritten in place: same size, new mtime
        f.seek(-8 * 5 - 8, os.SEEK_END)
        f.write((12345).to_bytes(8, "little"))
    with pytest.raises(StatefulsetError, match=r"sequence_pointers|document_indices"):
        IndexedDataset(prefix)


CHILD = textwrap.dedent(
    """
    import hashlib, json, sys, time
    import numpy
    from statefulset.index import cache
    from statefulset.streams.opening import open_stream
    spec = json.loads(sys.argv[1])
    while time.time() < float(sys.argv[2]):  # start together
        time.sleep(0.001)
    stream = open_stream(spec)
    rows = stream.gather(numpy.arange(len(stream)))
    print(json.dumps({"builds": cache.builds, "digest": hashlib.sha256(rows.tobytes()).hexdigest()}))
    """
)


def test_concurrent_builders_make_one_correct_cache(spec):
    import time

    start = time.time() + 3
    children = [
        subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(spec), str(start)], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    results = []
    for child in children:
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0
        results.append(json.loads(out))
    expected = open_stream({**spec, "path_to_cache": None})
    digest = __import__("hashlib").sha256(expected.gather(numpy.arange(len(expected))).tobytes()).hexdigest()
    assert {r["digest"] for r in results} == {digest}
    # The lock lets exactly one process build each entry; the others load it.
    assert sum(r["builds"].get("GPTDataset", 0) for r in results) == 2
    assert sum(r["builds"].get("BlendedDataset", 0) for r in results) == 1
    assert len(entries(spec["path_to_cache"])) == 3
    assert not [n for n in os.listdir(spec["path_to_cache"]) if n.startswith(".tmp")]


# Two processes asking for the same entry, with builds the test controls: "slow" signals that it is
# building and then waits for a go file; "eager" records whether its own build ever ran.
LOCK_CHILD = textwrap.dedent(
    """
    import os, sys, time
    import numpy
    from statefulset.index.cache import IndexCache

    root, mode, signal_file, go = sys.argv[1:5]

    def slow():
        open(signal_file, "w").close()
        while not os.path.exists(go):
            time.sleep(0.01)
        return {"a": numpy.arange(7)}

    def eager():
        open(signal_file, "w").close()
        return {"a": numpy.arange(7) * 0}

    arrays = IndexCache(root).get_or_build("GPTDataset", {"x": 1}, slow if mode == "slow" else eager)
    print(arrays["a"].tolist())
    """
)


def test_a_second_builder_waits_for_the_first_and_loads_its_entry(tmp_path):
    # The two requests overlap for certain: the second starts while the first is inside its build.
    root, go = str(tmp_path / "cache"), str(tmp_path / "go")
    building, eager_ran = str(tmp_path / "building"), str(tmp_path / "eager-ran")
    first = subprocess.Popen([sys.executable, "-c", LOCK_CHILD, root, "slow", building, go], stdout=subprocess.PIPE)
    try:
        wait_for(lambda: os.path.exists(building), f"the first builder to start ({building})")
        second = subprocess.Popen(
            [sys.executable, "-c", LOCK_CHILD, root, "eager", eager_ran, go], stdout=subprocess.PIPE
        )
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                second.wait(timeout=3)  # blocked on the first one's lock, not building its own
            assert not os.path.exists(eager_ran)
            open(go, "w").close()
            out_first, _ = first.communicate(timeout=60)
            out_second, _ = second.communicate(timeout=60)
        finally:
            second.kill()
    finally:
        first.kill()
    assert first.returncode == second.returncode == 0
    assert json.loads(out_first) == json.loads(out_second) == list(range(7))  # the first one's arrays
    assert not os.path.exists(eager_ran)


def test_crash_mid_build_leaves_nothing_that_loads(tmp_path):
    cache = IndexCache(str(tmp_path / "c"))

    def exploding():
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        cache.get_or_build("GPTDataset", {"x": 1}, exploding)
    assert entries(str(tmp_path / "c")) == []
    arrays = cache.get_or_build("GPTDataset", {"x": 1}, lambda: {"a": numpy.arange(5)})
    numpy.testing.assert_array_equal(arrays["a"], numpy.arange(5))


def test_damaged_entry_is_named(tmp_path):
    cache = IndexCache(str(tmp_path / "c"))
    cache.get_or_build("GPTDataset", {"x": 1}, lambda: {"a": numpy.arange(5)})
    path = cache.entry_path("GPTDataset", {"x": 1})
    with open(os.path.join(path, "a.npy"), "r+b") as f:
        f.truncate(20)
    with pytest.raises(StatefulsetError, match=r"GPTDataset-.*damaged"):
        cache.get_or_build("GPTDataset", {"x": 1}, lambda: {"a": numpy.arange(5)})


# Opens a spec after giving up root (root writes through any permission bits): everything it needs
# is imported first, as root, so the unprivileged part only reads the shards and the cache.
AS_NOBODY = textwrap.dedent(
    """
    import json, os, sys
    import numpy
    from statefulset.streams.opening import open_stream
    spec = json.loads(sys.argv[1])
    os.setgid(65534)
    os.setuid(65534)
    assert not os.access(spec["path_to_cache"], os.W_OK)
    print(len(open_stream(spec)))
    """
)


def test_read_only_cache_folder_still_works(spec, tmp_path):
    expected = len(open_stream(spec))
    os.chmod(spec["path_to_cache"], 0o555)
    try:
        if os.geteuid() != 0:
            assert not os.access(spec["path_to_cache"], os.W_OK)
            assert len(open_stream(spec)) == expected
            return
        for folder in [tmp_path, *tmp_path.parents]:  # pytest's folders are 0700: let the reader in
            if folder == folder.parent or folder == Path(tempfile.gettempdir()):
                break
            os.chmod(folder, os.stat(folder).st_mode | 0o005)
        for root, _, files in os.walk(tmp_path):
            for name in files:
                os.chmod(os.path.join(root, name), 0o644)
        run = subprocess.run(
            [sys.executable, "-c", AS_NOBODY, json.dumps(spec)], capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stderr
        assert int(run.stdout) == expected
    finally:
        os.chmod(spec["path_to_cache"], 0o755)


# A builder whose numpy.save is wrapped so the test controls where it stops: after its first array
# it SIGKILLs itself ("kill"), or waits for a file to appear ("wait"), in the middle of a real store.
BUILDER = textwrap.dedent(
    """
    import os, signal, sys, time
    import numpy
    from statefulset.index.cache import IndexCache

    root, mode, go = sys.argv[1:4]
    real_save = numpy.save

    def save(f, array, **kwargs):
        real_save(f, array, **kwargs)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while not os.path.exists(go):
            time.sleep(0.02)

    numpy.save = save
    IndexCache(root).get_or_build("GPTDataset", {"x": 1}, lambda: {"a": numpy.arange(5), "b": numpy.arange(3)})
    """
)


def stale(root) -> list[str]:
    return [n for n in os.listdir(root) if n.startswith(".tmp-")]


def test_a_build_killed_mid_store_leaves_a_temporary_the_next_build_removes(tmp_path):
    root = str(tmp_path / "c")
    child = subprocess.run([sys.executable, "-c", BUILDER, root, "kill", ""], timeout=120)
    assert child.returncode == -9
    assert len(stale(root)) == 1 and [n for n in entries(root) if not n.startswith(".")] == []
    arrays = IndexCache(root).get_or_build("GPTDataset", {"x": 1}, lambda: {"a": numpy.arange(5)})
    numpy.testing.assert_array_equal(arrays["a"], numpy.arange(5))
    assert stale(root) == [] and [n.split("-")[0] for n in entries(root)] == ["GPTDataset"]


def test_a_live_builders_temporary_is_left_alone(tmp_path):
    import threading

    root, go = str(tmp_path / "c"), str(tmp_path / "go")
    child = subprocess.Popen([sys.executable, "-c", BUILDER, root, "wait", go])
    deadline = time.monotonic() + 60
    while not (os.path.isdir(root) and stale(root)):
        assert time.monotonic() < deadline and child.poll() is None, "the builder never started storing"
        time.sleep(0.05)
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(IndexCache(root).get_or_build("GPTDataset", {"x": 1}, dict)))
    thread.start()
    time.sleep(0.5)  # this process now waits for the builder's lock; it must not touch its temporary
    assert len(stale(root)) == 1 and thread.is_alive()
    open(go, "w").close()
    assert child.wait(timeout=60) == 0  # its rename found its folder intact
    thread.join(timeout=60)
    numpy.testing.assert_array_equal(got["a"], numpy.arange(5))  # loaded the child's entry, built nothing
    assert stale(root) == []


def test_waiting_for_a_stuck_builder_is_bounded_and_says_for_what(tmp_path, monkeypatch, caplog):
    import logging

    root, go = str(tmp_path / "c"), str(tmp_path / "go")
    child = subprocess.Popen([sys.executable, "-c", BUILDER, root, "wait", go])  # holds the entry's lock
    try:
        deadline = time.monotonic() + 60
        while not (os.path.isdir(root) and stale(root)):
            assert time.monotonic() < deadline and child.poll() is None, "the builder never started storing"
            time.sleep(0.05)
        monkeypatch.setenv("STATEFULSET_CACHE_WAIT", "1.5")
        start = time.monotonic()
        with caplog.at_level(logging.INFO, logger="statefulset"), pytest.raises(StatefulsetError) as caught:
            IndexCache(root).get_or_build("GPTDataset", {"x": 1}, dict)
        assert 1.5 <= time.monotonic() - start < 10
        entry = IndexCache(root).entry_path("GPTDataset", {"x": 1})
        assert str(caught.value).startswith(f"{entry}: waited 1.5 s for another process building this index")
        assert "STATEFULSET_CACHE_WAIT" in str(caught.value)
        assert f"waiting for another process building this index: {entry}" in caplog.text
        monkeypatch.setenv("STATEFULSET_CACHE_WAIT", "soon")
        with pytest.raises(StatefulsetError, match="STATEFULSET_CACHE_WAIT='soon': must be a positive number"):
            IndexCache(root).get_or_build("GPTDataset", {"x": 1}, dict)
    finally:
        open(go, "w").close()
        assert child.wait(timeout=60) == 0


def test_storing_an_entry_never_changes_the_process_umask(tmp_path, monkeypatch):
    """C8: the umask is the whole process's; setting it to 0 even for an instant made files that
    other threads created meanwhile world-writable. The entry still gets the modes of any folder
    and file the user makes. (Fails on 5cf6a81: _umask() called os.umask(0) then put it back.)"""
    calls = []
    real = os.umask

    def recording(mask):
        calls.append(mask)
        return real(mask)

    previous = real(0o027)
    try:
        monkeypatch.setattr(os, "umask", recording)
        arrays = {"a": numpy.arange(10, dtype=numpy.int64)}
        loaded = IndexCache(str(tmp_path)).get_or_build("Kind", {"x": 1}, lambda: arrays)
        numpy.testing.assert_array_equal(loaded["a"], arrays["a"])
    finally:
        real(previous)
    assert calls == []
    (entry,) = [p for p in tmp_path.iterdir() if p.name.startswith("Kind-") and p.is_dir()]
    assert entry.stat().st_mode & 0o777 == 0o750
    assert {p.stat().st_mode & 0o777 for p in entry.iterdir()} == {0o640}
