"""Ratio bar charts of the benchmark results: statefulset against its anchor, side by side.

Each benchmark script ends with :func:`publish`, which writes the run's summary to
``benchmarks/results/<name>.json`` and, unless ``--no-plot`` was given, a chart to
``docs/img/<name>.png``. A chart has one group per comparison: the anchor's bar at 1×, ours at
the ratio (anchor time ÷ our time, or our rate ÷ the anchor's rate, so above 1× is always
"statefulset is better"), with both measured values written under the bars.

The ``*_comparisons`` functions turn one script's summary into the list of comparisons; they
take plain dicts, so they can be checked on a small hand-made summary. matplotlib (the
``bench`` extra) is imported only when a chart is drawn, with the Agg backend.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(HERE, "results")
IMG_DIR = os.path.join(os.path.dirname(HERE), "docs", "img")


@dataclass(frozen=True)
class Comparison:
    """One measured quantity on both sides: seconds (lower is better) or a rate (higher is better)."""

    label: str
    anchor: float
    ours: float
    unit: str = "s"
    lower_is_better: bool = True

    @property
    def ratio(self) -> float:
        """How many times better statefulset is: above 1 means better."""
        return self.anchor / self.ours if self.lower_is_better else self.ours / self.anchor


def add_plot_argument(parser: Any) -> None:
    parser.add_argument(
        "--no-plot", action="store_true", help="write benchmarks/results/<name>.json but no docs/img/<name>.png"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run at a small size: results to benchmarks/out/quick/, no chart"
    )


def apply_quick(args: Any, name: str, **small: Any) -> None:
    """With ``--quick``: the small sizes ``small``, a folder of its own under benchmarks/out/quick, no chart."""
    if not args.quick:
        return
    for key, value in small.items():
        setattr(args, key, value)
    args.out_dir = os.path.join(HERE, "out", "quick", name)
    args.no_plot = True


def _format(value: float, unit: str) -> str:
    if unit == "s":
        if value < 1e-3:
            return f"{value * 1e6:.0f} µs"
        if value < 1:
            return f"{value * 1e3:.1f} ms"
        return f"{value:.2f} s"
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{prefix} {unit}"
    return f"{value:.1f} {unit}"


def ratio_chart(
    comparisons: list[Comparison],
    title: str,
    path: str,
    anchor_name: str = "megatron-core",
    ours_name: str = "statefulset",
) -> str:
    """Draw the chart to ``path`` (PNG) and return the path."""
    if not comparisons:
        raise ValueError("ratio_chart: nothing to draw")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = [c.ratio for c in comparisons]
    log = max(ratios) / max(min(ratios), 1e-9) > 30
    height = 0.38
    fig, ax = plt.subplots(figsize=(8.5, 0.95 * len(comparisons) + 1.4))
    ys = list(range(len(comparisons)))[::-1]  # first comparison on top
    ax.barh([y + height / 2 for y in ys], [1.0] * len(ys), height, label=anchor_name, color="#9aa5b1")
    bars = ax.barh([y - height / 2 for y in ys], ratios, height, label=ours_name, color="#2f6fb3")
    ax.axvline(1.0, color="black", linewidth=0.8)
    for bar, ratio in zip(bars, ratios, strict=True):
        ax.annotate(
            f"{ratio:.3g}×",
            (bar.get_width(), bar.get_y() + bar.get_height() / 2),
            xytext=(3, 0),
            textcoords="offset points",
            ha="left",
            va="center",
            fontsize=9,
            fontweight="bold",
        )
    ax.set_yticks(ys)
    ax.set_yticklabels(
        [f"{c.label}\n{_format(c.anchor, c.unit)} vs {_format(c.ours, c.unit)}" for c in comparisons], fontsize=8
    )
    if log:
        ax.set_xscale("log")
        ax.set_xlim(min(0.5, min(ratios) / 2), max(ratios) * 4)
    else:
        ax.set_xlim(0, max(1.0, max(ratios)) * 1.2)
    ax.set_xlabel(f"{ours_name} relative to {anchor_name} (1× = same; higher is better)")
    ax.set_title(title, fontsize=11)
    ax.legend(loc="lower right", fontsize=9)
    ax.grid(axis="x", alpha=0.3, which="both")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def publish(
    name: str,
    result: dict[str, Any],
    summary: Any,
    comparisons: list[Comparison],
    title: str,
    anchor_name: str = "megatron-core",
    plot: bool = True,
    results_dir: str = RESULTS_DIR,
    img_dir: str = IMG_DIR,
    quick: bool = False,
) -> tuple[str, str | None]:
    """Write ``<results_dir>/<name>.json`` (and ``<img_dir>/<name>.png`` when ``plot``); return both paths.

    Written through ``provenance.write_results`` (commit, machine, versions); ``quick`` runs go to
    ``benchmarks/out/quick/`` and draw nothing.
    """
    from provenance import write_results

    record = {
        "name": name,
        "title": title,
        "anchor": anchor_name,
        **{k: result[k] for k in ("script", "command", "environment", "git", "git_at_start") if k in result},
        "comparisons": [{**asdict(c), "ratio": c.ratio} for c in comparisons],
        "summary": summary,
    }
    json_path = write_results(name, record, path=None if quick else os.path.join(results_dir, f"{name}.json"),
                              quick=quick)  # fmt: skip
    png_path = None
    if plot and comparisons and not quick:
        png_path = ratio_chart(comparisons, title, os.path.join(img_dir, f"{name}.png"), anchor_name)
    return json_path, png_path


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if isinstance(value, set | tuple):
        return list(value)
    return str(value)


def _median(cell: Any) -> float:
    return float(cell["median"]) if isinstance(cell, dict) else float(cell)


def _finite(comparisons: list[Comparison]) -> list[Comparison]:
    return [c for c in comparisons if c.anchor > 0 and c.ours > 0 and math.isfinite(c.anchor + c.ours)]


# -- one function per script: its summary -> comparisons ------------------------------------------
def write_comparisons(summary: dict[str, Any]) -> list[Comparison]:
    """bench_write.py: writing the corpus, megatron-core's builder against our writers."""
    s = {k: _median(v["seconds"]) for k, v in summary.items() if isinstance(v, dict) and "seconds" in v}
    out = []
    if "megatron_fsync" in s and "ours_vectorised" in s:
        out.append(Comparison("add_documents + close\nvs builder + fsync", s["megatron_fsync"], s["ours_vectorised"]))
    if "megatron" in s and "ours_vectorised" in s:
        out.append(Comparison("add_documents + close\nvs builder (no fsync)", s["megatron"], s["ours_vectorised"]))
    if "megatron_fsync" in s and "ours_loop" in s:
        out.append(Comparison("add_document loop\nvs builder + fsync", s["megatron_fsync"], s["ours_loop"]))
    return _finite(out)


def read_comparisons(summary: dict[str, Any]) -> list[Comparison]:
    """bench_read.py: random sequence reads, first full pass and open, megatron-core against ours."""
    m, o = summary["megatron"], summary["ours"]
    out = [
        Comparison("random reads\n(one pass)", _median(m["seconds"]), _median(o["seconds"])),
        Comparison("first full pass", float(m["first_full_pass_s"]), float(o["first_full_pass_s"])),
        Comparison("p50 read latency", m["latency_us"]["p50"] / 1e6, o["latency_us"]["p50"] / 1e6),
    ]
    return _finite(out)


_LOADER_SHORT = {
    "td_native": "native",
    "td_megatron": "megatron",
    "td_native_shuffle": "native, td shuffle",
    "td_native_batched": "native, td __getitems__",
}


def loader_comparisons(summary: dict[str, Any], positions: list[int]) -> list[Comparison]:
    """bench_loader.py: resume at the late position and throughput, torchdata against ours."""
    ours_for = {"td_native": "ours_native", "td_megatron": "ours_megatron", "td_native_shuffle": "ours_native"}
    late = str(positions[-1])
    out = []
    resume = summary.get("resume", {})
    for td, ours in ours_for.items():
        for key in sorted(k for k in resume if k.startswith(f"{td}/")):
            workers = key.split("/w")[-1]
            theirs, mine = resume[key].get(late), resume.get(f"{ours}/w{workers}", {}).get(late)
            if theirs and mine:
                label = f"resume at batch {int(late):,}\n{_LOADER_SHORT[td]}, {workers} workers"
                out.append(Comparison(label, _median(theirs["total_s"]), _median(mine["total_s"])))
    throughput = summary.get("throughput", {})
    for td in ("td_native", "td_megatron", "td_native_batched"):
        ours = "ours_megatron" if td == "td_megatron" else "ours_native"
        for key in sorted(k for k in throughput if k.startswith(f"{td}/")):
            workers = key.split("/w")[-1]
            mine = throughput.get(f"{ours}/w{workers}")
            if mine:
                label = f"tokens/s\n{_LOADER_SHORT[td]}, {workers} workers"
                theirs_rate = _median(throughput[key]["tokens_per_s"])
                out.append(Comparison(label, theirs_rate, _median(mine["tokens_per_s"]), "tok/s", False))
    return _finite(out)


# bench_stream.py's batch variants compared: (megatron-core's, ours, the bar's label).
_BATCH_PAIRS = (
    ("megatron_getitem", "ours_megatron", "batch of 8 (megatron)\nvs GPTDataset[i] loop"),
    ("megatron_raw", "ours_megatron", "batch of 8 (megatron)\nvs raw index loop"),
    ("megatron_getitem", "ours_native", "batch of 8 (native packing)\nvs GPTDataset[i] loop"),
)


def stream_comparisons(result: dict[str, Any]) -> list[Comparison]:
    """bench_stream.py: index build (cold) per epoch setting and batch assembly, megatron-core against ours."""
    out = []
    for row in result.get("build_summary", []):
        if "megatron_cold" in row and "ours_cold" in row:
            label = f"index build, cold\n{row['epochs']} epoch{'s' if row['epochs'] != 1 else ''}"
            out.append(
                Comparison(label, _median(row["megatron_cold"]["seconds"]), _median(row["ours_cold"]["seconds"]))
            )
    variants = result.get("batch_summary", {}).get("variants", {})
    for theirs, ours, label in _BATCH_PAIRS:
        if theirs in variants and ours in variants:
            anchor, mine = (_median(variants[v]["seconds_per_batch"]) for v in (theirs, ours))
            out.append(Comparison(label, anchor, mine))
    return _finite(out)


def preprocess_comparisons(summary: list[dict[str, Any]]) -> list[Comparison]:
    """bench_preprocess.py: documents per second, Megatron-LM's preprocess_data.py against ours."""
    out = []
    for row in summary:
        if "anchor" in row and "ours" in row:
            label = f"{row['tokenizer']} tokenizer\n{row['workers']} worker{'s' if row['workers'] != 1 else ''}"
            out.append(Comparison(label, row["anchor"]["docs_per_s"], row["ours"]["docs_per_s"], "docs/s", False))
    return _finite(out)


# -- from a script's full result to its JSON and chart --------------------------------------------
def _write(result: dict[str, Any]) -> tuple[Any, list[Comparison], str, str]:
    # The byte-identity checks of every round go into the committed summary (report_tables shows them).
    summary = {**result["summary"], "byte_identical": result.get("byte_identical", {})}
    docs, tokens = result.get("docs"), result.get("tokens")
    size = f" {docs:,} documents, {tokens / 1e6:,.0f}M tokens" if docs and tokens else ""
    return summary, write_comparisons(summary), f"Writing a shard ({size.strip()})", "megatron-core"


def _read(result: dict[str, Any]) -> tuple[Any, list[Comparison], str, str]:
    summary = result["summary"]
    reads = result.get("reads")
    what = f"{reads:,} random sequence ids per pass" if reads else "random sequence ids"
    return summary, read_comparisons(summary), f"Reading sequences ({what})", "megatron-core"


def _loader(result: dict[str, Any]) -> tuple[Any, list[Comparison], str, str]:
    summary = result["summary"]
    comparisons = loader_comparisons(summary, result["positions"])
    return summary, comparisons, "Savable loader: resume and throughput", "torchdata StatefulDataLoader"


def _stream(result: dict[str, Any]) -> tuple[Any, list[Comparison], str, str]:
    summary = {k: v for k, v in result.items() if k.endswith("_summary")}
    return summary, stream_comparisons(result), "Sample streams: index build and batch assembly", "megatron-core"


def _preprocess(result: dict[str, Any]) -> tuple[Any, list[Comparison], str, str]:
    summary = result["summary"]
    title = "Preprocessing JSON lines to bin/idx (documents/s)"
    return summary, preprocess_comparisons(summary), title, "Megatron-LM preprocess_data.py"


# name -> (the script's result file under benchmarks/out, how to read it)
SCRIPTS = {
    "bench_write": ("bench_write.json", _write),
    "bench_read": ("bench_read.json", _read),
    "bench_loader": (os.path.join("loader", "bench_loader.json"), _loader),
    "bench_stream": ("bench_stream.json", _stream),
    "bench_preprocess": ("preprocess.json", _preprocess),
}


def publish_result(name: str, result: dict[str, Any], plot: bool = True, **where: str) -> tuple[str, str | None]:
    """What each benchmark script calls at the end of a run: its summary as JSON, its chart as PNG."""
    summary, comparisons, title, anchor = SCRIPTS[name][1](result)
    paths = publish(name, result, summary, comparisons, title, anchor, plot=plot, **where)
    print(f"{name}: wrote " + ", ".join(os.path.relpath(p) for p in paths if p), file=sys.stderr)
    return paths


def main() -> None:
    """Rebuild results/*.json and docs/img/*.png from the result files of earlier runs (no benchmark runs)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("names", nargs="*", help=f"any of {', '.join(SCRIPTS)} (default: every one found)")
    parser.add_argument("--out-dir", default=os.path.join(HERE, "out"), help="where the scripts wrote their results")
    parser.add_argument("--results-dir", default=RESULTS_DIR)
    parser.add_argument("--img-dir", default=IMG_DIR)
    add_plot_argument(parser)
    args = parser.parse_args()
    unknown = sorted(set(args.names) - set(SCRIPTS))
    if unknown:
        parser.error(f"unknown name(s) {', '.join(unknown)}; choose from {', '.join(SCRIPTS)}")
    for name in args.names or SCRIPTS:
        path = os.path.join(args.out_dir, SCRIPTS[name][0])
        if not os.path.exists(path):
            print(f"{name}: no {path}, skipped")
            continue
        with open(path) as f:
            result = json.load(f)
        publish_result(name, result, not args.no_plot, results_dir=args.results_dir, img_dir=args.img_dir)


if __name__ == "__main__":
    main()
