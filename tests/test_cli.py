"""The statefulset command end to end, as a user runs it (real subprocesses, real files)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from statefulset import IndexedDataset
from statefulset.tools.demo import run_demo


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "statefulset", *map(str, args)], capture_output=True, text=True, cwd=cwd
    )


def test_preprocess_merge_inspect(tmp_path):
    for part in (1, 2, 10):
        lines = "".join(json.dumps({"text": f"part {part} doc {i}"}) + "\n" for i in range(50))
        (tmp_path / f"part_{part}.jsonl").write_text(lines)
        prefix = tmp_path / "shards" / f"part_{part}"
        source = tmp_path / f"part_{part}.jsonl"
        run = cli("preprocess", "--input", source, "--output-prefix", prefix, "--append-eod", "--workers", "2")
        assert run.returncode == 0, run.stderr
        assert "50 documents" in run.stdout and "docs/s" in run.stderr  # the progress bar
    run = cli("merge", "--input", tmp_path / "shards", "--output-prefix", tmp_path / "all")
    assert run.returncode == 0, run.stderr
    merged = IndexedDataset(tmp_path / "all")
    assert len(merged) == 150
    assert bytes(merged[50][:6].astype("uint8")) == b"part 2"  # natural order: 1, 2, 10
    run = cli("inspect", tmp_path / "all", "--json", "--vocab-size", 257)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["valid"] and report["documents"] == 150 and report["dtype"] == "uint16"
    assert report["sequence_length_percentiles"]["max"] == len("part 10 doc 49") + 1
    run = cli("inspect", tmp_path / "all")
    assert "valid: yes" in run.stdout and "p50=" in run.stdout


def test_errors_are_one_line_with_exit_code(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    run = cli("preprocess", "--input", tmp_path / "bad.jsonl", "--output-prefix", tmp_path / "o", "--quiet")
    assert run.returncode == 2
    assert "bad.jsonl:2: invalid JSON" in run.stderr and "Traceback" not in run.stderr
    run = cli("merge", "--input", tmp_path / "nothing", "--output-prefix", tmp_path / "o")
    assert run.returncode == 2 and "neither a folder of shards nor a prefix" in run.stderr
    # Options of the other executor are refused rather than ignored.
    source = ["preprocess", "--input", tmp_path / "bad.jsonl", "--output-prefix", tmp_path / "o"]
    run = cli(*source, "--executor", "ray", "--workers", "4")
    assert run.returncode == 2 and "--workers applies to --executor local" in run.stderr
    run = cli(*source, "--task-bytes", "1000")
    assert run.returncode == 2 and "--task-bytes and --ray-address apply to --executor ray" in run.stderr


def test_inspect_reports_a_corrupt_shard(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "abc"}\n')
    assert (
        cli("preprocess", "--input", tmp_path / "c.jsonl", "--output-prefix", tmp_path / "c", "--quiet").returncode == 0
    )
    idx = tmp_path / "c_text_document.idx"
    idx.write_bytes(idx.read_bytes()[:-1])
    run = cli("inspect", tmp_path / "c_text_document")
    assert run.returncode == 1 and "INVALID" in run.stdout and "c_text_document.idx" in run.stdout
    run = cli("inspect", tmp_path / "c_text_document", "--vocab-size", 50)
    assert run.returncode == 1


def test_demo_in_process(tmp_path):
    lines: list[str] = []
    assert run_demo(str(tmp_path / "demo"), documents=300, say=lines.append)
    assert lines[-1].startswith("demo: PASS")


@pytest.mark.parametrize("args", [["demo", "--documents", "200"]])
def test_demo_command(tmp_path, args):
    run = cli(*args, "--dir", tmp_path / "d")
    assert run.returncode == 0, run.stderr
    assert "demo: PASS" in run.stdout
