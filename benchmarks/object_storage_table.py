"""The table and sentences of ``bench_object_storage.py``'s results (docs/benchmarks.md, docs/object-storage.md).

``benchmarks/report.py`` renders them from ``benchmarks/results/object_storage.json``; the benchmark
prints them at the end of a run.
"""

from __future__ import annotations


def _cell(stat: dict | None, scale: float = 1.0, fmt: str = "{:.3g}") -> str:
    if not stat:
        return "—"
    return f"{fmt.format(stat['median'] * scale)} ({fmt.format(stat['min'] * scale)}–{fmt.format(stat['max'] * scale)})"


def _packing(row: dict) -> str:
    return row.get("packing", "megatron")  # files before native rows were added: megatron only


def _mix(report: dict) -> dict[str, dict]:
    """Per packing: documents a sample spans and requests per sample after merging."""
    return report.get("packings") or {
        "megatron": {k: report[k] for k in ("documents_per_sample", "merged_requests_per_sample")}
    }


def markdown(report: dict) -> str:
    """The table of docs/benchmarks.md (medians, min–max over the rounds)."""
    done = report.get("rounds_done", report["rounds"])
    warmup = f" after {report['warmup_s']:g} s of warm-up" if report.get("warmup_s") else ""
    spans = "; ".join(
        f"packing: {packing}: a sample spans {m['documents_per_sample']:.2f} documents, "
        f"{m['merged_requests_per_sample']:.2f} requests after merging"
        for packing, m in _mix(report).items()
    )
    command = f"`{report['command']}`: " if report.get("command") else ""  # runs before it was recorded have none
    rows = [
        f"{command}{report['tokens'] / 1e6:.0f}M-token shard, {report['docs']:,} documents, GPTDataset num_samples "
        f"{report['num_samples']:,}, B={report['batch']}, S={report['seq']}, {report['latency_s'] * 1e3:.0f} ms "
        f"added per request, {done} rounds of {report['seconds']:g} s per row{warmup}; {spans}; first batch "
        f"identical on every loader row of the same samples: {'yes' if report['same_first_batch'] else 'NO'}.",
        "",
        "| Row | packing (requests of) | tokens/s (k) | requests/sample | client CPU ms/request "
        "| ÷ store capacity, same packing and processes | ÷ megatron-core's best (same samples) | finished |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        packing = "megatron (GPTDataset)" if r["kind"] == "megatron" else _packing(r)
        rows.append(
            f"| {name} | {packing} | {_cell(r.get('tokens_per_s'), 1e-3, '{:.0f}')} "
            f"| {_cell(r.get('requests_per_sample'), 1, '{:.2f}')} "
            f"| {_cell(r.get('client_cpu_ms_per_request'), 1, '{:.2f}')} "
            f"| {_cell(r.get('of_store_capacity'), 100, '{:.0f}%')} | {_cell(r.get('to_megatron_best'), 1, '{:.2f}×')} "
            f"| {r['finished']} |"
        )
    return "\n".join(rows + _verdict(report))


def _verdict(report: dict) -> list[str]:
    """The sentences the docs quote, from the file: ours against megatron-core's best and the store."""
    results = report["results"]
    ours = {k: v for k, v in results.items() if v["kind"] == "ours" and "tokens_per_s" in v}
    like = {k: v for k, v in ours.items() if _packing(v) == "megatron"}
    megatron = {k: v for k, v in results.items() if v["kind"] == "megatron" and "tokens_per_s" in v}
    lines = [""]
    if like and megatron:
        best_ours = max(like, key=lambda k: like[k]["tokens_per_s"]["median"])
        best_megatron = max(megatron, key=lambda k: megatron[k]["tokens_per_s"]["median"])
        lines.append(
            f"Ours' best row with megatron-core's samples ({best_ours.split(', ', 2)[-1]}, packing: megatron) against "
            f"megatron-core's best row of each round: {_cell(like[best_ours].get('to_megatron_best'), 1, '{:.2f}×')} "
            f"(megatron-core's best by median: {best_megatron.split(', ', 1)[-1]}, "
            f"{megatron[best_megatron]['tokens_per_s']['median'] / 1e3:.0f}k tokens/s)."
        )
    mix = _mix(report)
    for packing in mix:
        mine = {k: v for k, v in ours.items() if _packing(v) == packing}
        if not mine:
            continue
        capacity = [
            f"{k.split(', ', 2)[-1]}: {_cell(v.get('of_store_capacity'), 100, '{:.0f}%')}" for k, v in mine.items()
        ]
        lines.append(
            f"packing: {packing}: ours as a fraction of the store's capacity at the same requests and as many "
            "processes, " + "; ".join(capacity) + "."
        )
        built = [f"{k.split(', ', 2)[-1]}: {_cell(v['requests_per_built_sample'], 1, '{:.2f}')}"
                 for k, v in mine.items() if "requests_per_built_sample" in v]  # fmt: skip
        if built:
            lines.append(
                f"packing: {packing}: ours' requests per sample by its own counters (the samples its processes built "
                f"in the window), against {mix[packing]['documents_per_sample']:.2f} documents a sample spans and "
                f"{mix[packing]['merged_requests_per_sample']:.2f} requests after merging: " + "; ".join(built) + "."
            )
    failed = [
        f"{k} ({v['finished']})"
        for k, v in results.items()
        if v["finished"].split("/")[0] != v["finished"].split("/")[1]
    ]
    lines.append("Rows that failed in a round: " + (", ".join(failed) if failed else "none") + ".")
    return lines if len(lines) > 2 else []
