"""Padding and truncation of the packings, side by side with OLMo-core's best-fit packing, and the cost of boundaries.

Two corpora of the same number of documents: geometric lengths of mean 500, and a long tail
(95% geometric of mean 300, 5% log-normal around 4,000 tokens, some past 50,000). Samples hold
2,048 tokens (``seq_length`` 2047 + 1), the instance size OLMo-core's packer needs (a power of
two). For each packing, over one epoch:

- padding: the share of token slots that hold padding;
- cut documents: the share of documents that fit a sample (at most 2,048 tokens) but are split
  across samples; dropped tokens: tokens no sample holds.

packing native and megatron concatenate (documents at random offsets, cut at every sample
boundary); bestfit and OLMo-core (``InstancePacker.pack_documents``, run in its own environment
by ``anchor_olmo_packing.py``, both long-document strategies) pack whole documents.

Then: opening a bestfit stream with its bins cached and seeking far (a restore), and batch
assembly (B=8: in process, in a worker, through 2 workers) with and without ``document_boundaries``.

    python benchmarks/bench_packing.py --olmo-python /path/to/venv-olmo/bin/python
    python benchmarks/bench_packing.py --window-samples 8192   # a corpus of several bestfit windows
    python benchmarks/bench_packing.py --quick                  # smoke run (several windows)

"bestfit, whole source at once" is best-fit decreasing over every document of the source in one
window: what the windowed packing is compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from plots import IMG_DIR, RESULTS_DIR, add_plot_argument  # noqa: E402
from process_cpu import tree_cpu  # noqa: E402

from statefulset import IndexedDatasetWriter, WorkerConfig, get_savable_loader, get_train_dataset  # noqa: E402
from statefulset.streams.documents import field_layout, gather_fields  # noqa: E402
from statefulset.streams.opening import open_stream  # noqa: E402

SEQ = 2047
CAPACITY = SEQ + 1


def corpus_lengths(kind: str, documents: int, seed: int = 0) -> numpy.ndarray:
    rng = numpy.random.default_rng(seed)
    if kind == "geometric":
        return rng.geometric(1 / 500, documents).astype(numpy.int64)
    tail = rng.random(documents) < 0.05
    lengths = rng.geometric(1 / 300, documents)
    lengths[tail] = numpy.minimum(rng.lognormal(numpy.log(4000), 1.0, int(tail.sum())), 60_000).astype(numpy.int64)
    return lengths.astype(numpy.int64)


def write(prefix: str, lengths: numpy.ndarray) -> None:
    with IndexedDatasetWriter(prefix, numpy.uint16) as w:
        block = 20_000
        for first in range(0, lengths.size, block):
            part = lengths[first : first + block]
            w.add_documents(numpy.zeros(int(part.sum()), dtype=numpy.uint16), part.tolist())


def concat_cuts(order_lengths: numpy.ndarray, total_windows: int) -> tuple[float, float]:
    """(cut share of fitting documents, dropped share of tokens) for windows of S+1 at stride S over this order."""
    ends = numpy.cumsum(order_lengths)
    starts = ends - order_lengths
    k = starts // SEQ
    whole = (ends <= k * SEQ + SEQ + 1) & (k < total_windows)
    fits = (order_lengths > 0) & (order_lengths <= CAPACITY)
    covered = total_windows * SEQ + 1
    dropped = max(0, int(ends[-1]) - covered)
    return float((fits & ~whole).sum() / fits.sum()), dropped / float(ends[-1])


def bestfit_figures(stream) -> dict:
    """Padding, cut and dropped shares of a bestfit stream, every one read from its stored index."""
    source = stream.sources[0]
    lengths = source.dataset.sequence_lengths.astype(numpy.int64)
    n = source.samples_per_epoch
    tokens = int(lengths.sum())
    # How many items each document became, from the stored index: one entry per remainder item.
    index = source.index
    windows = numpy.repeat(numpy.arange(source.bins.size), numpy.diff(index["entry_first"]))
    ranks = windows * source.window + index["entries"].astype(numpy.int64)
    sequences = source.sequence_range[0] + source._deal(ranks)
    pieces_of = numpy.bincount(sequences, minlength=lengths.size)
    fits = (lengths > 0) & (lengths <= CAPACITY)
    # Tokens the epoch's bins hold, bin by bin as a sample reads them: what is not held is dropped.
    held = sum(int(source.bin_items(b)[2].sum()) for b in range(n))
    return {
        "samples": n,
        "padding": 1 - held / (n * CAPACITY),
        "cut": float((fits & (pieces_of > 1)).sum() / fits.sum()),
        "dropped": (tokens - held) / tokens,
        "from_outputs": True,
        "window_documents": source.window,
        "windows": int(source.bins.size),
    }


def whole_source_figures(lengths: numpy.ndarray) -> dict:
    """Best-fit decreasing over the whole source at once (one window): the padding windows are judged against."""
    from statefulset.index.bestfit.packing import count_bins, split_documents

    full, rest = split_documents(lengths, CAPACITY)
    rest = rest[rest > 0]
    samples = int(full.sum()) + int(count_bins(rest, max(1, rest.size), CAPACITY)[0])
    return {"samples": samples, "padding": 1 - float(lengths.sum()) / (samples * CAPACITY), "cut": 0.0,
            "dropped": 0.0, "windows": 1, "from_outputs": True}  # fmt: skip


def olmo_figures(olmo_python: str, lengths: numpy.ndarray, strategy: str, folder: str) -> dict | None:
    if not olmo_python:
        return None
    path = os.path.join(folder, "lengths.npy")
    numpy.save(path, lengths)
    out = os.path.join(folder, f"olmo-{strategy}.json")
    script = os.path.join(HERE, "anchor_olmo_packing.py")
    subprocess.run([olmo_python, script, path, str(CAPACITY), strategy, out], check=True, timeout=3600)
    with open(out) as f:
        got = json.load(f)
    fits = (lengths > 0) & (lengths <= CAPACITY)
    return {
        "samples": got["instances"],
        "padding": got["padding_fraction"],
        "cut": got["fitting_documents_cut"] / got["fitting_documents"],  # read from its instances
        "from_outputs": True,
        "long_documents_cut": got["documents_cut"],
        "dropped": got["tokens_dropped"] / float(lengths.sum()),
        "seconds": got["seconds"],
        "version": got["olmo_core_version"],
        "fits": int(fits.sum()),
    }


def assembly(spec: dict, batches: int, repeats: int) -> dict:
    """Batch assembly (B=8, random positions, warm page cache), without and with boundaries.

    Three places: ``in process`` (``gather_fields`` into new arrays: what ``num_workers=0`` and
    ``ds[p]`` run per batch), ``in a worker`` (``gather_fields`` into a ring slot's arrays: what a
    DataLoader worker runs per batch; its document fields travel as their pieces) and ``2 workers``
    (what the trainer receives from a loader with two worker processes). The variants alternate
    (without, with, without, ...) ``repeats`` times; each pass records tokens/s (wall clock) and
    CPU µs per batch (every process: the trainer and its workers), and the slowdown is the median
    of the per-round ratios with its spread, for both. CPU time still means something on a loaded
    machine; tokens/s needs a quiet one.
    """
    from provenance import ratio, summary

    stream = open_stream(spec)
    upper = len(stream) if not stream.unbounded else 10**6
    rng = numpy.random.default_rng(0)
    plans = [rng.integers(0, upper, 8) for _ in range(batches)]
    padded = stream.padded or stream.masked
    places = {
        "in process": lambda b: _passes(lambda: _each(plans, lambda p: gather_fields(stream, p, b)), batches),
        "in a worker": lambda b: _in_slot(stream, plans, b, padded),
        "2 workers": lambda b: _through_workers(spec, b, batches),
    }
    out: dict = {}
    for where, run in places.items():
        run(False), run(True)  # warm the page cache, the memo and the code paths
        rounds = {False: [], True: []}
        for _ in range(repeats):
            for boundaries in (False, True):
                rounds[boundaries].append(run(boundaries))
        for boundaries, label in ((False, "without"), (True, "with")):
            out[f"{where}, {label}"] = summary([rate for rate, _ in rounds[boundaries]])
            out[f"{where}, {label}, cpu us per batch"] = summary([cpu for _, cpu in rounds[boundaries]])
        rates_without, rates_with = (summary([r for r, _ in rounds[b]]) for b in (False, True))
        cpu_without, cpu_with = (summary([c for _, c in rounds[b]]) for b in (False, True))
        out[f"{where}, slowdown"] = {k: v - 1 if k != "runs" else [x - 1 for x in v]
                                     for k, v in ratio(rates_without, rates_with).items()}  # fmt: skip
        out[f"{where}, cpu slowdown"] = {k: v - 1 if k != "runs" else [x - 1 for x in v]
                                         for k, v in ratio(cpu_with, cpu_without).items()}  # fmt: skip
    return out


def _passes(one_pass, batches: int) -> tuple[float, float]:
    """(tokens/s, CPU µs per batch) of one pass in this process."""
    began, cpu = time.perf_counter(), time.process_time()
    one_pass()
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    return batches * 8 * SEQ / seconds, cpu / batches * 1e6


def _in_slot(stream, plans: list, boundaries: bool, padded: bool) -> tuple[float, float]:
    """A worker's build: every batch into the same slot-like arrays (text in the corpus dtype)."""
    layout = field_layout(stream.seq_length, stream.token_dtype, boundaries, padded, wire=True)
    slot = {f.name: numpy.empty((8, *f.shape), dtype=f.dtype) for f in layout}
    return _passes(lambda: _each(plans, lambda p: gather_fields(stream, p, boundaries, dict(slot))), len(plans))


def _each(plans: list, build) -> None:
    """Build every batch, dropping each before the next (a list of them would make every batch's
    arrays new memory, and time page faults instead of assembly)."""
    for p in plans:
        build(p)


def _through_workers(spec: dict, boundaries: bool, batches: int) -> tuple[float, float]:
    """What the trainer receives from two workers: tokens/s, and CPU µs per batch of the trainer and the workers."""
    wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
    loader = get_savable_loader(get_train_dataset(spec, batch_size=8, worker_config=wc,
                                                  document_boundaries=boundaries))  # fmt: skip
    iterator = iter(loader)
    next(iterator)  # workers started
    began, cpu = time.perf_counter(), tree_cpu()
    for _, _batch in zip(range(batches), iterator, strict=False):
        pass
    seconds, cpu = time.perf_counter() - began, tree_cpu() - cpu
    del iterator, loader
    return batches * 8 * SEQ / seconds, cpu / batches * 1e6


def seek(spec: dict) -> dict:
    began = time.perf_counter()
    stream = open_stream(spec)
    opened = time.perf_counter() - began
    timings = {}
    for name, base in (("position 0", 0), ("position 10^12", 10**12)):
        began = time.perf_counter()
        stream.gather(numpy.arange(base, base + 8))
        timings[name] = time.perf_counter() - began
    return {"open_seconds": opened, **{f"first batch at {k} (s)": v for k, v in timings.items()}}


def chart(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, kind in zip(axes, results["corpora"], strict=True):
        rows = results["corpora"][kind]["packings"]
        names = list(rows)
        padding = [100 * rows[n]["padding"] for n in names]
        cut = [100 * rows[n]["cut"] for n in names]
        dropped = [100 * rows[n]["dropped"] for n in names]
        ys = numpy.arange(len(names))[::-1]
        ax.barh(ys + 0.27, padding, 0.27, label="padding (% of token slots)", color="#9aa5b1")
        ax.barh(ys, cut, 0.27, label="fitting documents cut (%)", color="#d9822b")
        ax.barh(ys - 0.27, dropped, 0.27, label="tokens dropped (%)", color="#b33a3a")
        for y, values in zip(ys, zip(padding, cut, dropped, strict=True), strict=True):
            for dy, v in zip((0.27, 0, -0.27), values, strict=True):
                label = "0" if v == 0 else f"{v:.2g}"
                ax.annotate(label, (v, y + dy), xytext=(2, 0), textcoords="offset points", va="center", fontsize=7)
        ax.set_yticks(ys)
        ax.set_yticklabels(names, fontsize=8)
        ax.set_title(f"{kind} lengths, samples of {CAPACITY} tokens", fontsize=10)
        ax.set_xlabel("% (lower is better)")
        ax.grid(axis="x", alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=200_000)
    parser.add_argument("--olmo-python", default=os.environ.get("OLMO_PYTHON", ""))
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5, help="passes per batch-assembly row (median, spread)")
    parser.add_argument(
        "--window-samples", type=int, default=0,
        help="samples' worth of documents per bestfit window (default: the library's; lower it for a corpus of "
             "several windows, e.g. 8192 gives ~8 windows at 200,000 documents)",
    )  # fmt: skip
    parser.add_argument("--no-assembly", action="store_true", help="padding, cut and dropped shares only (no timing)")
    parser.add_argument("--out", default="bench_packing", help="results file name under benchmarks/results")
    parser.add_argument("--chart-only", action="store_true", help="redraw the chart from benchmarks/results only")
    add_plot_argument(parser)
    args = parser.parse_args()
    if args.chart_only:
        with open(os.path.join(RESULTS_DIR, "bench_packing.json")) as f:
            chart(json.load(f), os.path.join(IMG_DIR, "bench_packing.png"))
        return
    if args.quick:
        args.documents, args.batches, args.repeats = 20_000, 30, 3
        args.window_samples = args.window_samples or 1024
    if args.window_samples:
        import statefulset.index.bestfit.source as bestfit_source

        bestfit_source.WINDOW_SAMPLES = args.window_samples  # read when a stream sizes its windows
    results: dict = {"documents": args.documents, "capacity": CAPACITY, "corpora": {},
                     "window_samples": args.window_samples or None}  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        for kind in ("geometric", "long-tail"):
            entry = corpus(kind, args, folder)
            if kind == "geometric" and not args.no_assembly:
                common = entry.pop("common")
                results["assembly"] = {
                    p: assembly({**common, "packing": p}, args.batches, args.repeats)
                    for p in ("megatron", "native", "bestfit")
                }
            entry.pop("common", None)
            results["corpora"][kind] = entry
            print(kind, json.dumps(entry, indent=1))
    print(json.dumps(results.get("assembly"), indent=1))
    from provenance import write_results

    results["command"] = "python benchmarks/bench_packing.py " + " ".join(sys.argv[1:])
    write_results(args.out, results, quick=args.quick)
    if not args.no_plot and not args.quick and args.out == "bench_packing":
        chart(results, os.path.join(IMG_DIR, "bench_packing.png"))


def corpus(kind: str, args: argparse.Namespace, folder: str) -> dict:
    """One corpus: every packing's padding, cut and dropped shares, and a bestfit seek."""
    lengths = corpus_lengths(kind, args.documents)
    prefix = os.path.join(folder, kind)
    write(prefix, lengths)
    common = {"data_path": prefix, "seq_length": SEQ, "split": "1", "path_to_cache": os.path.join(folder, "c")}
    rows: dict = {}
    native = open_stream({**common, "packing": "native"})
    cut, dropped = concat_cuts(lengths, native.samples_per_epoch)
    rows["native (concatenate)"] = {"padding": 0.0, "cut": cut, "dropped": dropped}
    megatron = open_stream({**common, "packing": "megatron"})
    source = megatron.sources[0]
    order = source.document_index[: lengths.size].astype(numpy.int64)
    cut, dropped = concat_cuts(lengths[order], len(megatron))
    rows["megatron (concatenate)"] = {"padding": 0.0, "cut": cut, "dropped": dropped}
    began = time.perf_counter()
    bestfit = open_stream({**common, "packing": "bestfit"})
    bins_seconds = time.perf_counter() - began
    rows["bestfit (ours)"] = {**bestfit_figures(bestfit), "open_and_bins_seconds": bins_seconds}
    rows["bestfit, whole source at once"] = whole_source_figures(lengths)
    for strategy in ("truncate", "fragment"):
        found = olmo_figures(args.olmo_python, lengths, strategy, folder)
        if found is not None:
            rows[f"OLMo-core best-fit ({strategy})"] = found
    entry = {"tokens": int(lengths.sum()), "mean_length": float(lengths.mean()), "packings": rows, "common": common}
    entry["seek"] = seek({**common, "packing": "bestfit"})
    return entry


if __name__ == "__main__":
    main()
