"""The markdown tables of ``bench_preprocess_ray.py``'s results, for ``report.py`` and ``--render``.

``render`` makes the compare, scaling, memory, tasks and merge tables of
``benchmarks/results/bench_preprocess_ray.json`` (and the line of the 400,000-document file when
there is one); ``render_bpe`` the like-for-like table of ``bench_preprocess_ray_bpe.json``. Every
figure is the median (min–max) of the run's alternating rounds, and a ratio the median (min–max)
of the per-round ratios.
"""

from __future__ import annotations

COMMAND = "python benchmarks/bench_preprocess_ray.py --rounds 3 --datatrove-python /path/to/datatrove-venv/bin/python"
BPE_COMMAND = (
    "python benchmarks/bench_preprocess_ray.py --sections bpe --tokenizers bpe --rounds 3 "
    "--datatrove-python /path/to/datatrove-venv/bin/python --out bench_preprocess_ray_bpe.json"
)
LARGE_COMMAND = (
    "python benchmarks/bench_preprocess_ray.py --docs 400000 --tokenizers bpe --only-ours --sections compare "
    "--rounds 3 --out bench_preprocess_ray_400k.json"
)
NAMES = {
    "ours_workers_2": "statefulset `--workers 2`",
    "ours_ray": "statefulset `--executor ray` (local Ray)",
    "datatrove": "datatrove `MegatronDocumentTokenizer`, 8 tasks, 2 workers",
    "preprocess_data_py": "`preprocess_data.py` loop, 2 workers",
}


def mmm(stat: dict, form: str) -> str:
    """``median (min–max)`` of a ``provenance.summary``, each formatted with ``form``."""
    if stat["min"] == stat["max"]:
        return format(stat["median"], form)
    return f"{format(stat['median'], form)} ({format(stat['min'], form)}–{format(stat['max'], form)})"


def _rate(stat: dict) -> str:
    """Tokens/s in millions."""
    return mmm({k: stat[k] / 1e6 for k in ("median", "min", "max")}, ".2f") + "M"


def _cpu(r: dict) -> str:
    """CPU ms per document (user + system of the command's session, sampled every 0.2 s), if measured."""
    return mmm(r["cpu_ms_per_doc"], ".2f") if "cpu_ms_per_doc" in r else "-"


def _compare(section: dict, docs: int) -> list[str]:
    out = [f"{docs:,} documents, median (min–max) of {section['rounds']} alternating rounds (every tool once "
           "a round, in turn), every row a fresh process; ratios are the median (min–max) of the per-round ratios:",
           "", "| tokenizer | tool | s | docs/s | tokens/s | CPU ms per document | ÷ `--workers 2` | Ray ÷ this |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for tok in ("bytes", "bpe"):
        row = section.get(tok)
        if row is None:
            continue
        for key, label in NAMES.items():
            if key not in row:
                continue
            r = row[key]
            ray = "1.00x" if key == "ours_ray" else mmm(r["ray_over_this"], ".2f") + "x"
            if key == "datatrove" and tok == "bytes":  # its byte-level BPE pipeline against our str.encode
                label += " (a `tokenizers` pipeline: not the same tokenizer as ours)"
                ray += ", not like for like"
            base = "1.00x" if key == "ours_workers_2" else mmm(r["over_workers_2"], ".2f") + "x"
            out.append(f"| {tok} | {label} | {mmm(r['seconds'], '.1f')} | {mmm(r['docs_per_s'], ',.0f')} | "
                       f"{_rate(r['tokens_per_s'])} | {_cpu(r)} | {base} | {ray} |")  # fmt: skip
    same = ", ".join(f"{tok} {section[tok]['identical']}" for tok in ("bytes", "bpe") if tok in section)
    return [*out, "", f"`--workers 2` and `--executor ray` outputs byte for byte identical in every round: {same}."]


def _scaling(section: dict, docs: int) -> list[str]:
    out = [f"| BPE, {docs:,} documents, {section['rounds']} alternating rounds | s | docs/s | tokens/s | "
           "CPU ms per document | ÷ `--workers 2` | peak task memory |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for key, r in section.items():
        if not isinstance(r, dict) or "seconds" not in r:
            continue
        mem = mmm(r["peak_task_mib"], ",.0f") + " MiB" if "peak_task_mib" in r else "-"
        base = "1.00x" if key == "workers_2" else mmm(r["over_workers_2"], ".2f") + "x"
        out.append(f"| {key.replace('_', ' ')} | {mmm(r['seconds'], '.1f')} | {mmm(r['docs_per_s'], ',.0f')} | "
                   f"{_rate(r['tokens_per_s'])} | {_cpu(r)} | {base} | {mem} |")  # fmt: skip
    return out


def _memory(section: dict) -> list[str]:
    out = [f"| memory: input (bytes tokenizer, Ray, one task), {section['rounds']} rounds | input bytes | s | "
           "peak task memory |", "|---|---|---|---|"]  # fmt: skip
    for key in ("tiny", "plain", "gzip"):
        r = section[key]
        out.append(f"| {key} | {r['input_bytes']:,} | {mmm(r['seconds'], '.1f')} | "
                   f"{mmm(r['peak_task_mib'], ',.0f')} MiB |")  # fmt: skip
    return out


def _tasks(section: dict) -> list[str]:
    few, many = section["few"], section["many"]
    return [f"Tasks (bytes tokenizer, Ray, {section['rounds']} alternating rounds): {few['tasks']:,} tasks of "
            f"{few['task_bytes']:,} bytes {mmm(few['seconds'], '.1f')} s, {many['tasks']:,} tasks of "
            f"{many['task_bytes']:,} bytes {mmm(many['seconds'], '.1f')} s: "
            f"{mmm(section['ms_per_extra_task'], '.1f')} ms per extra task (per round)."]  # fmt: skip


def _merge(m: dict) -> list[str]:
    return [f"Merge alone ({m['rounds']} runs, page cache warm): {m['bytes']:,} bytes in "
            f"{mmm(m['seconds'], '.2f')} s, {mmm(m['gb_per_s'], '.2f')} GB/s."]  # fmt: skip


def _large(large: dict) -> list[str]:
    row = large["rows"]["bpe"]
    w2, ray = row["ours_workers_2"], row["ours_ray"]
    head = f"{large['docs']:,} documents ({large['corpus_bytes'] / 1e6:,.0f} MB), BPE"
    return [f"{head}, {large['rows']['rounds']} alternating rounds: `--workers 2` {mmm(w2['seconds'], '.1f')} s, "
            f"`--executor ray` {mmm(ray['seconds'], '.1f')} s: Ray at {mmm(ray['over_workers_2'], '.2f')}x "
            f"(per round); outputs identical: {row['identical']}."]  # fmt: skip


def render(results: dict, large: dict | None = None) -> str:
    """The markdown tables of docs/benchmarks.md from a saved run (the sections it holds)."""
    out: list[str] = []
    if "rows" in results:
        out += _compare(results["rows"], results["docs"])
    if large:
        out += ["", *_large(large)]
    for key, make in (("scaling_bpe", lambda s: _scaling(s, results["docs"])), ("memory", _memory),
                      ("tasks", _tasks), ("merge", _merge)):  # fmt: skip
        if key in results:
            out += ["", *make(results[key])]
    return "\n".join(out).lstrip("\n")


def render_bpe(record: dict) -> str:
    """The like-for-like table (``--sections bpe``): one ``tokenizer.json`` on both sides."""
    row = record["bpe"]
    names = {"ours_workers_2": "statefulset `--workers 2`", "ours_ray": "statefulset `--executor ray` (local Ray)",
             "datatrove": "datatrove `MegatronDocumentTokenizer`, 8 tasks, 2 workers",
             "ours_pipeline_workers_2": "statefulset `--workers 2`, every text through `tokenizers`' pipeline "
                                        "(`STATEFULSET_PIECE_CACHE=0`), one run"}  # fmt: skip
    venv = row.get("datatrove_venv", {})
    dt = f"datatrove {venv.get('datatrove', '?')} with tokenizers {venv.get('tokenizers', '?')} in its own venv"
    out = [f"{record['docs']:,} documents ({record['corpus_bytes'] / 1e6:,.0f} MB), BPE, median (min–max) of "
           f"{row['rounds']} alternating rounds, every row a fresh process; {dt}:", "",
           "| tool | s | docs/s | CPU ms per document | ÷ datatrove (docs/s, per round) |",
           "|---|---|---|---|---|"]  # fmt: skip
    base = row["datatrove"]["docs_per_s"]["median"]
    for key, label in names.items():
        if key not in row:
            continue
        r, q = row[key], row.get(f"{key}_over_datatrove")
        over = mmm(q, ".2f") + "x" if q else f"{r['docs_per_s']['median'] / base:.2f}x"
        cpu = mmm(r["cpu_ms_per_doc"], ".2f") + (" (Ray's own processes may be missed)" if key == "ours_ray" else "")
        out.append(f"| {label} | {mmm(r['seconds'], '.1f')} | {mmm(r['docs_per_s'], ',.0f')} | {cpu} | {over} |")
    best = row["ours_workers_2_over_datatrove"]["median"]
    same = [f"with the pipeline: {row['identical_to_pipeline']}"]
    same += [f"with `--executor ray`: {row['identical_to_ray']}"] if "identical_to_ray" in row else []
    out += ["", f"Target ≥ 1.5× datatrove's documents/s with the same `tokenizer.json`: "
            f"**{'met' if best >= 1.5 else 'missed'}** ({best:.2f}× with `--workers 2`). "
            f"Outputs byte for byte identical {', '.join(same)}."]  # fmt: skip
    return "\n".join(out)
