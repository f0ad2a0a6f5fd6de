"""Cold start at scale: prepare, facts every node trusts, shared work, lock-less filesystems.

Every "node" here is a fresh process with its own fresh home (XDG_CACHE_HOME), sharing one
``path_to_cache``, as nodes share a parallel filesystem.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import numpy
import pytest

from statefulset import IndexedDatasetWriter, StatefulsetError, open_stream
from statefulset.shards import facts, liveness, locks
from statefulset.tools.cli import main as cli
from statefulset.tools.prepare import prepare

NODE = textwrap.dedent(
    """
    import json, sys, time
    import numpy
    from statefulset.index import cache
    from statefulset.shards import facts
    from statefulset.streams.opening import open_stream
    start = float(sys.argv[2])
    while time.time() < start:  # start together
        time.sleep(0.001)
    stream = open_stream(sys.argv[1])
    rows = stream.gather(numpy.arange(5))
    print(json.dumps({"computed": facts.computed, "builds": cache.builds, "sum": int(rows.sum())}))
    """
)


def _settle(*prefixes) -> None:
    past = time.time() - 60
    for prefix in prefixes:
        for ext in (".idx", ".bin"):
            os.utime(f"{prefix}{ext}", (past, past))


@pytest.fixture
def corpus(tmp_path):
    rng = numpy.random.default_rng(3)
    prefixes = []
    for name in ("a", "b", "c"):
        prefix = tmp_path / "data" / name
        with IndexedDatasetWriter(prefix) as w:
            for _ in range(300):
                w.add_document(rng.integers(0, 50000, int(rng.geometric(1 / 50))))
        prefixes.append(str(prefix))
    _settle(*prefixes)
    return tmp_path, prefixes


def _spec_file(tmp_path, prefixes, packing: str) -> str:
    body = {
        "data_path": {p: w for p, w in zip(prefixes, (0.5, 0.3, 0.2), strict=True)},
        "seq_length": 32,
        "split": "90,10,0",
        "packing": packing,
        "num_samples": 2000 if packing == "megatron" else None,
        "path_to_cache": str(tmp_path / "shared-cache"),
    }
    path = tmp_path / f"{packing}.json.yaml"
    path.write_text(json.dumps({k: v for k, v in body.items() if v is not None}))
    return str(path)


def _nodes(spec: str, tmp_path, count: int, env: dict | None = None) -> list[dict]:
    start = time.time() + 2
    procs = []
    for i in range(count):
        home = tmp_path / f"home{i}-{time.monotonic_ns()}"
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", NODE, spec, str(start)],
                env={**os.environ, "XDG_CACHE_HOME": str(home), **(env or {})},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.parametrize("packing", ["native", "megatron"])
def test_after_prepare_a_new_node_recomputes_nothing(corpus, packing, capsys):
    tmp_path, prefixes = corpus
    spec = _spec_file(tmp_path, prefixes, packing)
    first = prepare(spec, show_progress=False)
    assert first.shards == 3 and first.checked == 3 and first.digested == 3
    assert prepare(spec, show_progress=False).checked == 0  # safe to run twice: everything known
    assert cli(["prepare", spec, "--quiet", "--jobs", "2"]) == 0
    assert "0 checked in full, 0 hashed" in capsys.readouterr().out
    (node,) = _nodes(spec, tmp_path, 1)
    assert node["computed"] == {} and node["builds"] == {}


def test_a_changed_shard_is_checked_again_after_prepare(corpus, caplog):
    tmp_path, prefixes = corpus
    spec = _spec_file(tmp_path, prefixes, "native")
    prepare(spec, show_progress=False)
    with IndexedDatasetWriter(prefixes[1]) as w:  # rewritten: new content, new mtime
        w.add_document([1, 2, 3] * 40)
    _settle(prefixes[1])
    (node,) = _nodes(spec, tmp_path, 1)
    assert node["computed"] == {"verified": 1, "digest": 1}  # only the changed shard


@pytest.mark.parametrize("lock", ["flock", "file"])
def test_concurrent_unprepared_opens_do_each_piece_of_work_once(corpus, lock):
    tmp_path, prefixes = corpus
    spec = _spec_file(tmp_path, prefixes, "megatron")
    env = {"STATEFULSET_LOCK": "file"} if lock == "file" else {}
    nodes = _nodes(spec, tmp_path, 4, env)
    assert len({n["sum"] for n in nodes}) == 1
    total = {k: sum(n["computed"].get(k, 0) for n in nodes) for k in ("verified", "digest")}
    assert total == {"verified": 3, "digest": 3}
    builds = {k: sum(n["builds"].get(k, 0) for n in nodes) for k in ("GPTDataset", "BlendedDataset")}
    assert builds == {"GPTDataset": 3, "BlendedDataset": 1}


def test_a_fact_is_recorded_for_the_version_read(corpus):
    tmp_path, prefixes = corpus
    path = prefixes[0] + ".idx"
    memo = str(tmp_path / "memo")

    def replace_while_checking():
        os.utime(path, (time.time() - 30, time.time() - 30))  # the file changes under the check
        return "checked"

    assert facts.once("probe", (path,), replace_while_checking, "probing", memo) == "checked"
    assert facts.recall("probe", path, directory=memo) is None  # not trusted for the new version
    assert facts.once("probe", (path,), lambda: "again", "probing", memo) == "again"
    assert facts.recall("probe", path, directory=memo) == "again"


def test_facts_ignore_the_device_number(corpus):
    _, prefixes = corpus
    token = facts.file_token(prefixes[0] + ".idx")
    st = os.stat(prefixes[0] + ".idx")
    assert token[1] == f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def test_a_damaged_fact_file_is_recomputed(corpus, caplog):
    tmp_path, prefixes = corpus
    spec = _spec_file(tmp_path, prefixes, "native")
    prepare(spec, show_progress=False)
    folder = tmp_path / "shared-cache" / "facts"
    for name in os.listdir(folder):
        if name.endswith(".json"):
            (folder / name).write_text("{not json")
    facts._in_process.clear()
    before = dict(facts.computed)
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        open_stream(spec)
    assert facts.computed["verified"] - before.get("verified", 0) == 3
    assert "ignoring the damaged fact file" in caplog.text and str(folder) in caplog.text


def test_corrupted_prepared_index_names_the_file(corpus):
    tmp_path, prefixes = corpus
    spec = _spec_file(tmp_path, prefixes, "megatron")
    prepare(spec, show_progress=False)
    cache = tmp_path / "shared-cache"
    entry = next(p for p in sorted(cache.iterdir()) if p.name.startswith("GPTDataset"))
    victim = next(p for p in entry.iterdir() if p.suffix == ".npy")
    victim.write_bytes(b"garbage")
    with pytest.raises(StatefulsetError, match=str(entry)):
        open_stream(spec)


class TestLockFile:
    def test_waiters_take_turns(self, tmp_path, monkeypatch):
        monkeypatch.setenv("STATEFULSET_LOCK", "file")
        lock = str(tmp_path / "x.lock")
        with locks.exclusive(lock, "x", "probing") as held:
            assert held and os.path.exists(lock + ".held")
        assert not os.path.exists(lock + ".held")

    def test_a_dead_holder_on_this_host_is_taken_over(self, tmp_path, monkeypatch):
        monkeypatch.setenv("STATEFULSET_LOCK", "file")
        lock = str(tmp_path / "x.lock")
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        with open(lock + ".held", "w") as f:
            json.dump({"node": liveness.node(), "pid": int(dead.stdout), "start": 1}, f)
        with locks.exclusive(lock, "x", "probing") as held:
            assert held

    def test_a_silent_holder_on_another_host_is_taken_over(self, tmp_path, monkeypatch, caplog):
        monkeypatch.setenv("STATEFULSET_LOCK", "file")
        lock = str(tmp_path / "x.lock")
        with open(lock + ".held", "w") as f:
            json.dump({"host": "elsewhere", "pid": 1}, f)
        old = time.time() - locks.STALE_S - 5
        os.utime(lock + ".held", (old, old))
        with caplog.at_level(logging.WARNING, logger="statefulset"), locks.exclusive(lock, "x", "probing") as held:
            assert held
        assert "removed the stale lock" in caplog.text

    def test_a_live_holder_bounds_the_wait(self, tmp_path, monkeypatch):
        monkeypatch.setenv("STATEFULSET_LOCK", "file")
        monkeypatch.setenv("STATEFULSET_CACHE_WAIT", "1")
        lock = str(tmp_path / "x.lock")
        with open(lock + ".held", "w") as f:
            json.dump({"host": "elsewhere", "pid": 1}, f)  # fresh heartbeat: alive
        with (
            pytest.raises(StatefulsetError, match=r"^subject: waited 1 s for another process probing"),
            locks.exclusive(lock, "subject", "probing"),
        ):
            pass


def test_opening_a_spec_never_imports_torch(corpus):
    """What six concurrent opens each did alone was importing torch (benchmarks/bench_concurrent_open.py):
    opening a spec, prepare and inspect need none of it; the loaders import it on first use."""
    tmp_path, prefixes = corpus
    spec = _spec_file(tmp_path, prefixes, "native")
    code = textwrap.dedent(
        """
        import sys
        import statefulset
        from statefulset.streams.opening import open_stream
        from statefulset.tools import cli, prepare
        open_stream(sys.argv[1]).gather([0, 1])
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))[:5]
        statefulset.get_savable_loader
        assert "torch" in sys.modules
        """
    )
    run = subprocess.run([sys.executable, "-c", code, spec], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
