"""The API reference builds from the docstrings without warnings (docs/build_api.py, pdoc)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

pytest.importorskip("pdoc", reason="the API reference needs the docs extra (pdoc)")

BUILD = runpy.run_path(str(Path(__file__).resolve().parent.parent / "docs" / "build_api.py"))


def test_api_reference_builds_clean(tmp_path):
    problems = BUILD["build"](tmp_path)
    assert not problems, "\n".join(problems)
    pages = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.html")}
    expected = {"index.html", "statefulset.html"} | {
        name.replace(".", "/") + ".html" for name in BUILD["modules"]() if name != "statefulset"
    }
    assert expected <= pages, sorted(expected - pages)
    page = (tmp_path / "statefulset" / "integrations" / "megatron" / "state_files.html").read_text()
    assert "add_statefulset_args" in page
    assert 'href="../../../statefulset.html#ParallelLayout"' in page  # roles became links
