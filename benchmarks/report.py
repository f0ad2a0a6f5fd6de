"""Generate the tables and machine lines of docs/benchmarks.md from the committed results files.

A generated block in a page is delimited by markers; everything between them is replaced::

    <!-- generated: machine object_storage -->
    ...
    <!-- end -->

The first word after ``generated:`` names a generator below, the rest are its arguments. So a
figure in the docs cannot drift from its run: ``tests/test_benchmarks_report.py`` fails when the
page differs from what this script makes of ``benchmarks/results/``.

    python benchmarks/report.py           # rewrite the pages of PAGES (benchmarks.md, schedules.md, scale.md,
                                          # preprocessing.md, torchtitan.md, observability.md, instruction-data.md,
                                          # transforms.md, torchft.md)
    python benchmarks/report.py --check   # exit 1 if it is not current
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import report_tables  # noqa: E402
from provenance import machine_line  # noqa: E402
from report_tables import from_results, load  # noqa: E402

ROOT = os.path.dirname(HERE)
PAGES = [
    os.path.join(ROOT, "docs", page)
    for page in (
        "benchmarks.md",
        "schedules.md",
        "scale.md",
        "preprocessing.md",
        "torchtitan.md",
        "observability.md",
        "instruction-data.md",
        "transforms.md",
        "torchft.md",
        "object-storage.md",
    )
]
BLOCK = re.compile(r"(<!-- generated: ([^>]*?) -->\n)(.*?)(<!-- end -->)", re.DOTALL)


def machine(name: str) -> str:
    """The machine, versions, commit and date of one results file (and of each stamped section)."""
    record = load(name)
    if record is None:
        return f"`benchmarks/results/{name}.json`: not recorded yet.\n"
    lines = [f"`benchmarks/results/{name}.json`. {machine_line(record)}"]
    for key, value in record.items():
        if isinstance(value, dict) and "provenance" in value and key != "provenance":
            lines.append(f"Section `{key}`: {machine_line(value)}")
    return "\n".join(lines) + "\n"


@from_results("object_storage", "bench_object_storage")
def object_storage(record: dict) -> str:
    from object_storage_table import markdown

    return markdown(record) + "\n"


@from_results("bench_preprocess_ray")
def preprocess_ray(record: dict) -> str:
    from preprocess_ray_tables import render

    return render(record, load("bench_preprocess_ray_400k")) + "\n"


@from_results("quick_worker_throughput")
def worker_handoff(record: dict) -> str:
    rounds = len(record["tokens_per_s"]["0"]["runs"])
    rows = [f"Shard `{record['prefix']}`, {record['batches']:,} batches per process after the first; "
            f"median (min–max) of {rounds} rounds of fresh processes, the worker counts alternating.", "",
            "| workers | tokens/s, median (min–max) | ÷ 0 workers, median (min–max) of rounds |",
            "|---|---|---|"]  # fmt: skip
    for w, r in record["tokens_per_s"].items():
        q = record["over_0_workers"][w]
        rows.append(f"| {w} | {r['median'] / 1e6:.1f}M ({r['min'] / 1e6:.1f}–{r['max'] / 1e6:.1f}M) | "
                    f"{q['median']:.2f} ({q['min']:.2f}–{q['max']:.2f}) |")  # fmt: skip
    two = record["over_0_workers"].get("2")
    if two:
        verdict = "met" if two["median"] >= 0.5 else "missed"
        rows += ["", f"Target (2 workers ≥ 50% of 0 workers): **{verdict}**, {two['median']:.0%} "
                     f"({two['min']:.0%}–{two['max']:.0%} over the rounds)."]  # fmt: skip
    return "\n".join(rows) + "\n"


def _pct(x: float | None) -> str:
    return "—" if x is None else ("0" if x == 0 else f"{100 * x:.4g}%")


def packing(name: str = "bench_packing") -> str:
    """Padding, cut and dropped shares per packing and corpus, each as computed by the script."""
    return from_results(name, "bench_packing")(_packing)()


def _packing(record: dict) -> str:
    rows = ["| corpus | packing | samples | windows | padding | fitting documents cut | tokens dropped |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for kind, entry in record["corpora"].items():
        for label, r in entry["packings"].items():
            cut, dropped = _pct(r.get("cut")), _pct(r.get("dropped"))
            if not r.get("from_outputs"):  # runs before the fix wrote these two as constants
                if label.startswith("OLMo-core"):
                    cut = "not computed (written as 0 by that run's script)"
                if label.startswith("bestfit (ours)"):
                    dropped = "not computed (written as 0 by that run's script)"
            rows.append(f"| {kind} (mean {entry['mean_length']:.0f}) | {label} | {r.get('samples', '—')} | "
                        f"{r.get('windows', '—')} | {_pct(r.get('padding'))} | {cut} | {dropped} |")  # fmt: skip
    return report_tables.packing_setup(record) + "\n".join(rows) + "\n"


@from_results("bench_schedules")
def schedules(record: dict) -> str:
    """Open, batch and memory per position of a 10 x 50 schedule; megatron-core's blend index beside it."""

    def ms(cell) -> str:
        if isinstance(cell, dict):
            return f"{1e3 * cell['median']:.2f} ({1e3 * cell['min']:.2f}–{1e3 * cell['max']:.2f})"
        return f"{1e3 * cell:.2f} (best of 3)"

    rows = []
    if "timed_runs" in record:
        rows += [f"{record['stages']} stages x {record['sources']} sources; median (min–max) of "
                 f"{record['timed_runs']} timed fresh processes per row after {record['warm_up_runs_dropped']} "
                 "warm-up; Python peak from one more, traced, process.", ""]  # fmt: skip
    rows += ["| position | open, ms | one batch of 8, ms | `source_positions`, ms | Python peak, MB |",
             "|---|---|---|---|---|"]  # fmt: skip
    for position, r in record["ours"].items():
        at = position if position == "no stages" else f"{int(position):,}"
        rows.append(f"| {at} | {ms(r['open_s'])} | {ms(r['read_s'])} | {ms(r['source_positions_s'])} | "
                    f"{r['python_peak_mb']:.1f} |")  # fmt: skip
    anchor = record.get("megatron_core_blend") or {}
    for size, r in anchor.items():
        if r:
            rows.append(f"\nmegatron-core blend index over {int(size):,} samples: build {ms(r['build_s'])} ms, "
                        f"load once cached {ms(r['cached_load_s'])} ms.")  # fmt: skip
    for size, seconds in (record.get("megatron_core_blend_build_s") or {}).items():
        rows.append(f"\nmegatron-core blend index over {int(size):,} samples: build {1e3 * seconds:.0f} ms "
                    "(one run; its cached load was not measured in this run).")  # fmt: skip
    return "\n".join(rows + _schedules_verdict(record)) + "\n"


def _schedules_verdict(record: dict) -> list[str]:
    """The targets (open < 10 ms, Python memory < 10 MB at any position) against the staged rows."""
    staged = [r for position, r in record["ours"].items() if position != "no stages"]
    opens = [1e3 * (r["open_s"]["median"] if isinstance(r["open_s"], dict) else r["open_s"]) for r in staged]
    peak = max(r["python_peak_mb"] for r in staged)
    return [f"\nStaged rows: open {min(opens):.1f}–{max(opens):.1f} ms (target < 10 ms: "
            f"{'met' if max(opens) < 10 else 'missed'}), Python peak at most {peak:.1f} MB (target < 10 MB: "
            f"{'met' if peak < 10 else 'missed'})."]  # fmt: skip


@from_results("bench_request_cpu")
def request_cpu(record: dict) -> str:
    """CPU per ranged GET of each client and of the loopback server, and what one core could issue."""
    from bench_request_cpu import markdown

    cpu = {c: r["client_cpu_ms"]["median"] for c, r in record["per_request"].items()}
    per_core = 1e3 / cpu["obstore"]
    return "\n".join([
        f"{record['requests_per_process']:,} ranged GETs of {record['sample_bytes']:,} bytes per client process, "
        f"one at a time, against {record['server']} on loopback; median (min–max) of {record['rounds']} rounds, "
        "the clients alternating. CPU time, not wall time (the load average is in the machine line).",
        "",
        markdown(record),
        "",
        f"obstore spends {cpu['s3fs'] / cpu['obstore']:.1f}× less client CPU per GET than s3fs. At its "
        f"{cpu['obstore']:.2f} ms one core could issue about {per_core:,.0f} GETs/s, about "
        f"{per_core * 2048 / 1e6:.0f}M tokens/s at S=2048 with one GET per sample (an extrapolation: a "
        "real store's TLS and larger responses cost more per GET).",
    ]) + "\n"  # fmt: skip


@from_results("bench_worker_start")
def worker_start(record: dict) -> str:
    """First batch and steady rate per start method (bench_worker_start.py), medians with spread."""
    runs = record["runs"]
    fork = record["median"]["fork"]
    rows = [f"Median of {len(runs['fork'])} fresh processes per method, the order rotated; the spread (min–max) "
            "in brackets.", "",
            "| start method | first loader: first batch | second loader: first batch | batches/s "
            "| first batch vs fork |", "|---|---|---|---|---|"]  # fmt: skip
    for method, m in record["median"].items():
        first = [1e3 * r["first_batch_s"] for r in runs[method]]
        second = [1e3 * r["second_batch_s"] for r in runs[method]]
        label = "fork (watched)" if method == "fork" else method
        rows.append(f"| {label} | {1e3 * m['first_batch_s']:,.0f} ms [{min(first):,.0f}–{max(first):,.0f}] | "
                    f"{1e3 * m['second_batch_s']:,.0f} ms [{min(second):,.0f}–{max(second):,.0f}] | "
                    f"{m['batches_per_s']:,.0f} | {m['first_batch_s'] / fork['first_batch_s']:.0f}× / "
                    f"{m['second_batch_s'] / fork['second_batch_s']:.0f}× |")  # fmt: skip
    return "\n".join(rows) + "\n"


@from_results("bench_object_assembly")
def object_assembly(record: dict) -> str:
    """Merging parts on S3: by the store against download + upload (bench_object_assembly.py)."""
    total = record["parts"] * record["part_bytes"] / 2**20
    rows = [f"| merge ({total:,.0f} MiB, {record['parts']} parts) | s | MiB through the driver | local disk MiB |",
            "|---|---|---|---|"]  # fmt: skip
    for name, r in record["rows"].items():
        t = r["seconds"]
        cell = f"{t['median']:.2f} ({t['min']:.2f}–{t['max']:.2f})" if isinstance(t, dict) else f"{t:.2f} (one run)"
        rows.append(f"| {name} | {cell} | {r['through_driver'] / 2**20:,.0f} | {r['local_disk'] / 2**20:,.0f} |")
    q, same = record.get("store_over_download"), "yes" if record["identical"] else "NO"
    if q:
        ratio = f"{q['median']:.2f} ({q['min']:.2f}–{q['max']:.2f}) over {len(q['runs'])} alternating rounds"
    else:
        store, download = (r["seconds"] for r in record["rows"].values())
        ratio = f"{store / download:.2f} (one run of each)"
    rows += ["", f"Time of the store's merge ÷ download + upload: {ratio}; merged objects identical: {same}."]
    return "\n".join(rows) + "\n"


@from_results("bench_long_lines")
def long_lines(record: dict) -> str:
    """One long JSON line read by ``span_chunks`` against ``readline`` (bench_long_lines.py)."""
    rows = ["| reader | s | vs readline |", "|---|---|---|"]
    anchor = record["rows"]["readline (anchor)"]["seconds"]
    for name, r in record["rows"].items():
        t = r["seconds"]
        if isinstance(t, dict):
            q = r["over_readline"]
            rows.append(f"| {name} | {t['median']:.2f} ({t['min']:.2f}–{t['max']:.2f}) | "
                        f"{q['median']:.1f}× ({q['min']:.1f}–{q['max']:.1f}) |")  # fmt: skip
        else:
            rows.append(f"| {name} | {t:.2f} (one run) | {t / anchor:.1f}× |")
    if "line_mib" in record:
        runs = len(record["rows"]["readline (anchor)"]["seconds"]["runs"])
        rows = [f"One {record['line_mib']} MiB line; median (min–max) of {runs} alternating rounds.", "", *rows]
    return "\n".join(rows) + "\n"


@from_results("bench_scale")
def scale(record: dict) -> str:
    """Opens of a 100B-token corpus by fresh processes, warm and cold page cache (bench_scale.py)."""
    rows = ["| Case | wall, s | CPU, s | RSS growth, MB | peak RSS growth, MB |", "|---|---|---|---|---|"]
    cold = any("cold page cache" in name for name in record["rows"])
    for name, r in record["rows"].items():
        if not cold:  # runs before the cold rows: every process ran on this host with a warm page cache
            name = name.replace("fresh node", "fresh process, warm page cache")
            name = name.replace("cached open, fresh process", "cached open, fresh process, warm page cache")
        six = f" (six: {r['cpu_total_over_one']:.2f}× the CPU of one)" if "cpu_total_over_one" in r else ""
        rows.append(f"| {name}{six} | {r['seconds']:.3f} | {r['cpu_s']:.3f} | {r['rss_growth_mb']:.0f} | "
                    f"{r['peak_growth_mb']:.0f} |")  # fmt: skip
    if not cold:
        rows += ["", "No cold page cache rows: this run predates them."]
    return "\n".join(rows) + "\n"


def _spread(stat: dict, scale: float = 1.0, digits: int = 0) -> str:
    low, mid, high = (f"{stat[k] * scale:,.{digits}f}" for k in ("min", "median", "max"))
    return f"{mid} [{low} .. {high}]"


@from_results("bench_torchtitan")
def torchtitan(record: dict) -> str:
    """StatefulsetDataLoader against torchtitan's HuggingFaceTextDataLoader (bench_torchtitan.py)."""
    s = record["settings"]
    runs = len(record["loaders"]["statefulset"]["tokens_per_s"]["runs"])
    rows = [
        f"Batches of {s['batch']} x {s['seq_len']} tokens, {s['workers']} workers, {s['batches']} batches a run, "
        f"{s['documents']:,} documents; median [min .. max] of {runs} runs, each in a fresh process.",
        "",
        "| loader | tokens/s | resume to first batch (s) |",
        "|---|---:|---:|",
    ]
    for name, label in (("statefulset", "StatefulsetDataLoader"), ("huggingface", "HuggingFaceTextDataLoader")):
        loader = record["loaders"][name]
        rows.append(f"| {label} | {_spread(loader['tokens_per_s'])} | {_spread(loader['resume_seconds'], 1, 3)} |")
    return "\n".join(rows) + "\n"


@from_results("bench_torchft")
def torchft(record: dict) -> str:
    """FaultTolerantLoader against the plain savable loader (bench_torchft.py)."""
    b, runs = record["batch"], len(record["tokens_per_second_runs"]["plain"])
    tps, change = record["tokens_per_second"], record["change"]
    stable = "met" if record["stable_ratio"]["median"] >= 0.90 else "not met"
    first = "met" if change["ratio"]["median"] <= 2 else "not met"
    change_digits = 2 if change["ratio"]["median"] < 10 else 0
    return "\n".join([
        f"Batches of {b[0]} x {b[1]} tokens, {record['workers']} workers, {record['batches_per_run']} batches a run, "
        f"a quorum change every {record['change_every']}; median [min .. max] of {runs} runs.",
        "",
        "| figure | measured | target |",
        "|---|---:|---:|",
        f"| plain savable loader, tokens/s | {_spread(tps['plain'])} | |",
        f"| FaultTolerantLoader, stable quorum, tokens/s | {_spread(tps['fault_tolerant'])} | |",
        f"| ratio, stable quorum | {_spread(record['stable_ratio'], 1, 2)} | >= 0.90 ({stable}) |",
        f"| data time of a normal step (ms) | {_spread(change['normal'], 1000, 2)} | |",
        f"| data time of the first step after a change (ms) | {_spread(change['first_after_change'], 1000, 2)} | |",
        f"| ratio, first step after a change | {_spread(change['ratio'], 1, change_digits)} | <= 2 ({first}) |",
        *_torchft_built_here(change),
        *_torchft_refill(change),
    ]) + "\n"  # fmt: skip


def _torchft_built_here(change: dict) -> list[str]:
    """The changes whose batch the trainer built (no prefetch had it), apart (results from before have none)."""
    if "ratio_built_here" not in change:
        return []
    met = "met" if change["ratio_built_here"]["median"] <= 2 else "not met"
    rows = [
        f"| share of changes built in the trainer | {_spread(change['share_built_here'], 1, 2)} | |",
        f"| first step after a change, built in the trainer (ms) | {_spread(change['first_built_here'], 1000, 2)} | |",
        f"| ratio, first step built in the trainer | {_spread(change['ratio_built_here'], 1, 2)} | <= 2 ({met}) |",
    ]
    if "first_from_workers" in change:
        rows.insert(2, f"| first step after a change, from the workers' batches (ms) | "
                       f"{_spread(change['first_from_workers'], 1000, 2)} | |")  # fmt: skip
    return rows


def _torchft_refill(change: dict) -> list[str]:
    """The rows of the refill after a change (results from before they were measured have none)."""
    if "extra_per_change" not in change:
        return []
    return [
        f"| data time of the second step after a change (ms) | {_spread(change['second_after_change'], 1000, 2)} | |",
        f"| data time of a steady step (ms) | {_spread(change['steady'], 1000, 2)} | |",
        f"| extra data time of a change, all steps (ms) | {_spread(change['extra_per_change'], 1000, 2)} | |",
    ]


GENERATORS: dict[str, Callable[..., str]] = {
    "torchtitan": torchtitan,
    "torchft": torchft,
    "machine": machine,
    "object_storage": object_storage,
    "preprocess_ray": preprocess_ray,
    "preprocess_bpe": report_tables.preprocess_bpe,
    "worker_handoff": worker_handoff,
    "packing": packing,
    "boundaries": report_tables.boundaries,
    "schedules": schedules,
    "request_cpu": request_cpu,
    "worker_start": worker_start,
    "object_assembly": object_assembly,
    "long_lines": long_lines,
    "scale": scale,
    "write": report_tables.write,
    "read": report_tables.read,
    "preprocess": report_tables.preprocess,
    "loader": report_tables.loader,
    "stream": report_tables.stream,
    "worker_pool": report_tables.worker_pool,
    "collectives": report_tables.collectives,
    "concurrent_open": report_tables.concurrent_open,
    "metrics": report_tables.metrics,
    "loss_masks": report_tables.loss_masks,
    "task_encoder": report_tables.task_encoder,
    "fim": report_tables.fim,
}


def render(text: str) -> str:
    """The page with every generated block made again from the results files."""

    def replace(match: re.Match) -> str:
        words = match.group(2).split()
        if not words or words[0] not in GENERATORS:
            raise SystemExit(f"docs: unknown generated block {match.group(2)!r} (known: {', '.join(GENERATORS)})")
        return match.group(1) + GENERATORS[words[0]](*words[1:]) + match.group(4)

    return BLOCK.sub(replace, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page is not current")
    args = parser.parse_args()
    stale = []
    for page in PAGES:
        with open(page) as f:
            text = f.read()
        made = render(text)
        if made != text:
            stale.append(page)
            if not args.check:
                with open(page, "w") as f:
                    f.write(made)
    if args.check and stale:
        sys.exit(f"not current (run python benchmarks/report.py): {', '.join(stale)}")
    print("rewrote " + ", ".join(stale) if stale else "current")


if __name__ == "__main__":
    main()
