"""Random-sequence reads, warm page cache: megatron-core's ``IndexedDataset`` against statefulset's.

Both readers open the same files in the same process and read the same seeded random sequence
ids in the same order. Before timing, both files are read once (page cache) and every sequence
is read once through each reader (each reader's own mmap then has every page mapped). Each read
is forced by copying the sequence into a preallocated buffer (mmap-backed arrays are lazy).
Every pass draws fresh ids, the same for both readers, and the reader that goes first
alternates. Throughput passes have no per-read timer; separate latency passes time every read.

The shard is reused from ``benchmarks/out/`` (written by ``bench_write.py``) when its document
and token counts match ``--docs``; otherwise it is written there with ``add_documents``.

Output: a markdown table on stdout, and ``benchmarks/out/bench_read.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy
from benchenv import environment, environment_markdown, git_state, load_average, spread
from corpus import DTYPE, OUT_DIR, add_docs_argument, corpus_lengths, make_corpus
from plots import add_plot_argument, apply_quick, publish_result

# bench_write.py's outputs, all byte-identical; the first that matches is used.
CANDIDATES = ("ours_vectorised_text_document", "megatron_text_document", "ours_loop_text_document")
READERS = ("megatron", "ours")
LABELS = {
    "megatron": "megatron-core `IndexedDataset.__getitem__`",
    "ours": "statefulset `IndexedDataset.__getitem__`",
}


def find_or_write_shard(out_dir: str, docs: int) -> tuple[str, bool]:
    """A shard in ``out_dir`` holding the ``docs``-document corpus; returns (prefix, was_written)."""
    from statefulset import IndexedDataset, IndexedDatasetWriter

    lengths = corpus_lengths(docs)
    for name in CANDIDATES:
        prefix = os.path.join(out_dir, name)
        if IndexedDataset.exists(prefix):
            ds = IndexedDataset(prefix, validate=False)
            if ds.num_documents == docs and ds.num_tokens == int(lengths.sum()):
                return prefix, False
    prefix = os.path.join(out_dir, CANDIDATES[0])
    tokens, lengths = make_corpus(docs)
    with IndexedDatasetWriter(prefix, DTYPE) as writer:
        writer.add_documents(tokens, lengths)
    return prefix, True


def warm(prefix: str) -> float:
    """Read both files once so every later read hits the page cache; returns seconds taken."""
    buf = bytearray(16 << 20)
    t0 = time.perf_counter()
    for ext in (".bin", ".idx"):
        with open(prefix + ext, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def throughput_pass(get: Callable[[int], Any], ids: Sequence[int], buf: numpy.ndarray) -> tuple[float, int]:
    """Read every id, copying its tokens into ``buf``; returns (seconds, tokens read)."""
    tokens = 0
    t0 = time.perf_counter()
    for i in ids:
        seq = get(i)
        n = seq.size
        buf[:n] = seq
        tokens += n
    return time.perf_counter() - t0, tokens


def latency_pass(get: Callable[[int], Any], ids: Sequence[int], buf: numpy.ndarray) -> numpy.ndarray:
    """Nanoseconds per read (``get`` plus the copy), timer overhead included for both readers alike."""
    out = numpy.empty(len(ids), dtype=numpy.int64)
    clock = time.perf_counter_ns
    for k, i in enumerate(ids):
        t0 = clock()
        seq = get(i)
        buf[: seq.size] = seq
        out[k] = clock() - t0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_docs_argument(parser)
    parser.add_argument("--reads", type=int, default=200_000, help="random sequence ids per pass")
    parser.add_argument("--repeats", type=int, default=11, help="passes per reader, alternating (default 11)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the random sequence ids")
    parser.add_argument("--out-dir", default=OUT_DIR, help="where the shard and JSON are (default benchmarks/out)")
    add_plot_argument(parser)
    args = parser.parse_args()
    apply_quick(args, "bench_read", docs=20_000, reads=20_000, repeats=3)
    out_dir = os.path.abspath(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)

    git_before = git_state()
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset

    from statefulset import IndexedDataset

    prefix, written = find_or_write_shard(out_dir, args.docs)
    warm_s = warm(prefix)
    t0 = time.perf_counter()
    ours = IndexedDataset(prefix)  # validates the whole index on open; megatron checks counts only
    t1 = time.perf_counter()
    # Kept alive to the end: megatron's arrays are views of an mmap its __del__ closes.
    megatron = MegatronDataset(prefix)
    t2 = time.perf_counter()
    open_s = {"ours": t1 - t0, "megatron": t2 - t1}
    readers: dict[str, Callable[[int], Any]] = {"ours": ours.__getitem__, "megatron": megatron.__getitem__}

    # Reading every sequence once through each reader maps every page of its own mmap, so the
    # timed passes see a warm page cache *and* warm page tables, as in a long training run.
    buf = numpy.empty(int(ours.sequence_lengths.max()), dtype=ours.dtype)
    everything = range(len(ours))
    first_pass_s = {name: throughput_pass(readers[name], everything, buf)[0] for name in READERS}

    # Fresh ids every pass, the same for both readers: Python ints, as a sampler hands them out.
    rng = numpy.random.default_rng(args.seed)
    id_lists = [rng.integers(0, len(ours), size=args.reads).tolist() for _ in range(args.repeats)]
    checked = id_lists[0][:10_000]
    mismatches = sum(not numpy.array_equal(ours[i], megatron[i]) for i in checked)
    load_before = load_average()

    seconds: dict[str, list[float]] = {r: [] for r in READERS}
    tokens: list[int] = []
    latencies: dict[str, list[numpy.ndarray]] = {r: [] for r in READERS}
    for rep, ids in enumerate(id_lists):
        order = READERS if rep % 2 == 0 else READERS[::-1]
        for name in order:
            s, n_tokens = throughput_pass(readers[name], ids, buf)
            seconds[name].append(s)
        tokens.append(n_tokens)
        for name in order:
            latencies[name].append(latency_pass(readers[name], ids, buf))
        print(
            f"pass {rep + 1}/{args.repeats}: "
            + ", ".join(f"{n} {args.reads / seconds[n][-1]:,.0f} seq/s" for n in READERS),
            file=sys.stderr,
        )

    summary: dict[str, dict[str, Any]] = {}
    for name in READERS:
        s = spread(seconds[name])
        lat = numpy.concatenate(latencies[name]) / 1e3
        summary[name] = {
            "seconds": s,
            "open_s": open_s[name],
            "first_full_pass_s": first_pass_s[name],
            "sequences_per_s": args.reads / s["median"],
            "sequences_per_s_best": args.reads / s["min"],
            "tokens_per_s": spread([t / x for t, x in zip(tokens, seconds[name], strict=True)])["median"],
            "speedup_vs_megatron": spread(seconds["megatron"])["median"] / s["median"],
            # Same ids in the same pass: how much the ratio itself moves between passes.
            "paired_speedups_vs_megatron": [m / x for m, x in zip(seconds["megatron"], seconds[name], strict=True)],
            "latency_us": {
                "p50": float(numpy.percentile(lat, 50)),
                "p99": float(numpy.percentile(lat, 99)),
                "mean": float(lat.mean()),
            },
        }
    result = {
        "script": "benchmarks/bench_read.py",
        "command": " ".join(["python", "benchmarks/bench_read.py", *sys.argv[1:]]),
        "environment": environment(),
        "git": git_state(),
        "git_at_start": git_before,
        "load_average": {"before": load_before, "after": load_average()},
        "prefix": os.path.relpath(prefix),
        "shard_written_by_this_run": written,
        "docs": args.docs,
        "sequences": len(ours),
        "bin_bytes": os.path.getsize(prefix + ".bin"),
        "reads": args.reads,
        "tokens_per_pass": tokens,
        "repeats": args.repeats,
        "seed": args.seed,
        "warm_s": warm_s,
        "content_checked": len(checked),
        "content_mismatches": mismatches,
        "summary": summary,
        "seconds": seconds,
    }
    with open(os.path.join(out_dir, "bench_read.json"), "w") as f:
        json.dump(result, f, indent=2)
    publish_result("bench_read", result, not args.no_plot, quick=args.quick)

    print(environment_markdown(result["environment"]))
    print()
    print(
        f"Shard `{result['prefix']}`: {len(ours):,} sequences, {result['bin_bytes']:,} B `.bin`. Both files read "
        f"once ({warm_s:.2f} s), then every sequence read once through each reader (maps every page). "
        f"{args.repeats} passes per reader of {args.reads:,} random sequence ids each (fresh ids per pass, the "
        f"same for both readers, seed {args.seed}; about {spread([float(t) for t in tokens])['median']:,.0f} "
        "tokens per pass), order alternating. Throughput: median (best) over passes; ratio: of the medians "
        "(range of the per-pass ratios). Latency: every read of separate, per-read-timed passes, pooled."
    )
    print()
    print("| Reader | sequences/s | tokens/s | vs megatron | p50 / p99 latency | first full pass | open |")
    print("|---|---|---|---|---|---|---|")
    for name in READERS:
        row = summary[name]
        lat = row["latency_us"]
        paired = row["paired_speedups_vs_megatron"]
        print(
            f"| {LABELS[name]} | {row['sequences_per_s']:,.0f} ({row['sequences_per_s_best']:,.0f}) "
            f"| {row['tokens_per_s'] / 1e6:,.0f}M | **{row['speedup_vs_megatron']:.2f}×** "
            f"({min(paired):.2f}–{max(paired):.2f}) | {lat['p50']:.1f} µs / {lat['p99']:.1f} µs "
            f"| {row['first_full_pass_s']:.2f} s | {row['open_s'] * 1e3:.1f} ms |"
        )
    print()
    same = "yes" if mismatches == 0 else "NO"
    after = result["load_average"]["after"][0]
    print(
        f"Same tokens from both readers for the first {len(checked):,} ids: {same}. "
        f"Load average (1 min) before / after the timed passes: {load_before[0]} / {after}."
    )
    if mismatches:
        raise SystemExit(f"{mismatches} sequences differ between the readers")


if __name__ == "__main__":
    main()
