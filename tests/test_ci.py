"""CI runs the README's test command, and only oracle tests may skip (issue 24 H8/H9, issue 25 item 1).

The skip rule (tests/no_skips.py, ``--no-skips``) is tried in real pytest subprocesses on small
test files, with megatron-core made absent (an import blocker loaded with ``-p``) or present (a
stand-in package), and on this suite's own collection without megatron-core: no module may skip.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import no_skips
import pytest

THIS = Path(__file__).resolve()
TESTS = THIS.parent
ROOT = TESTS.parent

BLOCKER = '''
import sys


class BlockMegatron:
    """megatron-core is not installed, as far as this process can tell."""

    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by tests/test_ci.py)", name=name)
        return None


sys.meta_path.insert(0, BlockMegatron())
'''

CONFTEST = "from no_skips import pytest_addoption, pytest_configure, pytest_runtest_setup  # noqa: F401\n"

FILES = {
    "test_plain.py": "def test_runs():\n    pass\n",
    "test_oracle_only.py": """
        import pytest


        @pytest.mark.oracle
        def test_compares_with_megatron_core():
            import megatron.core  # noqa: F401
    """,
    "test_oracle_other_reason.py": """
        import pytest


        @pytest.mark.oracle
        def test_skips_for_another_reason():
            pytest.skip("lost a race")
    """,
    "test_lost_race.py": """
        import pytest


        def test_kill_lands():
            pytest.skip("the run finished before it could be killed")
    """,
    "test_module_skip.py": """
        import pytest

        pytest.importorskip("no_such_module_statefulset_tests")


        def test_never_collected():
            pass
    """,
    "test_xfail.py": """
        import pytest


        @pytest.mark.xfail(reason="known bug")
        def test_fails():
            raise AssertionError
    """,
    "test_xpass.py": """
        import pytest


        @pytest.mark.xfail(reason="known bug")
        def test_passes():
            pass
    """,
    "test_unknown_marker.py": """
        import pytest


        @pytest.mark.oracel
        def test_misspelt():
            pass
    """,
}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("skip_rule")
    (folder / "pytest.ini").write_text("[pytest]\naddopts = -ra --strict-markers\n")
    (folder / "conftest.py").write_text(CONFTEST)
    (folder / "block_megatron.py").write_text(BLOCKER)
    fake = folder / "fake" / "megatron" / "core"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    for name, text in FILES.items():
        (folder / name).write_text(textwrap.dedent(text).lstrip())
    return folder


def run_pytest(folder: Path, files: list[str], *options: str, megatron: bool) -> subprocess.CompletedProcess:
    """pytest on ``files`` in a fresh process, megatron-core blocked or stood in for."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    path = [str(folder), str(TESTS)] + ([str(folder / "fake")] if megatron else [])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    blocker = [] if megatron else ["-p", "block_megatron"]
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *blocker, *options, *files]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def test_oracle_skip_without_megatron_passes(project):
    run = run_pytest(project, ["test_plain.py", "test_oracle_only.py"], "--no-skips", megatron=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed, 1 skipped" in run.stdout and "megatron-core is not installed" in run.stdout


def test_oracle_test_runs_with_megatron(project):
    run = run_pytest(project, ["test_oracle_only.py"], "--no-skips", megatron=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout and "skipped" not in run.stdout


@pytest.mark.parametrize(
    ("files", "megatron", "shown"),
    [
        (["test_lost_race.py"], False, "skipped: the run finished before it could be killed"),
        (["test_module_skip.py"], False, "whole module skipped"),
        (["test_xfail.py"], False, "xfailed: known bug"),
        (["test_xpass.py"], False, "xpassed: known bug"),
        (["test_oracle_other_reason.py"], True, "skipped: lost a race"),
    ],
    ids=["skip", "module-skip", "xfail", "xpass", "oracle-skip-with-megatron"],
)
def test_any_other_skip_fails_the_run(project, files, megatron, shown):
    run = run_pytest(project, ["test_plain.py", *files], "--no-skips", megatron=megatron)
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, run.stdout + run.stderr
    assert shown in run.stdout and "1 unexpected skip(s): the run fails" in run.stdout, run.stdout
    relaxed = run_pytest(project, ["test_plain.py", *files], megatron=megatron)  # without --no-skips
    assert relaxed.returncode == 0, relaxed.stdout + relaxed.stderr


def test_markers_are_strict(project):
    run = run_pytest(project, ["test_unknown_marker.py"], "--no-skips", megatron=False)
    assert run.returncode != 0 and "'oracel' not found in `markers`" in run.stdout + run.stderr


def test_this_suite_registers_the_rule():
    spec = importlib.util.spec_from_file_location("suite_conftest", TESTS / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    for hook in ("pytest_addoption", "pytest_configure", "pytest_runtest_setup"):
        assert getattr(conftest, hook) is getattr(no_skips, hook), hook
    assert "--strict-markers" in (ROOT / "pyproject.toml").read_text()


def test_no_module_of_this_suite_skips_without_megatron(tmp_path):
    """H8: with megatron-core absent every module that uses it collects; only its oracle tests will skip."""
    modules = [p.name for p in sorted(TESTS.glob("test_*.py")) if "megatron.core" in p.read_text() and p != THIS]
    assert "test_documents.py" in modules and "test_preprocess.py" in modules
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    blocker = tmp_path / "block_megatron.py"
    blocker.write_text(BLOCKER)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "block_megatron", "--co", "-q"]
    command += ["--no-skips", *modules]
    run = subprocess.run(command, cwd=TESTS, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert re.search(r"^\d+ tests collected", run.stdout, re.MULTILINE), run.stdout[-2000:]


def read_readme_command() -> str:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.DOTALL)
    found = [b.strip() for b in blocks if "tests/install.py" in b]
    assert len(found) == 1, found
    return found[0]


def test_ci_runs_exactly_the_readme_command():
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert lines == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', read_readme_command()]
    assert "--no-skips" in read_readme_command()


def test_install_script_installs_the_oracle_as_ci_needs():
    spec = importlib.util.spec_from_file_location("tests_install", TESTS / "install.py")
    install = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(install)
    project, oracle, titan = install.steps()
    assert titan[-2:] == ["torchtitan==0.3.0", "datasets==4.7.0"] and "--no-deps" in titan
    assert project[:4] == [sys.executable, "-m", "pip", "install"]
    assert "torch==2.13.0" in project and project[-2:] == ["-e", ".[test]"]
    assert oracle[-3:] == ["megatron-core==0.19.2", "triton", "packaging>=24.2"]
    assert "--ignore-requires-python" in oracle and "--no-deps" in oracle
