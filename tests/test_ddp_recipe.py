"""The plain DDP recipe (examples/ddp_checkpoint_resume.py, docs/ddp.md) as a job runs it: torchrun.

Two ranks on gloo, two DataLoader workers each: a run that checkpoints at step 4 and is SIGKILLed
after step 6, then the same command again, which resumes. Every step of both runs must hold the
samples the layout puts there, ``(t·W + r)·B + j`` for step t+1 on rank r, so the resumed run's
first batch is exactly the one after the checkpoint (steps 5 and 6 are done again, nothing is
skipped), and the resumed run ends with a checkpoint at step 8.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from statefulset.tools.demo import demo_spec

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "ddp_checkpoint_resume.py"
WORLD, BATCH = 2, 4


def _torchrun(logs: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
               "--log-dir", str(logs),
               str(SCRIPT), *args]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks with it
        proc.communicate()
        pytest.fail(f"torchrun {' '.join(args[-4:])}: still running after 600 s")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _expected(step: int, rank: int) -> list[int]:
    t = step - 1
    return [(t * WORLD + rank) * BATCH + j for j in range(BATCH)]


def test_a_killed_torchrun_job_resumes_on_the_next_sample(tmp_path):
    spec = demo_spec(str(tmp_path / "corpus"), documents=600)
    common = ["--spec", spec, "--checkpoint", str(tmp_path / "ckpt"), "--steps", "8", "--save-every", "4"]
    crashed = _torchrun(tmp_path / "logs", *common, "--record", str(tmp_path / "crashed.jsonl"), "--crash-after", "6")
    assert crashed.returncode != 0, crashed.stderr[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_4"
    resumed = _torchrun(tmp_path / "logs", *common, "--record", str(tmp_path / "resumed.jsonl"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for name, steps in (("crashed", range(1, 7)), ("resumed", range(5, 9))):
        records = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        got = {(r["step"], r["rank"]): r["samples"] for r in records}
        assert got == {(s, r): _expected(s, r) for s in steps for r in range(WORLD)}, name
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_8"
    saved = torch.load(tmp_path / "ckpt" / "step_8" / "loader_rank1.pt")
    assert saved["dp_rank"] == 1 and saved["base"] + saved["batches"] * WORLD * BATCH == 8 * WORLD * BATCH
