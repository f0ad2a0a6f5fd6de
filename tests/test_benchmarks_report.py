"""The benchmark figures in the docs come from committed results files, stamped with their provenance (issue 26).

No timing here: these check the plumbing. docs/benchmarks.md is what ``benchmarks/report.py``
makes of ``benchmarks/results/`` (as test_layout.py checks docs/settings.md), every benchmark
script is in ``run_all.py``'s list and accepts its quick arguments, and a results file written
through ``provenance.write_results`` names its commit, machine and versions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
# benchmarks/ goes on the path only while this file imports and runs: it holds a campaign.py that
# shadows tests/campaign for every later test, and for the worker processes they start (a forkserver
# started later copies the path it finds: test_campaign's short form then failed in a full run).
_PATH = list(sys.path)
sys.path.insert(0, str(BENCH))

import provenance  # noqa: E402
import report  # noqa: E402
import run_all  # noqa: E402

sys.path[:] = _PATH


@pytest.fixture(autouse=True)
def _benchmarks_on_the_path():
    before = list(sys.path)
    sys.path.insert(0, str(BENCH))
    yield
    sys.path[:] = before
    for name, module in list(sys.modules.items()):  # a benchmarks/ module must not stand for a tests/ one
        if name == "campaign" and str(getattr(module, "__file__", "")).startswith(str(BENCH)):
            del sys.modules[name]


def test_docs_benchmarks_is_generated_from_the_results():
    for page in report.PAGES:
        text = Path(page).read_text(encoding="utf-8")
        assert report.render(text) == text, f"{page} is stale: run python benchmarks/report.py"


def test_every_results_file_is_named_in_the_docs():
    pages = "".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    for path in sorted((BENCH / "results").glob("*.json")):
        assert path.name in pages, f"{path.name}: no page of docs/ names it (add it where its figures are quoted)"


def test_machine_lines_come_from_the_files():
    """The review's H3: a section said AMD EPYC while its file said Intel Xeon; now the line is the file's."""
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    for match in report.BLOCK.finditer(page):
        words = match.group(2).split()
        if words[0] == "machine":
            record = report.load(words[1])
            if record is not None and "environment" in record:
                assert str(record["environment"]["cpu"]) in match.group(3), words[1]


def test_write_results_stamps_one_run(tmp_path):
    path = provenance.write_results("x", {"rows": {"a": 1}, "provenance": "ignored"}, extra=("numpy",),
                                    path=str(tmp_path / "x.json"))  # fmt: skip
    record = json.loads(Path(path).read_text())
    prov = record["provenance"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert prov["git"]["commit"] == head.strip()
    assert isinstance(prov["git"]["dirty"], bool)
    assert prov["machine"]["cores"] == os.cpu_count() and prov["machine"]["cpu"]
    assert prov["versions"]["python"] and "numpy" in prov["versions"]
    assert prov["date"].endswith("+00:00")
    assert record["rows"] == {"a": 1}
    provenance.write_results("x", {"rows": {"b": 2}}, path=path)
    assert json.loads(Path(path).read_text())["rows"] == {"b": 2}  # replaced, never merged into
    assert "Code: commit" in provenance.machine_line(record)


def test_dirty_files_are_named_whole(tmp_path, monkeypatch):
    """The first changed path keeps its first letter (git's porcelain lines start with a space)."""

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    for name in ("benchmarks.py", "other.py"):
        (tmp_path / name).write_text("a\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    for name in ("benchmarks.py", "other.py"):
        (tmp_path / name).write_text("b\n")
    monkeypatch.setattr(provenance, "ROOT", str(tmp_path))
    found = provenance.git()
    assert found["dirty"] and found["dirty_files"] == ["benchmarks.py", "other.py"]


def test_alternate_runs_in_turn_and_needs_three_runs():
    order: list[str] = []
    got = provenance.alternate({"a": lambda: order.append("a") or 1.0, "b": lambda: order.append("b") or 2.0})
    assert order == ["a", "b"] * 3
    assert got["b"]["median"] == 2.0 and got["a"]["runs"] == [1.0, 1.0, 1.0]
    assert provenance.ratio(got["b"], got["a"])["median"] == 2.0
    with pytest.raises(ValueError, match="at least 3"):
        provenance.alternate({"a": lambda: 1.0}, runs=2)


def test_every_benchmark_script_is_in_run_all():
    unlisted = sorted(set(run_all.listed()) - set(run_all.SCRIPTS))
    assert not unlisted, f"add to benchmarks/run_all.py SCRIPTS with their quick arguments: {unlisted}"
    others = {p.name for p in BENCH.glob("*.py")} - set(run_all.SCRIPTS) - run_all.NOT_SCRIPTS
    assert not others, f"benchmarks/ modules neither a script nor a helper in run_all.py: {sorted(others)}"


PARSE_ONLY = """
import argparse, json, runpy, sys, traceback
class Parsed(Exception):
    pass
real = argparse.ArgumentParser.parse_args
def parse(self, args=None, namespace=None):
    real(self, args, namespace)
    raise Parsed
argparse.ArgumentParser.parse_args = parse
sys.path.insert(0, BENCH)
failed = {}
for script, quick in SCRIPTS.items():
    sys.argv = [BENCH + "/" + script, *quick]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        failed[script] = "ran past its argument parsing"
    except Parsed:
        pass
    except SystemExit as e:
        failed[script] = f"exit {e.code}"
    except BaseException:
        failed[script] = traceback.format_exc()[-2000:]
print(json.dumps(failed))
"""


def test_quick_arguments_parse():
    """Each script's quick arguments are accepted (argparse exits 2 on an unknown one); nothing runs.

    The quick runs themselves take minutes on 2 shared cores, so CI checks their arguments (in one
    process, each script run up to its ``parse_args``) and ``python benchmarks/run_all.py --quick``
    runs them (docs/reading-benchmarks.md).
    """
    code = f"BENCH = {str(BENCH)!r}\nSCRIPTS = {run_all.SCRIPTS!r}\n" + PARSE_ONLY
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failed, failed


def test_earlier_results_do_not_make_a_run_dirty(tmp_path, monkeypatch):
    """A results file or a generated doc changed by an earlier run is not code the next run measures."""

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    outputs = (tmp_path / "benchmarks" / "results" / "bench_x.json", tmp_path / "docs" / "benchmarks.md")
    for path in (*outputs, tmp_path / "statefulset.py"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("a\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    for path in outputs:
        path.write_text("b\n")
    monkeypatch.setattr(provenance, "ROOT", str(tmp_path))
    found = provenance.git()
    assert not found["dirty"] and found["dirty_files"] == ["benchmarks/results/bench_x.json", "docs/benchmarks.md"]
    (tmp_path / "statefulset.py").write_text("b\n")
    assert provenance.git()["dirty"]


def test_an_older_results_file_shows_its_load():
    """Files from before the stamp kept the load average at their top level; the machine line says it."""
    env = {"vcpus": 2, "cpu": "X", "ram_gib": 1, "kernel": "k", "python": "3", "numpy": "2", "torch": "t",
           "statefulset": "s"}  # fmt: skip
    line = provenance.machine_line({"environment": env, "git": {"head": "abcdef0123"}, "load": [17.5, 9.0, 3.0]})
    assert "commit `abcdef0`" in line and "load average 17.5 at the end of the run" in line
    assert "load average" not in provenance.machine_line({"environment": env})


def test_every_generator_feeds_a_page():
    """A table moved from hand-written to generated (issue 26) stays generated: each generator has a block."""
    used = {m.group(2).split()[0] for page in report.PAGES for m in report.BLOCK.finditer(Path(page).read_text())}
    assert set(report.GENERATORS) <= used, sorted(set(report.GENERATORS) - used)


def test_the_metrics_table_shows_the_paired_ratio_of_reading_every_10th_step():
    """bench_metrics.py records it beside the every-step one (issue 29: a logger at log_interval 10);
    a results file from before it says it was not measured."""
    import copy

    import report_tables

    record = report.load("bench_metrics")
    assert record is not None
    new = copy.deepcopy(record)
    for r in new["sizes"].values():
        r.pop("paired_ratio_every_10", None)
    old = report_tables.metrics.__wrapped__(new)
    assert "every 10th ÷ never, paired" in old and old.count("| not measured |") == len(new["sizes"])
    first = next(iter(new["sizes"].values()))
    first["paired_ratio_every_10"] = {"median": 0.987, "min": 0.981, "max": 0.994}
    table = report_tables.metrics.__wrapped__(new)
    row = next(line for line in table.splitlines() if line.startswith(f"| {next(iter(new['sizes']))} |"))
    assert row.endswith("| 0.99 (0.98–0.99) |"), row


def test_the_metrics_table_shows_the_cpu_time_of_the_paired_blocks():
    """bench_metrics.py records the paired blocks' CPU time (trainer; trainer + workers) for reading every
    step, every 10th and counting on against off (issue 29's 1%: the wall clock's spread cannot show it);
    a results file from before it says it was not measured."""
    import copy

    import report_tables

    record = report.load("bench_metrics")
    assert record is not None
    new = copy.deepcopy(record)
    for r in new["sizes"].values():
        r.pop("paired", None)
        r.pop("accounted", None)  # the committed run has the reads in the loop too: this file is one without
    assert "CPU time of the paired blocks: not measured" in report_tables.metrics.__wrapped__(new)

    def figures(trainer: float, total: float) -> dict:
        one = {"median": 1.0, "min": 1.0, "max": 1.0}
        return {"wall": one, "trainer_cpu": {"median": trainer, "min": trainer - 0.001, "max": trainer + 0.002},
                "total_cpu": {"median": total, "min": total, "max": total},
                "off_trainer_cpu_us_per_batch": {"median": 40.0, "min": 39.5, "max": 41.0},
                "off_total_cpu_us_per_batch": {"median": 90.0, "min": 88.0, "max": 93.0}}  # fmt: skip

    for r in new["sizes"].values():
        r["paired"] = {"read_every_step": figures(0.95, 0.975), "read_every_10_steps": figures(0.995, 0.998),
                       "counting": figures(0.999, 1.0)}  # fmt: skip
    table = report_tables.metrics.__wrapped__(new)
    row = next(line for line in table.splitlines() if line.startswith(f"| {next(iter(new['sizes']))} | 40.0"))
    assert row == (
        "| 8 x 129 | 40.0 (39.5–41.0) / 90.0 (88.0–93.0) | 0.950 (0.949–0.952) / 0.975 (0.975–0.975) "
        "| 0.995 (0.994–0.997) / 0.998 (0.998–0.998) | 0.999 (0.998–1.001) / 1.000 (1.000–1.000) |"
    ), row
    assert "Accounted" not in table  # a file with the paired blocks' CPU time but not the reads in the loop

    new["call_us"]["counting_ns"] = {"median": 150.0, "min": 149.0, "max": 160.0}
    for r in new["sizes"].values():
        r["read_in_loop_us"] = {
            f"every_{n}_steps": {"median": v, "min": v, "max": v} for n, v in ((1, 2), (10, 4), (100, 5))
        }
        r["accounted"] = {f"read_every_{n}_steps": {"trainer": 40 / (40 + v / n), "total": 90 / (90 + v / n)}
                          for n, v in ((1, 2), (10, 4), (100, 5))}  # fmt: skip
        r["accounted"]["counting"] = {"trainer": (40 - 0.15) / 40, "total": (90 - 0.15) / 90}
    table = report_tables.metrics.__wrapped__(new)
    assert "counting's (150 (149–160) ns a batch alone)" in table
    row = next(line for line in table.splitlines() if line.startswith(f"| {next(iter(new['sizes']))} | 2.00"))
    assert row == "| 8 x 129 | 2.00 / 4.00 / 5.00 | 0.952 / 0.978 | 0.990 / 0.996 | 0.999 / 0.999 | 0.996 / 0.998 |", (
        row
    )


def test_the_boundaries_table_comes_from_the_assembly_section():
    """The boundary costs of docs/benchmarks.md were a hand-copied table (issue 26): now each cell is the
    file's median slowdown with its range and the CPU µs a batch without → with, and a file without the
    section says so instead of showing figures."""
    import copy

    import report_tables

    record = report.load("bench_packing")
    assert record is not None and "assembly" in record
    new = copy.deepcopy(record)
    one = {"median": 0.5, "min": 0.25, "max": -0.004}
    for place in ("in process", "in a worker", "2 workers"):
        new["assembly"]["megatron"][f"{place}, slowdown"] = one
        new["assembly"]["megatron"][f"{place}, without, cpu us per batch"] = {"median": 20.4}
        new["assembly"]["megatron"][f"{place}, with, cpu us per batch"] = {"median": 30.6}
    table = report_tables.boundaries.__wrapped__(new)
    row = next(line for line in table.splitlines() if line.startswith("| megatron |"))
    assert row == "| megatron | " + " | ".join(["50% [25 .. 0] (20 → 31 µs)"] * 3) + " |", row
    assert "missed for megatron in process" in table
    del new["assembly"]
    assert "Not measured in this results file" in report_tables.boundaries.__wrapped__(new)
