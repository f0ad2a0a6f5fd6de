"""Generators of ``report.py`` for the tables that were written by hand (issue 26): write, read,
preprocess, loader, stream, worker_pool, collectives.

Each makes its table from the committed ``benchmarks/results/<name>.json`` alone. Where an older file
lacks a figure the table used to show, the cell says so ("not in the results file") instead of
repeating the old figure.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from provenance import RESULTS  # noqa: E402

NOT_IN_FILE = "not in the results file"


def load(name: str) -> dict | None:
    path = os.path.join(RESULTS, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def missing(name: str, command: str) -> str:
    return f"Not recorded: `benchmarks/results/{name}.json` does not exist yet; to measure, run `{command}`.\n"


def from_results(name: str, script: str | None = None) -> Callable[[Callable[..., str]], Callable[..., str]]:
    """A generator made from ``benchmarks/results/<name>.json``: the decorated function receives the loaded
    record before its block's arguments. When the file does not exist, the block says so and names the
    command that makes it (``python benchmarks/<script>.py``; ``script`` defaults to ``name``)."""

    def decorate(make: Callable[..., str]) -> Callable[..., str]:
        @functools.wraps(make)
        def generate(*args: str) -> str:
            record = load(name)
            if record is None:
                return missing(name, f"python benchmarks/{script or name}.py")
            return make(record, *args)

        return generate

    return decorate


def _mmm(stat: dict, scale: float = 1.0, digits: int = 2) -> str:
    return f"{stat['median'] * scale:,.{digits}f} ({stat['min'] * scale:,.{digits}f}–{stat['max'] * scale:,.{digits}f})"


def preprocess_bpe() -> str:
    """The like-for-like preprocessing row: one tokenizer.json for ours and datatrove (``--sections bpe``)."""
    from preprocess_ray_tables import BPE_COMMAND, render_bpe

    record = load("bench_preprocess_ray_bpe")
    if record is None:
        return missing("bench_preprocess_ray_bpe", BPE_COMMAND)
    return render_bpe(record) + "\n"


@from_results("bench_write")
def write(record: dict) -> str:
    """Writing 1M documents: statefulset's writers against megatron-core's builder (bench_write.py)."""
    from bench_write import FLOORS, LABELS, table_row

    s = record["summary"]
    runs = len(s["megatron"]["paired_speedups_vs_megatron"])
    same = s.get("byte_identical") or {}
    header = ("| Variant | Time, s | adds / close, s | CPU user / sys, s | docs/s | tokens/s | vs megatron "
              "| vs megatron + fsync | Extra peak RSS | Byte-identical to megatron |")  # fmt: skip
    rows = [f"`{record.get('command', 'python benchmarks/bench_write.py')}`: median (min–max) of {runs} runs per "
            "variant, one fresh process each. Ratios: of the medians (range of the per-round ratios).", "",
            header, "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in ("megatron", "megatron_fsync", "ours_vectorised", "ours_loop"):
        if name.startswith("megatron"):
            text = "(reference)"
        elif name in same:
            text = f"{'yes' if all(same[name]) else '**NO**'} ({sum(same[name])}/{len(same[name])} runs)"
        else:
            text = NOT_IN_FILE
        rows.append(table_row(LABELS[name], s[name], text))
    rows += ["", "Floors on the same data in the same rounds (not writers: no `.idx`):", "", header, rows[3]]
    rows += [table_row(LABELS[name], s[name], "n/a") for name in FLOORS]
    return "\n".join(rows) + "\n"


@from_results("bench_read")
def read(record: dict) -> str:
    """Random sequence reads: statefulset's IndexedDataset against megatron-core's (bench_read.py)."""
    from bench_read import LABELS, READERS

    s = record["summary"]
    rows = [f"`{record.get('command', 'python benchmarks/bench_read.py')}`: "
            f"{len(s['ours']['paired_speedups_vs_megatron'])} passes per reader. Throughput: median (best) "
            "over passes; ratio: of the medians (range of the per-pass ratios); latency: every timed read, pooled.",
            "", "| Reader | sequences/s | tokens/s | vs megatron | p50 / p99 latency | first full pass | open |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in READERS:
        r, lat = s[name], s[name]["latency_us"]
        paired = r["paired_speedups_vs_megatron"]
        rows.append(f"| {LABELS[name]} | {r['sequences_per_s']:,.0f} ({r['sequences_per_s_best']:,.0f}) "
                    f"| {r['tokens_per_s'] / 1e6:,.0f}M | **{r['speedup_vs_megatron']:.2f}×** "
                    f"({min(paired):.2f}–{max(paired):.2f}) | {lat['p50']:.1f} µs / {lat['p99']:.1f} µs "
                    f"| {r['first_full_pass_s']:.2f} s | {r['open_s'] * 1e3:.1f} ms |")  # fmt: skip
    return "\n".join(rows) + "\n"


@from_results("bench_preprocess")
def preprocess(record: dict) -> str:
    """JSON lines to bin/idx against Megatron-LM's preprocess_data.py loop (bench_preprocess.py)."""
    median = "median_s" in record["summary"][0]["ours"]  # older files: the best run was the headline
    rows = [("Seconds: median (min–max) of each configuration's runs; docs/s and tokens/s of the median run; "
             "ours / anchor: the median of the per-round ratios (min–max)." if median else
             "Best run of each configuration (the script's headline), then the median (min–max) of its runs."), "",
            "| Tokenizer | Workers | Anchor, s: best; median (min–max) | Anchor docs/s | Ours, s: best; median "
            "(min–max) | Ours docs/s | Ours tokens/s | Ours / anchor | Ours, 1 thread: docs/s (ratio) "
            "| Byte-identical `.bin` + `.idx` |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in record["summary"]:
        a, o, same = r["anchor"], r["ours"], r["byte_identical"]
        serial = f"{r['ours_serial']['docs_per_s']:,.0f} ({r['ratio_serial']:.2f}×)" if "ours_serial" in r else "="
        rows.append(f"| {r['tokenizer']} | {r['workers']} | {a['best_s']:.1f}; {_mmm(a['seconds'], digits=1)} "
                    f"| {a['docs_per_s']:,.0f} | {o['best_s']:.1f}; {_mmm(o['seconds'], digits=1)} "
                    f"| {o['docs_per_s']:,.0f} | {o['tokens_per_s'] / 1e6:,.2f}M "
                    f"| **{r['ratio']:.2f}×**{_ratio_range(r)}{'' if r['target_met'] else ' (below target)'} "
                    f"| {serial} "
                    f"| {'yes' if all(same) else '**NO**'} ({sum(same)}/{len(same)} runs) |")  # fmt: skip
    return "\n".join(rows) + "\n"


def _ratio_range(row: dict) -> str:
    stat = row.get("ratio_rounds")
    return f" ({stat['min']:.2f}–{stat['max']:.2f})" if stat else ""


@from_results("bench_loader")
def loader(record: dict) -> str:
    """Resume, state size and throughput against torchdata's StatefulDataLoader (bench_loader.py)."""
    from bench_loader import tables

    return tables(record)


@from_results("bench_stream")
def stream(record: dict, part: str) -> str:
    """One part (build, native, firstuse, batch) of bench_stream.py's tables."""
    from bench_stream import part_markdown

    if part == "batch":  # a later run of `bench_stream.py --parts batch` alone, kept in its own file
        record = load("bench_stream_batch") or record
    return part_markdown({**record, **record["summary"]}, part) + "\n"


@from_results("bench_worker_pool")
def worker_pool(record: dict) -> str:
    """preprocess --workers 2 with our pool, loky and one process (bench_worker_pool.py)."""
    executors = list(dict.fromkeys(r["executor"] for r in record["rows"]))
    load_after = record.get("load_average_after") or (record.get("provenance") or {}).get("load_average")
    rows = [f"Median [min .. max] of {record['runs']} interleaved runs, seconds, {record['workers']} workers"
            + (f"; load average {load_after[0]} after the run." if load_after else "."), "",
            "| input | " + " | ".join(e.replace("statefulset pool", "our pool") for e in executors) + " |",
            "|---|" + "---|" * len(executors)]  # fmt: skip
    for scale in dict.fromkeys(r["scale"] for r in record["rows"]):
        cells = {r["executor"]: r for r in record["rows"] if r["scale"] == scale}
        mib = next(iter(cells.values()))["input_mib_on_disk"]
        rows.append(f"| {mib:.1f} MiB on disk | " + " | ".join(
            f"{_sig(cells[e]['median'])} [{_sig(cells[e]['min'])} .. {_sig(cells[e]['max'])}]" for e in executors)
            + " |")  # fmt: skip
    return "\n".join(rows) + "\n"


def _sig(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


@from_results("bench_collectives")
def collectives(record: dict) -> str:
    """save_state_global / restore_state_global against the object collectives (bench_collectives.py)."""
    from bench_collectives import markdown

    return markdown(record) + "\n"


def concurrent_open() -> str:
    """Six unprepared opens at once against one alone, whole-process CPU (bench_concurrent_open.py)."""
    rows = ["| | one process, CPU s | six at once, CPU s | six / one | open CPU, six / one |", "|---|---|---|---|---|"]
    for name, label in (("bench_concurrent_open_before", "before"), ("bench_concurrent_open", "now")):
        record = load(name)
        if record is None:
            rows.append(f"| {label} | {missing(name, 'python benchmarks/bench_concurrent_open.py').strip()} | | | |")
            continue
        where = f"`{record['git']['head'][:7]}`" + (f", `{name}.json`" if label == "before" else "")
        ratio = f"{_mmm(record['ratio_total_cpu'])}×"
        ratio = ratio if label == "before" else f"**{ratio}**"
        rows.append(f"| {label} ({where}) | {_mmm(record['one_total_cpu_s'])} | {_mmm(record['many_total_cpu_s'])} "
                    f"| {ratio} | {_mmm(record['ratio_open_cpu'])}× |")  # fmt: skip
    return "\n".join(rows) + "\n"


@from_results("bench_metrics")
def metrics(record: dict) -> str:
    """Throughput with metrics() read every step or every 10th against never (bench_metrics.py)."""
    runs = len(next(iter(record["sizes"].values()))["batches_per_second_runs"]["never_read"])
    rows = [f"{record['workers']} workers, {record['batches_per_run']:,} batches a run; median (min–max) of {runs} "
            "runs; ratios of the medians, and of blocks that read and blocks that do not alternating in one loader.",
            "", "| batch | never read, batches/s | read every step | read every 10th | every step ÷ never "
            "| every 10th ÷ never | every step ÷ never, paired | every 10th ÷ never, paired |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for size, r in record["sizes"].items():
        b, q = r["batches_per_second"], r["throughput_ratio"]
        # Runs before the paired every-10th ratio was added have none.
        tenth = _mmm(r["paired_ratio_every_10"]) if "paired_ratio_every_10" in r else "not measured"
        rows.append(f"| {size} | {_mmm(b['never_read'], digits=0)} | {_mmm(b['read_every_step'], digits=0)} "
                    f"| {_mmm(b['read_every_10_steps'], digits=0)} | {q['read_every_step']:.3f} "
                    f"| {q['read_every_10_steps']:.3f} | {_mmm(r['paired_ratio'])} | {tenth} |")  # fmt: skip
    rows += metrics_cpu(record)
    call = record["call_us"]
    rows += ["", f"One `metrics()` read alone: {_mmm(call['metrics_us'], digits=1)} µs; `across_ranks=True` on one "
                 f"rank {_mmm(call['metrics_across_ranks_us'], digits=1)} µs."]  # fmt: skip
    return "\n".join(rows) + "\n"


def metrics_cpu(record: dict) -> list[str]:
    """The same blocks' CPU time (bench_metrics.paired): on / off throughput when CPU bounds it, trainer alone and
    trainer + workers, for reading every step, every 10th, and counting against a loop without it; then what a
    read costs inside the loop and the ratios that cost and counting's give (bench_metrics.accounted)."""
    if not all("paired" in r for r in record["sizes"].values()):  # runs before the CPU time was recorded
        return ["", "CPU time of the paired blocks: not measured in this results file."]
    rows = ["", "The same alternating blocks by CPU time (µs a batch are the off side's, the median block's; ratios "
            "are on ÷ off throughput when that CPU time bounds it: off CPU ÷ on CPU):", "",
            "| batch | CPU µs a batch: trainer / + workers | every step ÷ never: trainer / + workers "
            "| every 10th ÷ never: trainer / + workers | counting on ÷ off: trainer / + workers |",
            "|---|---|---|---|---|"]  # fmt: skip
    for size, r in record["sizes"].items():
        p = r["paired"]
        cpu = f"{_mmm(p['read_every_step']['off_trainer_cpu_us_per_batch'], digits=1)} / " + _mmm(
            p["read_every_step"]["off_total_cpu_us_per_batch"], digits=1
        )
        cells = [f"{_mmm(p[k]['trainer_cpu'], digits=3)} / {_mmm(p[k]['total_cpu'], digits=3)}"
                 for k in ("read_every_step", "read_every_10_steps", "counting")]  # fmt: skip
        rows.append(f"| {size} | {cpu} | " + " | ".join(cells) + " |")
    if not all("accounted" in r for r in record["sizes"].values()):
        return rows
    counting = record["call_us"]["counting_ns"]
    rows += ["", f"Accounted: a read's trainer CPU inside the loop, read every 1, 10 or 100 batches (the "
             "trainer thread's CPU time around each read less an empty bracket's; medians of the runs), and "
             f"counting's ({_mmm(counting, digits=0)} ns a batch alone), against the CPU µs a batch above: on ÷ off "
             "throughput when the trainer's CPU / all CPU bounds it:", "",
             "| batch | a read in the loop, µs: every step / 10th / 100th | read every step | every 10th | every 100th "
             "| counting on ÷ off |", "|---|---|---|---|---|---|"]  # fmt: skip
    for size, r in record["sizes"].items():
        a, n = r["accounted"], ("1", "10", "100")
        reads = " / ".join(f"{r['read_in_loop_us'][f'every_{k}_steps']['median']:.2f}" for k in n)
        cells = [" / ".join(f"{a[f'read_every_{k}_steps'][f]:.3f}" for f in ("trainer", "total")) for k in n]
        cells.append(f"{a['counting']['trainer']:.3f} / {a['counting']['total']:.3f}")
        rows.append(f"| {size} | {reads} | " + " | ".join(cells) + " |")
    return rows


@from_results("bench_loss_masks")
def loss_masks(record: dict) -> str:
    """Batch assembly with a mask shard against without, per packing; preprocess of segments (bench_loss_masks.py)."""
    a = record["arguments"]
    rows = [f"Batches of {a['batch_size']} × {a['seq_length'] + 1}, {a['batches']:,} batches a run; median (min–max) "
            f"of {a['runs']} runs, plain and masked alternating.", "",
            "| packing | plain, µs a batch | masked, µs a batch | masked ÷ plain (target ≤ 1.15) |",
            "|---|---|---|---|"]  # fmt: skip
    for packing, r in record["assembly"].items():
        q = r["masked_over_plain"]
        verdict = "met" if q["median"] <= 1.15 else "missed"
        rows.append(f"| {packing} | {_mmm(r['plain'], 1e6, 0)} | {_mmm(r['masked'], 1e6, 0)} "
                    f"| {_mmm(q)} ({verdict}) |")  # fmt: skip
    p = record["preprocess"]
    ratio = _mmm(p["segments_over_plain"])
    rows += ["", f"`preprocess` docs/s: segment lists {_mmm(p['segments'], digits=0)}, the same texts as plain "
                 f"strings {_mmm(p['plain'], digits=0)}; segments ÷ plain {ratio}."]  # fmt: skip
    return "\n".join(rows) + "\n"


@from_results("bench_task_encoder")
def task_encoder(record: dict) -> str:
    """Tokens/s with a task encoder against none, the rounds alternating (bench_task_encoder.py)."""
    c, t, q = record["config"], record["tokens_per_s"], record["ratio_to_none"]
    labels = {"none": "no encoder", "identity": "identity encoder", "rng": "drawing from the keyed `rng`",
              "identity_keyed": "identity under `@stateless(restore_seeds=True)`",
              "fim": "`FillInTheMiddle`, token mode (rate 0.5, SPM 0.5, EOD segments)"}  # fmt: skip
    rows = [f"Micro-batches of {c['batch_size']} × {c['seq_length'] + 1}, {c['workers']} workers, {c['batches']:,} "
            f"batches a run; median (min–max) of {len(t['none']['runs'])} rounds, the encoders alternating.", "",
            "| encoder | tokens/s | ÷ no encoder, per round |", "|---|---|---|"]  # fmt: skip
    for name, r in t.items():
        ratio = _mmm(q[name]) if name in q else "1"
        rows.append(f"| {labels.get(name, name)} | {_mmm(r, 1e-6, 1)}M | {ratio} |")
    return "\n".join(rows) + "\n"


@from_results("bench_fim")
def fim(record: dict) -> str:
    """FIM in token and tokenizer mode against no encoder; tokenizer mode per sample (bench_fim.py)."""
    t, q, s = record["tokens_per_s"], record["over_no_encoder"], record["tokenizer_mode_per_sample"]
    labels = {"none": "no encoder", "fim_tokens": "FIM, token mode", "fim_tokenizer": "FIM, tokenizer mode"}
    rows = [f"{record['documents']:,} documents, {record['batches']:,} batches a run; median (min–max) of "
            f"{len(t['none']['runs'])} runs.", "", "| encoder | tokens/s | ÷ no encoder |",
            "|---|---|---|"]  # fmt: skip
    rows += [f"| {labels.get(n, n)} | {_mmm(r, 1e-6, 2)}M | {_mmm(q[n], digits=3)} |" for n, r in t.items()]
    per = s["samples_per_s"]
    ours, theirs = _mmm(per["statefulset"], digits=0), _mmm(per["megatron_lm_recreation"], digits=0)
    rows += ["", f"Tokenizer mode per sample ({s['samples']:,} samples): statefulset {ours} samples/s, a "
                 f"recreation of Megatron-LM's per-sample loop {theirs}; ours ÷ Megatron-LM "
                 f"{_mmm(s['ours_over_megatron'])}."]  # fmt: skip
    return "\n".join(rows) + "\n"


def packing_setup(record: dict) -> str:
    """The line above a packing table: how many documents and what sample size that run used."""
    size = record.get("window_samples")
    windows = f", bestfit windows of {size:,} samples' worth" if size else ""
    return (f"`{record.get('command', 'python benchmarks/bench_packing.py')}`: {record['documents']:,} documents, "
            f"samples of {record['capacity']:,} tokens{windows}.\n\n")  # fmt: skip


BOUNDARY_PLACES = (("in process", "in process"), ("in a worker", "in a worker"), ("2 workers", "through 2 workers"))


@from_results("bench_packing")
def boundaries(record: dict) -> str:
    """Batch assembly with ``document_boundaries=True`` against without, per packing and place
    (bench_packing.py's ``assembly`` section): the median (min–max) of the per-round slowdowns, and
    the CPU µs a batch without → with (through 2 workers: the trainer's and its workers')."""
    if "assembly" not in record:
        return "Not measured in this results file (`bench_packing.py` without `--no-assembly` measures it).\n"
    rows = ["| packing | " + " | ".join(label for _, label in BOUNDARY_PLACES) + " |", "|---|---|---|---|"]
    shares: dict[str, float] = {}
    for packing, r in record["assembly"].items():
        cells = []
        for where, _ in BOUNDARY_PLACES:
            s = r[f"{where}, slowdown"]
            cpu = (r[f"{where}, {side}, cpu us per batch"]["median"] for side in ("without", "with"))
            low, mid, high = (_percent(s[k]) for k in ("min", "median", "max"))
            cells.append(f"{mid}% [{low} .. {high}] " + "({:.0f} → {:.0f} µs)".format(*cpu))
            shares[f"{packing} {_label(where)}"] = s["median"]
        rows.append(f"| {packing} | " + " | ".join(cells) + " |")
    missed = [name for name, share in shares.items() if share > 0.15]
    verdict = f"missed for {', '.join(missed)}" if missed else "met everywhere"
    rows += ["", f"Target (the fields cost ≤ 15% of batch assembly): {verdict}."]
    return "\n".join(rows) + "\n"


def _label(where: str) -> str:
    return dict(BOUNDARY_PLACES)[where]


def _percent(share: float) -> str:
    return f"{round(100 * share) or 0}"  # no "-0"
