"""Install what the tests need into the environment of the Python that runs this script.

The README's test command and .ci/run both run it:

    python3 -m venv .venv && .venv/bin/python tests/install.py && .venv/bin/python -m pytest -q --no-skips

1. torch (the pin picks the CPU wheel this project's machines carry; any torch >= 2.1 works) and the
   project, editable, with its ``test`` extra;
2. the oracle of the exactness tests, pyproject's ``oracle`` extra (megatron-core 0.19.2 and
   triton, which its package import needs). megatron-core declares Python >= 3.12 yet its dataset
   code runs on 3.10 and 3.11, so it goes in with pip's ``--ignore-requires-python --no-deps``;
   its own dependencies (torch, numpy, packaging) came with step 1;
3. torchtitan 0.3.0 and datasets 4.7.0, pyproject's ``titan-test`` extra, with ``--no-deps``: their
   declared pins would move fsspec and s3fs back and make pip backtrack for tens of minutes; the
   dependencies their imported modules need are in the test extra (step 1).

A failed step stops the script with pip's exit status.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"
PIP = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]


def extra_requirements(name: str) -> list[str]:
    """The extra ``name`` of pyproject.toml (one line, as written there)."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(rf"^{re.escape(name)} = \[(.*)\]$", text, re.MULTILINE)
    if match is None:
        raise SystemExit(f"tests/install.py: pyproject.toml has no one-line `{name} = [...]` extra")
    return re.findall(r'"([^"]+)"', match.group(1))


def oracle_requirements() -> list[str]:
    """The ``oracle`` extra of pyproject.toml."""
    return extra_requirements("oracle")


def steps() -> list[list[str]]:
    return [
        [*PIP, TORCH, "-e", ".[test]"],
        [*PIP, "--ignore-requires-python", "--no-deps", *oracle_requirements()],
        [*PIP, "--no-deps", *extra_requirements("titan-test")],
    ]


def main() -> int:
    for command in steps():
        print("+", " ".join(command[1:]), flush=True)
        done = subprocess.run(command, cwd=ROOT, check=False)
        if done.returncode != 0:
            print(f"tests/install.py: pip failed with exit status {done.returncode}", file=sys.stderr)
            return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
