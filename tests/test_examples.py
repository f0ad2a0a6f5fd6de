"""Every script in examples/ runs with no arguments, and leaves no temporary folder behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script, tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    # torch keeps its compile cache in $TMPDIR/torchinductor_<user>: torch's, not the example's.
    left = sorted(p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_"))
    assert left == [], "the example left temporary files behind"
