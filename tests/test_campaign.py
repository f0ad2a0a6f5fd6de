"""The reliability campaign's short form (issue 24 §3; docs/reliability.md): a fixed set of seeds,
one case per fault kind of each side (preprocessing, loading) plus a few combinations, each case in
its own process under a hard timeout. Every case must end with exactly the expected bytes or
batches, or with a named StatefulsetError: a hang, a silent difference or an unnamed error fails
the test, unless the KNOWN list (tests/campaign/known.py) attributes it to a fix in progress.

The long form, >= 2,000 cases: ``python benchmarks/campaign.py``.
"""

from __future__ import annotations

from campaign import draw
from campaign.known import KNOWN
from campaign.loading_draw import FAULTS
from campaign.outcome import FINDINGS, VERDICTS
from campaign.preprocessing import PP_FAULTS
from campaign.runner import run_seeds

# The first seed (of the cheap ones: local unless the fault needs S3, no ~2 MB input) for each
# (side, fault), then: loading on S3, forkserver workers, stages with document boundaries;
# preprocessing with huge lines and 2+ workers, and an output on S3.
SEEDS = [
    *(6, 7, 15, 27, 34, 36, 47, 55, 85, 95, 104, 116, 120, 132, 166, 179, 183, 204, 232, 301, 390, 473, 844, 951),
    *(1035, 1108, 156, 75, 106, 1, 8),
]


def test_the_seed_set_covers_every_fault():
    drawn = [draw(s) for s in SEEDS]
    assert {c["fault"] for c in drawn if c["kind"] == "load"} == set(FAULTS)
    assert {c["fault"] for c in drawn if c["kind"] == "preprocess"} == set(PP_FAULTS)
    assert draw(SEEDS[0]) == draw(SEEDS[0])  # a seed alone reproduces its case


def test_short_form(tmp_path):
    cases, results = run_seeds(SEEDS, str(tmp_path), jobs=2, timeout=240)
    assert [r["verdict"] in VERDICTS for r in results] == [True] * len(SEEDS)
    findings = [
        f"seed {c['seed']} ({c['kind']}, fault {c['fault']}): {r['verdict']}: {r['detail'][:800]}"
        for c, r in zip(cases, results, strict=True)
        if r["verdict"] in FINDINGS and "known" not in r
    ]
    assert not findings, "\n".join(findings)
    # Faults must land in most cases, or the campaign tests nothing (a gate that always loses its race).
    faulted = [r for c, r in zip(cases, results, strict=True) if c["fault"] != "none"]
    assert sum(bool(r.get("landed")) for r in faulted) >= len(faulted) // 2, results


def test_known_entries_name_their_issue_item():
    for entry in KNOWN:
        assert entry.item.startswith("issue ") and entry.seen


def test_reliability_page_shows_the_long_form_tally():
    """docs/reliability.md's table is what docs/build_reliability.py makes of benchmarks/results/campaign.json."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("build_reliability", root / "docs" / "build_reliability.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    page = build.PAGE.read_text(encoding="utf-8")
    if not build.RESULTS.exists():
        assert "No long-form run recorded yet." in page
        return
    report = json.loads(build.RESULTS.read_text(encoding="utf-8"))
    assert report["tally"]["cases"] == sum(report["tally"][v] for v in VERDICTS)
    assert build.render(page, report) == page, "run: python docs/build_reliability.py"
