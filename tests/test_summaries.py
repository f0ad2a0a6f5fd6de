"""What the command line reports, honestly: schedules in inspect, split sizes in prepare, a cut-off pipe.

Each case here mislabelled or crashed on main (issue 25, item 5): inspect hid a schedule's stages
and called its sources unweighted, prepare called a bestfit or one-pass validation split
"unbounded (native)", inspect said a native spec's cache was "not used" while writing facts there,
and ``explain ... | head`` ended with a BrokenPipeError traceback.
"""

from __future__ import annotations

import subprocess
import sys

import numpy
import pytest
import yaml
from corpora import write_sources


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("summaries")

    def document(rng, s, d):  # tokens that name their source and document
        return s * 10**6 + d * 100 + numpy.arange(int(rng.integers(4, 60)))

    return root, write_sources(root, {"web": 200, "code": 200}, seed=2, document=document, dtype=numpy.int32)


def _write(root, name, spec):
    path = root / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "statefulset", *args], capture_output=True, text=True, timeout=timeout)


def test_inspect_shows_a_schedules_stages_and_weights(corpus):
    root, (web, code) = corpus
    spec = _write(root, "staged.yaml", {
        "seq_length": 16, "split": "90,10,0", "packing": "native", "path_to_cache": str(root / "cache"),
        "stages": [{"start": 0, "data_path": {web: 0.9, code: 0.1}},
                   {"start": 500, "data_path": {web: 0.25, code: 0.75}}],
    })  # fmt: skip
    run = _cli("inspect", spec)
    assert run.returncode == 0, run.stderr
    assert f"stage 0 (from 0 until 500): {web} 0.9000, {code} 0.1000" in run.stdout
    assert f"stage 1 (from 500 on): {web} 0.2500, {code} 0.7500" in run.stdout
    train = run.stdout.split("valid:")[0]
    assert "no weight (blended by size)" not in train and "weights by stage (above)" in train
    assert "cache: not used" not in run.stdout
    assert f"cache: {root / 'cache'} (facts about shard versions only" in run.stdout


@pytest.mark.parametrize("packing", ["native", "bestfit"])
def test_prepare_names_the_packing_and_counts_a_one_pass_split(corpus, packing):
    root, (web, code) = corpus
    cache = str(root / f"cache-{packing}")
    spec = _write(root, f"{packing}.yaml", {"seq_length": 16, "split": "90,10,0", "packing": packing,
                                           "path_to_cache": cache, "data_path": [web, code]})  # fmt: skip
    run = _cli("prepare", spec, "--quiet")
    assert run.returncode == 0, run.stderr
    assert f"unbounded (packing {packing})" in run.stdout
    assert "unbounded (native)" not in run.stdout


def test_explain_into_a_closed_pipe_ends_quietly(corpus):
    root, (web, _) = corpus
    spec = _write(root, "plain.yaml", {"seq_length": 16, "split": "1", "packing": "native", "data_path": web})
    explain = subprocess.Popen(
        [sys.executable, "-m", "statefulset", "explain", spec, "--position", *map(str, range(3000)),
         "--tokenizer", "bytes"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    explain.stdout.readline()  # like `| head -1`: read a line, then go away
    explain.stdout.close()
    _, err = explain.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    assert explain.returncode in (0, 141)
