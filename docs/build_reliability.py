"""Writes the campaign's tally table into docs/reliability.md from benchmarks/results/campaign.json.

Only the block between the ``campaign-tally`` markers changes; the rest of the page (other
sections, such as the sanitizers') is left as it is. tests/test_campaign.py checks it is current.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reliability.md"
RESULTS = ROOT / "benchmarks" / "results" / "campaign.json"
BEGIN, END = "<!-- campaign-tally:begin (python docs/build_reliability.py) -->", "<!-- campaign-tally:end -->"
COLUMNS = ("pass", "named_error", "hang", "silent_difference", "unnamed_error")
LABELS = dict(zip(COLUMNS, ("passes", "named errors", "hangs", "silent differences", "unnamed errors"), strict=True))


def table(report: dict) -> str:
    t = report["tally"]
    git, machine = report["git"], report["machine"]
    lines = [
        f"Long form at commit `{git['head'][:12]}` on {machine['vcpus']} vCPUs ({machine['cpu']}), "
        f"python {machine['python']}, torch {machine['torch']}, moto {report['versions']['moto']}: "
        f"{t['cases']} cases"
        + (
            f" (of {report['args']['cases']} asked for: the run stopped at its deadline)"
            if t["cases"] < report["args"]["cases"]
            else ""
        )
        + f" in {report['seconds'] / 60:.0f} min, {report['args']['jobs']} at a time, "
        f"hard timeout {report['args']['timeout_s']:g} s, median case {report['case_seconds']['median']:g} s "
        f"({report['case_seconds']['cpu_median']:g} CPU s); a fault landed in {report['landed']} of "
        f"{report['faulted']} faulted cases.",
        "",
        "| side | cases | " + " | ".join(LABELS[c] for c in COLUMNS) + " |",
        "|---|---:|" + "---:|" * len(COLUMNS),
    ]
    for kind, row in sorted(t["by_kind"].items()):
        lines.append(f"| {kind} | {sum(row.values())} | " + " | ".join(str(row[c]) for c in COLUMNS) + " |")
    lines.append(f"| **all** | **{t['cases']}** | " + " | ".join(f"**{t[c]}**" for c in COLUMNS) + " |")
    lines.append("")
    lines.append(f"Findings: {t['known']} explained by the KNOWN list (fixes in progress), {t['new findings']} new.")
    groups: dict[tuple, list[int]] = {}
    for f in report["findings"]:
        again = f.get("rerun")
        rerun = f"; run again at `{again['commit'][:12]}`: {again['verdict']}" if again else ""
        groups.setdefault((f["kind"], f["fault"], f["verdict"], f.get("known", "new"), rerun), []).append(f["seed"])
    for (kind, fault, verdict, where, rerun), seeds in sorted(groups.items()):
        shown = ", ".join(map(str, seeds[:5])) + (", ..." if len(seeds) > 5 else "")
        lines.append(f"- {kind}, fault `{fault}`: {len(seeds)} {verdict} (seeds {shown}); {where}{rerun}")
    return "\n".join(lines)


def render(page: str, report: dict) -> str:
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table(report)}\n{END}{tail}"


def main() -> None:
    report = json.loads(RESULTS.read_text(encoding="utf-8"))
    PAGE.write_text(render(PAGE.read_text(encoding="utf-8"), report), encoding="utf-8")


if __name__ == "__main__":
    main()
