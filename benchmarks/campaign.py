"""The long form of the reliability campaign (issue 24 §3; docs/reliability.md).

Runs >= 2,000 seeded cases (tests/campaign: preprocessing and loading, random combinations and
faults), each in its own process under a hard timeout, ``--jobs`` at a time, and writes the tally to
benchmarks/results/campaign.json with the commit, machine and versions. A case that timed out is
run once more alone with twice the timeout: the JSON says whether the hang reproduced. Progress
goes to ``--log`` (one JSON line per case) so an interrupted run keeps what it did.

    python benchmarks/campaign.py --cases 2000 --jobs 2
    python docs/build_reliability.py          # the tally table in docs/reliability.md
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import sys
import tempfile
import time
from importlib import metadata

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# This script's own folder would shadow the tests' ``campaign`` package with this file: it goes last.
sys.path[:] = [os.path.join(ROOT, "tests")] + [p for p in sys.path if os.path.abspath(p or ".") != HERE] + [HERE]

import benchenv  # noqa: E402
from campaign import draw  # noqa: E402
from campaign.known import KNOWN  # noqa: E402
from campaign.outcome import FINDINGS  # noqa: E402
from campaign.runner import Session, tally  # noqa: E402

FIRST_SEED = 100_000


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("moto", "s3fs", "obstore", "boto3", "pyarrow", "ray"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def coverage(cases: list[dict], results: list[dict]) -> dict:
    """How often each value of each dimension was drawn, and how often a fault landed."""
    dims: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for case, result in zip(cases, results, strict=True):
        kind = case["kind"]
        dims[f"{kind}/fault"][case["fault"]] += 1
        dims[f"{kind}/storage"][case["storage"]] += 1
        if result.get("landed") and case["fault"] != "none":
            dims[f"{kind}/fault landed"][case["fault"]] += 1
        if kind == "load":
            dims["load/packing"][case["packing"]] += 1
            dims["load/document_boundaries"][str(case["document_boundaries"])] += 1
            dims["load/stages"][str(len(case["stages"] or ()))] += 1
            dims["load/sources"][str(len(case["sources"]))] += 1
            dims["load/workers"][f"{case['workers'][0]}->{case['workers'][1]}"] += 1
            dims["load/start method"]["/".join(case["contexts"])] += 1
            dims["load/dp"][f"{case['dp_sizes'][0]}->{case['dp_sizes'][1]}"] += 1
            dims["load/restore"][case["restore"]] += 1
        else:
            dims["preprocess/workers"][str(case["workers"])] += 1
            dims["preprocess/files"][str(len(case["files"]))] += 1
            for f in case["files"]:
                dims["preprocess/input kinds"][f["kind"]] += 1
            dims["preprocess/huge lines"][str(any(f["huge_rate"] for f in case["files"]))] += 1
            dims["preprocess/~2 MB gzip input"][str(any(f.get("big") for f in case["files"]))] += 1
    return {k: dict(sorted(v.items())) for k, v in sorted(dims.items())}


def _deadline(text: str | None, grace_s: float = 0.0):
    if not text:
        return None
    now = time.gmtime()
    hour, minute = (int(x) for x in text.split(":"))
    left = (hour * 60 + minute - now.tm_hour * 60 - now.tm_min) * 60 - now.tm_sec + grace_s
    end = time.monotonic() + left
    return lambda: time.monotonic() > end


def _rerun_timeouts(session: Session, cases: list[dict], results: list[dict], args, late) -> None:
    """Each case that timed out once more, two at a time with 1.5 times the timeout (not after ``late``)."""
    again = [(c, r) for c, r in zip(cases, results, strict=True) if "no result within" in r["detail"]]
    if not again:
        return
    if late is not None and late():
        for _, r in again:
            r["rerun"] = "skipped: past the deadline"
        return
    session.timeout, session.jobs = 1.5 * args.timeout, min(2, args.jobs)
    for (_, result), second in zip(again, session.run([c for c, _ in again]), strict=True):
        result["rerun"] = second["verdict"]


def rerun_findings(path: str, jobs: int, timeout: float) -> int:
    """Each finding of ``path`` once more on this checkout; the verdicts are added to the file."""
    with open(path) as f:
        report = json.load(f)
    seeds = [f["seed"] for f in report["findings"]]
    cases = [draw(seed, long_form=True) for seed in seeds]
    head = benchenv.git_state()["head"]
    with tempfile.TemporaryDirectory(prefix="campaign-rerun-") as root, Session(root, jobs=jobs, timeout=timeout) as s:
        results = s.run(cases)
    for finding, result in zip(report["findings"], results, strict=True):
        finding["rerun"] = {"commit": head, "verdict": result["verdict"], "detail": result["detail"][:300]}
    report["findings_rerun_on"] = head
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    print(
        json.dumps(
            [{"seed": f["seed"], "fault": f["fault"], "rerun": f["rerun"]["verdict"]} for f in report["findings"]]
        )
    )
    return 0


def _summary(case: dict) -> dict:
    keep = ("kind", "fault", "storage", "packing", "workers", "contexts", "dp_sizes", "document_boundaries")
    return {k: case[k] for k in keep if k in case}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--first-seed", type=int, default=FIRST_SEED)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=150.0, help="hard timeout of one case, seconds")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "campaign.json"))
    ap.add_argument("--log", default=None, help="one JSON line per finished case (default: beside --out)")
    ap.add_argument(
        "--deadline", default=None, help="UTC HH:MM after which no case starts (the JSON says how many ran)"
    )
    ap.add_argument("--rerun-findings", metavar="JSON", help="rerun the findings of a results file on this checkout")
    ap.add_argument(
        "--from-log", metavar="LOG", nargs="+", help="write --out from runs' logs (one commit) instead of running"
    )
    ap.add_argument("--seconds", type=float, default=0.0, help="with --from-log: how long that run took")
    ap.add_argument("--commit", default=None, help="with --from-log: the commit that run measured")
    args = ap.parse_args()
    if args.from_log:
        return from_log(args)
    if args.rerun_findings:
        return rerun_findings(args.rerun_findings, args.jobs, args.timeout)
    log_path = args.log or os.path.splitext(args.out)[0] + ".log.jsonl"
    seeds = range(args.first_seed, args.first_seed + args.cases)
    cases = [draw(seed, long_form=True) for seed in seeds]
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="campaign-") as root, open(log_path, "w") as log:

        def progress(case: dict, result: dict) -> None:
            log.write(json.dumps({"case": case, "result": result}) + "\n")
            log.flush()
            if result["verdict"] in FINDINGS:
                print(f"seed {case['seed']}: {result['verdict']}: {result['detail'][:300]}", flush=True)

        with Session(root, jobs=args.jobs, timeout=args.timeout, keep_findings=False) as session:
            results = session.run(cases, progress, stop=_deadline(args.deadline))
            cases = cases[: len(results)]
            _rerun_timeouts(session, cases, results, args, _deadline(args.deadline, grace_s=240))
    write_report(args, cases, results, time.time() - started)
    return 0


def write_report(args, cases: list[dict], results: list[dict], seconds: float) -> None:
    findings = [
        {"seed": c["seed"], **_summary(c), **{k: r[k] for k in r if k not in ("seed",)}}
        for c, r in zip(cases, results, strict=True)
        if r["verdict"] in FINDINGS
    ]
    pairs = list(zip(cases, results, strict=True))
    counts = tally(cases, results)
    counts["known"] = sum(1 for f in findings if "known" in f)
    counts["new findings"] = len(findings) - counts["known"]
    report = {
        "benchmark": "campaign",
        "git": {"head": args.commit, "dirty": ""} if getattr(args, "commit", None) else benchenv.git_state(),
        "machine": benchenv.environment(),
        "versions": _versions(),
        "args": {"cases": args.cases, "first_seed": args.first_seed, "jobs": args.jobs, "timeout_s": args.timeout},
        "seed_ranges": _ranges([c["seed"] for c in cases]),
        "seconds": round(seconds, 1),
        "tally": counts,
        "landed": sum(1 for c, r in zip(cases, results, strict=True) if c["fault"] != "none" and r.get("landed")),
        "faulted": sum(1 for c in cases if c["fault"] != "none"),
        "named_errors_by_fault": dict(
            collections.Counter(f"{c['kind']}/{c['fault']}" for c, r in pairs if r["verdict"] == "named_error")
        ),
        "cases_with_strays": sum(1 for _, r in pairs if r.get("strays")),
        "findings": findings,
        "known_list": [{"item": k.item, "seen": k.seen} for k in KNOWN],
        "coverage": coverage(cases, results),
        "case_seconds": {
            "cpu_median": sorted(r.get("cpu_s", 0) for r in results)[len(results) // 2],
            "cpu_total": round(sum(r.get("cpu_s", 0) for r in results), 1),
            "median": sorted(r.get("seconds", 0) for r in results)[len(results) // 2],
            "max": max(r.get("seconds", 0) for r in results),
        },
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, sort_keys=False)
        f.write("\n")
    print(json.dumps(report["tally"], indent=1))


def _ranges(seeds: list[int]) -> list[list[int]]:
    """Sorted seeds as [first, last] runs of consecutive ones."""
    out: list[list[int]] = []
    for seed in sorted(seeds):
        if out and seed == out[-1][1] + 1:
            out[-1][1] = seed
        else:
            out.append([seed, seed])
    return out


def from_log(args) -> int:
    """The results file of a run from its log (a run cut short, or one whose KNOWN list changed since), or
    of several runs of the same commit over disjoint seed ranges (run side by side, or one after another)."""
    from campaign.known import known

    entries = []
    for path in args.from_log:  # several runs of one commit over other seeds add up (gzip or plain)
        with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
            entries += [json.loads(line) for line in f if line.strip()]
    entries.sort(key=lambda e: e["case"]["seed"])
    if len({e["case"]["seed"] for e in entries}) != len(entries):
        raise SystemExit("--from-log: a seed appears twice (give logs of disjoint seed ranges)")
    cases, results = [e["case"] for e in entries], [e["result"] for e in entries]
    for case, result in zip(cases, results, strict=True):
        result.pop("known", None)
        entry = known(case, result) if result["verdict"] in FINDINGS else None
        if entry is not None:
            result["known"] = entry.item
    args.first_seed = cases[0]["seed"]  # args.cases stays the number that run was asked for
    write_report(args, cases, results, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
