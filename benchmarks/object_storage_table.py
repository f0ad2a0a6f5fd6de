"""The table and sentences of ``bench_object_storage.py``'s results (docs/benchmarks.md, docs/object-storage.md).

``benchmarks/report.py`` renders them from ``benchmarks/results/object_storage.json``; the benchmark
prints them at the end of a run.
"""

from __future__ import annotations


def _cell(stat: dict | None, scale: float = 1.0, fmt: str = "{:.3g}") -> str:
    if not stat:
        return "—"
    return f"{fmt.format(stat['median'] * scale)} ({fmt.format(stat['min'] * scale)}–{fmt.format(stat['max'] * scale)})"


def markdown(report: dict) -> str:
    """The table of docs/benchmarks.md (medians, min–max over the rounds)."""
    done = report.get("rounds_done", report["rounds"])
    rows = [
        f"{report['tokens'] / 1e6:.0f}M-token shard, {report['docs']:,} documents, GPTDataset num_samples "
        f"{report['num_samples']:,}, B={report['batch']}, S={report['seq']}, {report['latency_s'] * 1e3:.0f} ms "
        f"added per request, {done} rounds of {report['seconds']:g} s per row; a sample spans "
        f"{report['documents_per_sample']:.2f} documents, {report['merged_requests_per_sample']:.2f} requests "
        f"after merging; first batch identical on every loader row: {'yes' if report['same_first_batch'] else 'NO'}.",
        "",
        "| Row | tokens/s (k) | requests/sample | client CPU ms/request | ÷ store capacity, same processes "
        "| ÷ megatron-core's best | finished |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        rows.append(
            f"| {name} | {_cell(r.get('tokens_per_s'), 1e-3, '{:.0f}')} "
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
    megatron = {k: v for k, v in results.items() if v["kind"] == "megatron" and "tokens_per_s" in v}
    if not ours or not megatron:
        return []
    best_ours = max(ours, key=lambda k: ours[k]["tokens_per_s"]["median"])
    best_megatron = max(megatron, key=lambda k: megatron[k]["tokens_per_s"]["median"])
    mine = ours[best_ours]
    lines = [
        "",
        f"Ours' best row ({best_ours.split(', ', 2)[-1]}) against megatron-core's best row of each round: "
        f"{_cell(mine.get('to_megatron_best'), 1, '{:.2f}×')} (megatron-core's best by median: "
        f"{best_megatron.split(', ', 1)[-1]}, {megatron[best_megatron]['tokens_per_s']['median'] / 1e3:.0f}k "
        "tokens/s).",
    ]
    capacity = [f"{k.split(', ', 2)[-1]}: {_cell(v.get('of_store_capacity'), 100, '{:.0f}%')}" for k, v in ours.items()]
    lines.append("Ours as a fraction of the store's capacity at as many processes, " + "; ".join(capacity) + ".")
    built = [f"{k.split(', ', 2)[-1]}: {_cell(v['requests_per_built_sample'], 1, '{:.2f}')}"
             for k, v in ours.items() if "requests_per_built_sample" in v]  # fmt: skip
    if built:
        lines.append(
            "Ours' requests per sample by its own counters (the samples its processes built in the window, so "
            f"batches read ahead at the window's edges do not count), against {report['documents_per_sample']:.2f} "
            "documents a sample spans: " + "; ".join(built) + "."
        )
    failed = [
        f"{k} ({v['finished']})"
        for k, v in results.items()
        if v["finished"].split("/")[0] != v["finished"].split("/")[1]
    ]
    lines.append("Rows that failed in a round: " + (", ".join(failed) if failed else "none") + ".")
    return lines
