"""``--executor ray --ray-address``: a real two-node Ray cluster (tests/ray_cluster.py), and a node lost mid-run.

The driver connects to the cluster instead of starting Ray; tasks run on both nodes (the summary
counts them); a node killed while tasks run on it costs retries, not data: the output is the
bytes of a one-process run.
"""

from __future__ import annotations

import filecmp
import json
import os
import random
import subprocess
import sys
import time

import pytest
from ray_cluster import two_nodes

from statefulset.tools.preprocess import preprocess

pytest.importorskip("ray")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _corpus(path, n: int, seed: int) -> None:
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": "".join(r.choices("abc déf ", k=r.randint(0, 600)))}) + "\n")


def _same(a: str, b: str) -> bool:
    return all(filecmp.cmp(a + e, b + e, shallow=False) for e in (".bin", ".idx"))


def _command(tmp_path, address: str, name: str) -> list[str]:
    return [sys.executable, "-m", "statefulset", "preprocess", "--input", str(tmp_path / "in.jsonl"),
            "--output-prefix", str(tmp_path / name), "--append-eod", "--executor", "ray", "--ray-address", address,
            "--task-bytes", "30000", "--chunk-bytes", "8192"]  # fmt: skip


def test_a_two_node_cluster_writes_the_bytes_of_one_process_and_survives_a_lost_node(tmp_path, monkeypatch):
    _corpus(tmp_path / "in.jsonl", 8000, 3)
    preprocess([str(tmp_path / "in.jsonl")], str(tmp_path / "ref"), append_eod=True, show_progress=False)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    gate = tmp_path / "gate"  # the nodes' workers read it; absent, nothing waits
    monkeypatch.setenv("STATEFULSET_TEST_GATE", str(gate))
    with two_nodes() as cluster:
        run = subprocess.run(_command(tmp_path, cluster.address, "both"), capture_output=True, text=True,
                             timeout=600, env=env)  # fmt: skip
        assert run.returncode == 0, run.stderr
        assert "8,000 documents" in run.stdout
        assert "tasks of this run ran on 2 Ray nodes" in run.stdout
        assert _same(str(tmp_path / "both_text_document"), str(tmp_path / "ref_text_document"))

        # The second node dies while the tasks run: its tasks are retried on the head node. Tasks from
        # number 2 on wait at the gate, so the node is lost mid-run, with tasks on it.
        gate.write_text("2")
        proc = subprocess.Popen(_command(tmp_path, cluster.address, "lost"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
        parts = tmp_path / "lost.parts"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if parts.exists() and sum(n.endswith(".done") for n in os.listdir(parts)) >= 2:
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()[1]  # held at the gate: it cannot have finished
        cluster.remove_second_node()
        gate.unlink()
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        assert "8,000 documents" in out
        assert _same(str(tmp_path / "lost_text_document"), str(tmp_path / "ref_text_document"))
