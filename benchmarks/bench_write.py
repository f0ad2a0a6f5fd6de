"""Writing a bin/idx shard: megatron-core's ``IndexedDatasetBuilder`` against ``IndexedDatasetWriter``.

Variants, all writing the same in-memory corpus (see ``corpus.py``) to ``benchmarks/out/``:

* ``megatron``: ``IndexedDatasetBuilder``, one ``add_document(slice, [n])`` per document, then
  ``finalize``. This is the anchor's best case (no tokenisation, no Python lists of tokens).
* ``ours_vectorised``: ``IndexedDatasetWriter.add_documents`` (one call, or ``--chunk-docs`` per call).
* ``ours_loop``: ``IndexedDatasetWriter.add_document(slice)`` once per document.
* ``floor_buffered`` / ``floor_direct`` (references, not writers: no ``.idx``): the token array
  written with one buffered ``write`` + fsync, and with ``O_DIRECT``. They show what the 1 GB
  itself costs on the machine, so a writer's overhead above it can be told from the I/O.

Each run is a fresh child process that generates the corpus (not timed), then times writer
construction + adds + ``finalize``/``close``. ``close`` fsyncs both files (it is atomic and
durable); ``finalize`` does not, so after its timer stops the megatron child fsyncs its files and
reports that time separately ("durability parity"). As a side effect no variant leaves dirty
pages behind for the next one. Peak RSS is the child's ``VmHWM`` reset right after generation, so
it counts only what the writer adds on top of the 1 GB token array. User and system CPU of the
timed part come from ``getrusage``.

Output: a markdown table on stdout, and ``benchmarks/out/bench_write.json``.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import mmap
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy
from benchenv import (
    environment,
    environment_markdown,
    git_state,
    load_average,
    reset_peak_rss,
    spread,
    vm_status,
)
from corpus import DTYPE, OUT_DIR, add_docs_argument, make_corpus
from plots import add_plot_argument, apply_quick, publish_result

WRITERS = ("megatron", "ours_vectorised", "ours_loop")
# Not writers (no .idx): what writing the same 1 GB costs with nothing else around it.
FLOORS = ("floor_buffered", "floor_direct")
VARIANTS = WRITERS + FLOORS
_DIRECT_STAGE = 64 << 20
LABELS = {
    "megatron": "megatron-core `IndexedDatasetBuilder.add_document` loop + `finalize`",
    "megatron_fsync": "megatron-core, plus fsync of both files (durability parity)",
    "ours_vectorised": "statefulset `IndexedDatasetWriter.add_documents` + `close`",
    "ours_loop": "statefulset `IndexedDatasetWriter.add_document` loop + `close`",
    "floor_buffered": "floor: one buffered `write` of the token array + fsync (no index)",
    "floor_direct": "floor: `O_DIRECT` writes of the token array, 64 MiB at a time + fsync (no index)",
}


def prefix_for(out_dir: str, variant: str) -> str:
    """Where a variant writes: ``<out_dir>/<variant>_text_document.{bin,idx}``."""
    return os.path.join(out_dir, f"{variant}_text_document")


def _remove(prefix: str) -> None:
    for ext in (".bin", ".idx"):
        if os.path.exists(prefix + ext):
            os.remove(prefix + ext)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- child side: one variant, one run -----------------------------------------------------------
def _snap() -> tuple[float, float, float]:
    """Wall clock and this process's user and system CPU seconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), usage.ru_utime, usage.ru_stime


def _timings(t0: tuple[float, ...], t1: tuple[float, ...], t2: tuple[float, ...]) -> dict[str, float]:
    # user/sys split the wall time: sys is mostly the kernel finding page-cache pages (see the docs).
    return {
        "add_s": t1[0] - t0[0],
        "close_s": t2[0] - t1[0],
        "total_s": t2[0] - t0[0],
        "user_s": t2[1] - t0[1],
        "sys_s": t2[2] - t0[2],
    }


def _write_megatron(prefix: str, tokens: numpy.ndarray, starts: list[int], lens: list[int]) -> dict[str, Any]:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    t0 = _snap()
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DTYPE)
    for start, n in zip(starts, lens, strict=True):
        builder.add_document(tokens[start : start + n], [n])
    t1 = _snap()
    builder.finalize(prefix + ".idx")
    t2 = _snap()
    # Not part of the timed figure: what it would cost to make megatron's output durable too.
    _fsync_path(prefix + ".bin")
    _fsync_path(prefix + ".idx")
    return {**_timings(t0, t1, t2), "fsync_after_s": time.perf_counter() - t2[0]}


def _write_ours_vectorised(
    prefix: str, tokens: numpy.ndarray, lengths: numpy.ndarray, chunk_docs: int
) -> dict[str, Any]:
    from statefulset import IndexedDatasetWriter

    chunk = chunk_docs if chunk_docs > 0 else lengths.size
    bounds = numpy.concatenate([[0], numpy.cumsum(lengths)])
    t0 = _snap()
    writer = IndexedDatasetWriter(prefix, DTYPE)
    for d in range(0, lengths.size, chunk):
        e = min(d + chunk, lengths.size)
        writer.add_documents(tokens[bounds[d] : bounds[e]], lengths[d:e])
    t1 = _snap()
    writer.close()
    t2 = _snap()
    return {**_timings(t0, t1, t2), "calls": -(-lengths.size // chunk)}


def _write_ours_loop(prefix: str, tokens: numpy.ndarray, starts: list[int], lens: list[int]) -> dict[str, Any]:
    from statefulset import IndexedDatasetWriter

    t0 = _snap()
    writer = IndexedDatasetWriter(prefix, DTYPE)
    for start, n in zip(starts, lens, strict=True):
        writer.add_document(tokens[start : start + n])
    t1 = _snap()
    writer.close()
    t2 = _snap()
    return _timings(t0, t1, t2)


def _floor_buffered(prefix: str, tokens: numpy.ndarray) -> dict[str, Any]:
    # The least any writer going through the page cache can do: the tokens, once, then fsync.
    t0 = _snap()
    with open(prefix + ".bin", "wb") as f:
        f.write(tokens.data)
        t1 = _snap()
        f.flush()
        os.fsync(f.fileno())
    t2 = _snap()
    return _timings(t0, t1, t2)


def _floor_direct(prefix: str, tokens: numpy.ndarray) -> dict[str, Any]:
    # O_DIRECT skips the page cache, so no page-cache pages are allocated (see the docs on why that
    # matters on this VM). It needs block-aligned buffers: stage through a page-aligned anonymous map.
    stage = mmap.mmap(-1, _DIRECT_STAGE)
    staged = numpy.frombuffer(stage, numpy.uint8)
    src = tokens.view(numpy.uint8)
    t0 = _snap()
    fd = os.open(prefix + ".bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for off in range(0, src.size, _DIRECT_STAGE):
            k = min(_DIRECT_STAGE, src.size - off)
            staged[:k] = src[off : off + k]
            os.write(fd, memoryview(stage)[: -(-k // 4096) * 4096])
        os.ftruncate(fd, src.size)  # drop the padding of the last block
        t1 = _snap()
        os.fsync(fd)
    finally:
        os.close(fd)
    t2 = _snap()
    return _timings(t0, t1, t2)


def run_child(variant: str, docs: int, out_dir: str, chunk_docs: int, result_path: str) -> None:
    """Generate the corpus, write it with one variant, and dump timings and memory to ``result_path``."""
    # Every child imports the same modules, so their RSS baselines are the same.
    import megatron.core.datasets.indexed_dataset  # noqa: F401
    import torch  # noqa: F401

    import statefulset  # noqa: F401

    t0 = time.perf_counter()
    tokens, lengths = make_corpus(docs)
    ends = numpy.cumsum(lengths)
    # Python ints made before the timer: both per-document loops then pay the same slicing cost.
    starts, lens = (ends - lengths).tolist(), lengths.tolist()
    generate_s = time.perf_counter() - t0
    before = vm_status()
    load = load_average()
    reset = reset_peak_rss()
    prefix = prefix_for(out_dir, variant)
    if variant == "megatron":
        result = _write_megatron(prefix, tokens, starts, lens)
    elif variant == "ours_vectorised":
        result = _write_ours_vectorised(prefix, tokens, lengths, chunk_docs)
    elif variant == "ours_loop":
        result = _write_ours_loop(prefix, tokens, starts, lens)
    elif variant == "floor_buffered":
        result = _floor_buffered(prefix, tokens)
    elif variant == "floor_direct":
        result = _floor_direct(prefix, tokens)
    elif variant == "baseline":
        result = {}
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    after = vm_status()
    result.update(
        variant=variant,
        docs=int(lengths.size),
        tokens=int(tokens.size),
        generate_s=generate_s,
        rss_before_kib=before["VmRSS"],
        peak_rss_kib=after["VmHWM"],
        peak_reset=reset,
        load_average_at_start=load,
        # With the reset, VmHWM is the peak since the write began; without it, the whole child's.
        extra_peak_kib=after["VmHWM"] - before["VmRSS"] if reset else None,
    )
    with open(result_path, "w") as f:
        json.dump(result, f)


# -- parent side ---------------------------------------------------------------------------------
def _spawn(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", dir=args.out_dir, delete=False) as f:
        result_path = f.name
    try:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            variant,
            "--docs",
            str(args.docs),
            "--out-dir",
            args.out_dir,
            "--chunk-docs",
            str(args.chunk_docs),
            "--result",
            result_path,
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(result_path) as f:
            return json.load(f)
    finally:
        os.remove(result_path)


def _identical(a: str, b: str) -> bool:
    return all(filecmp.cmp(a + ext, b + ext, shallow=False) for ext in (".bin", ".idx"))


def _summarise(runs: dict[str, list[dict[str, Any]]], docs: int, tokens: int) -> dict[str, Any]:
    series = {v: runs[v] for v in VARIANTS}
    # megatron's figure plus the fsync it skips: the like-for-like comparison with close().
    series["megatron_fsync"] = [
        {**r, "total_s": r["total_s"] + r["fsync_after_s"], "close_s": r["close_s"] + r["fsync_after_s"]}
        for r in runs["megatron"]
    ]
    anchor = [r["total_s"] for r in series["megatron"]]
    anchor_durable = [r["total_s"] for r in series["megatron_fsync"]]
    rows: dict[str, dict[str, Any]] = {}
    for name, source in series.items():
        totals = [r["total_s"] for r in source]
        s = spread(totals)
        extra = [r["extra_peak_kib"] for r in source if r["extra_peak_kib"] is not None]
        rows[name] = {
            "seconds": s,
            "add_s_median": spread([r["add_s"] for r in source])["median"],
            "close_s_median": spread([r["close_s"] for r in source])["median"],
            "user_s_median": spread([r["user_s"] for r in source])["median"],
            "sys_s_median": spread([r["sys_s"] for r in source])["median"],
            "docs_per_s": docs / s["median"],
            "tokens_per_s": tokens / s["median"],
            "speedup_vs_megatron": spread(anchor)["median"] / s["median"],
            "speedup_vs_megatron_fsync": spread(anchor_durable)["median"] / s["median"],
            # Same round, so the same machine conditions: shows how much the ratio itself moves.
            "paired_speedups_vs_megatron": [a / t for a, t in zip(anchor, totals, strict=True)],
            "paired_speedups_vs_megatron_fsync": [a / t for a, t in zip(anchor_durable, totals, strict=True)],
            "extra_peak_rss_mib": max(extra) / 1024 if extra else None,
        }
    return rows


def table_row(label: str, row: dict[str, Any], same_text: str, *, versus: bool = True) -> str:
    s = row["seconds"]
    rss = row["extra_peak_rss_mib"]
    cells = [
        label,
        f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})",
        f"{row['add_s_median']:.2f} / {row['close_s_median']:.2f}",
        f"{row['user_s_median']:.2f} / {row['sys_s_median']:.2f}",
        f"{row['docs_per_s'] / 1e3:,.0f}k",
        f"{row['tokens_per_s'] / 1e6:,.0f}M",
    ]
    for key in ("speedup_vs_megatron", "speedup_vs_megatron_fsync"):
        paired = row[key.replace("speedup_", "paired_speedups_")]
        cells.append(f"**{row[key]:.2f}×** ({min(paired):.2f}–{max(paired):.2f})" if versus else "")
    cells += ["n/a" if rss is None else f"{rss:,.0f} MiB", same_text]
    return "| " + " | ".join(cells) + " |"


def _markdown(summary: dict[str, Any], identical: dict[str, list[bool]], result: dict[str, Any]) -> str:
    header = (
        "| Variant | Time, s | adds / close, s | CPU user / sys, s | docs/s | tokens/s | vs megatron "
        "| vs megatron + fsync | Extra peak RSS | Byte-identical to megatron |"
    )
    lines = [
        f"Corpus: {result['docs']:,} documents, {result['tokens']:,} uint16 tokens "
        f"({result['bin_bytes']:,} B `.bin`, {result['idx_bytes']:,} B `.idx`). "
        f"{result['repeats']} runs per variant, one fresh process each, order rotated every round. "
        "Time: median (min–max). Ratios: of the medians (range of the per-round ratios).",
        "",
        header,
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("megatron", "megatron_fsync", "ours_vectorised", "ours_loop"):
        same = identical.get(name)
        if same is None:
            same_text = "(reference)"
        else:
            same_text = f"{'yes' if all(same) else '**NO**'} ({sum(same)}/{len(same)} runs, `.bin` and `.idx`)"
        lines.append(table_row(LABELS[name], summary[name], same_text))
    lines += ["", "Floors on the same data in the same rounds (not writers: no `.idx`):", "", header, lines[3]]
    lines += [table_row(LABELS[name], summary[name], "n/a") for name in FLOORS]
    lines += [
        "",
        f"Corpus generation in each child (not timed): median {result['generate_s_median']:.2f} s. "
        f"Child RSS after generation {result['rss_after_generation_mib']:,.0f} MiB "
        f"(imports + the token array); the baseline child that only generates peaks at "
        f"{result['baseline_peak_rss_mib']:,.0f} MiB. Extra peak RSS: the child's peak above its RSS "
        "when the timer starts.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_docs_argument(parser)
    parser.add_argument("--repeats", type=int, default=5, help="runs per variant (default 5)")
    parser.add_argument(
        "--chunk-docs", type=int, default=0, help="documents per add_documents call (default: all in one)"
    )
    parser.add_argument("--out-dir", default=OUT_DIR, help="where shards and JSON go (default benchmarks/out)")
    add_plot_argument(parser)
    parser.add_argument("--child", choices=(*VARIANTS, "baseline"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    apply_quick(args, "bench_write", docs=20_000, repeats=1)
    args.out_dir = os.path.abspath(args.out_dir)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.child:
        run_child(args.child, args.docs, args.out_dir, args.chunk_docs, args.result)
        return

    git_before = git_state()
    baseline = _spawn("baseline", args)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    identical: dict[str, list[bool]] = {"ours_vectorised": [], "ours_loop": []}
    anchor_prefix = prefix_for(args.out_dir, "megatron")
    for round_ in range(args.repeats):
        # Rotating the order keeps any drift of the machine from always hitting the same variant.
        shift = round_ % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            # Deleting a 1 GB file is not free; do it outside the timed child.
            _remove(prefix_for(args.out_dir, variant))
            run = _spawn(variant, args)
            runs[variant].append(run)
            print(f"round {round_ + 1}/{args.repeats} {variant}: {run['total_s']:.2f} s", file=sys.stderr)
        for variant in identical:
            identical[variant].append(_identical(anchor_prefix, prefix_for(args.out_dir, variant)))
    for variant in FLOORS:
        _remove(prefix_for(args.out_dir, variant))

    first = runs["megatron"][0]
    summary = _summarise(runs, first["docs"], first["tokens"])
    result: dict[str, Any] = {
        "script": "benchmarks/bench_write.py",
        "command": " ".join(["python", "benchmarks/bench_write.py", *sys.argv[1:]]),
        "environment": environment(),
        "git": git_state(),
        "git_at_start": git_before,
        "docs": first["docs"],
        "tokens": first["tokens"],
        "bin_bytes": os.path.getsize(anchor_prefix + ".bin"),
        "idx_bytes": os.path.getsize(anchor_prefix + ".idx"),
        "repeats": args.repeats,
        "chunk_docs": args.chunk_docs,
        "generate_s_median": spread([r["generate_s"] for v in VARIANTS for r in runs[v]])["median"],
        "rss_after_generation_mib": first["rss_before_kib"] / 1024,
        "baseline_peak_rss_mib": baseline["peak_rss_kib"] / 1024,
        "byte_identical": identical,
        "summary": summary,
        "runs": runs,
        "baseline": baseline,
    }
    with open(os.path.join(args.out_dir, "bench_write.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(environment_markdown(result["environment"]))
    print()
    print(_markdown(summary, identical, result))
    publish_result("bench_write", result, not args.no_plot, quick=args.quick)
    if result["git"] != git_before:
        print("\nWARNING: the library changed during the run; the runs mix code versions.", file=sys.stderr)
    if not all(all(v) for v in identical.values()):
        raise SystemExit("byte-identity check FAILED")


if __name__ == "__main__":
    main()
