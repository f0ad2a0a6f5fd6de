"""``statefulset preprocess --executor ray``: a real local Ray; the bytes of ``--workers N``; resumable; never mixed.

Kept short (each run starts a local Ray, ~5 s): one byte-identity run over every input kind, one
SIGKILL-and-resume run, one refused rerun.
"""

from __future__ import annotations

import filecmp
import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from statefulset import StatefulsetError
from statefulset.tools.preprocess import preprocess

ray = pytest.importorskip("ray")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _rows(n: int, seed: int) -> list[dict]:
    r = random.Random(seed)
    return [{"text": "".join(r.choice("abc déf\n") for _ in range(r.randint(0, 400))), "title": f"t{i}"}
            for i in range(n)]  # fmt: skip


def _same(a: str, b: str) -> bool:
    return all(filecmp.cmp(a + e, b + e, shallow=False) for e in (".bin", ".idx"))


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "statefulset", "preprocess", *args], capture_output=True,
                          text=True, timeout=600, env=env, **kw)  # fmt: skip


def test_ray_writes_the_bytes_of_local_workers(tmp_path):
    rows = _rows(3000, 0)
    with open(tmp_path / "a.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[:1000])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[1000:2000])
    pq.write_table(pa.Table.from_pylist(rows[2000:]), tmp_path / "c.parquet", row_group_size=150)
    inputs = [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl.gz", "c.parquet")]
    run = _cli("--input", *inputs, "--output-prefix", str(tmp_path / "ray"), "--json-keys", "text", "title",
               "--executor", "ray", "--task-bytes", "40000", "--chunk-bytes", "16384", "--append-eod",
               "--quiet")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "3,000 documents" in run.stdout
    assert "largest task memory:" in run.stdout and "MiB (peak RSS of a Ray worker)" in run.stdout
    for workers in (1, 2):
        preprocess(inputs, str(tmp_path / f"w{workers}"), json_keys=("text", "title"), workers=workers,
                   append_eod=True, show_progress=False)  # fmt: skip
        for key in ("text", "title"):
            assert _same(str(tmp_path / f"ray_{key}_document"), str(tmp_path / f"w{workers}_{key}_document"))
    assert not (tmp_path / "ray.parts").exists()


def test_a_killed_run_resumes_with_only_the_unfinished_tasks_and_a_changed_rerun_is_refused(tmp_path):
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in _rows(6000, 1))
    args = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out"), "--executor", "ray",
            "--task-bytes", "50000", "--chunk-bytes", "16384"]  # fmt: skip
    gate = tmp_path / "gate"
    gate.write_text("3")  # tasks 0-2 commit; every later task waits at the gate, so the kill lands mid-run
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "STATEFULSET_TEST_GATE": str(gate)}
    proc = subprocess.Popen([sys.executable, "-m", "statefulset", "preprocess", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)  # fmt: skip
    parts = tmp_path / "out.parts"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if parts.exists() and sum(n.endswith(".done") for n in os.listdir(parts)) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1]  # held at the gate: it cannot have finished
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its local Ray, as a lost node would
    proc.wait()
    committed = sum(n.endswith(".done") for n in os.listdir(parts))
    assert committed >= 3
    # Another chunk size is another plan: refused, naming it, the parts kept.
    changed = _cli(*args[:-1], "32768")
    assert changed.returncode != 0 and "holds the parts of a run with other chunk_bytes" in changed.stderr
    again = _cli(*args)
    assert again.returncode == 0, again.stderr
    kept = int(again.stdout.split("resumed: kept ")[1].split()[0])
    assert kept >= committed
    preprocess([str(tmp_path / "in.jsonl")], str(tmp_path / "local"), show_progress=False)
    assert _same(str(tmp_path / "out_text_document"), str(tmp_path / "local_text_document"))


def test_a_bad_line_is_named_by_file_and_line_across_tasks(tmp_path):
    rows = [json.dumps(r) for r in _rows(400, 2)]
    rows[333] = "{not json"
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n")
    from statefulset.tools.part_tasks import preprocess_ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with pytest.raises(StatefulsetError, match=r"in.jsonl:334: invalid JSON"):
        preprocess_ray([str(tmp_path / "in.jsonl")], str(tmp_path / "out"), task_bytes=20000, chunk_bytes=4096,
                       show_progress=False)  # fmt: skip


def test_a_second_run_in_the_same_driver_uses_its_own_settings(tmp_path):
    """On 5cf6a81 Ray's reused worker processes kept the first run's setup: a run without EOD, then one
    with --append-eod in the same driver, wrote the second without its EOD tokens and no error."""
    from statefulset.tools.part_tasks import preprocess_ray

    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in _rows(300, 4))
    source = [str(tmp_path / "in.jsonl")]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:  # one worker process, already set up by the first run, serves the second
        preprocess_ray(source, str(tmp_path / "plain"), task_bytes=20000, show_progress=False)
        preprocess_ray(source, str(tmp_path / "eod"), task_bytes=20000, append_eod=True, show_progress=False)
    finally:
        ray.shutdown()
    for name, eod in (("plain", False), ("eod", True)):
        preprocess(source, str(tmp_path / f"local_{name}"), append_eod=eod, show_progress=False)
        assert _same(str(tmp_path / f"{name}_text_document"), str(tmp_path / f"local_{name}_text_document"))
