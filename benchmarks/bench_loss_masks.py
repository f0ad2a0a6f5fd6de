"""Loss-mask cost (issue 28): ``python benchmarks/bench_loss_masks.py [--quick]``.

1. Batch assembly with and without masks: the same token shard twice, once with a loss-mask shard
   beside it; for each packing (megatron, native, bestfit), ``gather_fields`` of the same positions
   (micro-batches of ``--batch-size`` x ``--seq-length + 1``), in one process, the two variants
   alternated, ``--runs`` rounds; the per-round ratio masked / plain of seconds per batch.
   Target (issue 28): masked at most 15% slower. ``--cpu-time`` times it in this process's CPU time
   (``time.process_time``) instead of wall clock: a proxy for when the machine is busy with other
   work, labelled so in the results (``arguments.cpu_time``).
2. ``statefulset preprocess`` docs/s (one process, byte tokenizer) of instruction-like lines given as
   segment lists (a prompt with loss false, an answer with loss true) against the same texts as
   plain strings; alternated, ``--runs`` rounds.

Corpora are written once under ``benchmarks/out/loss_masks``. Results:
``benchmarks/results/bench_loss_masks.json`` (``--quick``: ``benchmarks/out/quick/``, a smoke size;
``--out``: that file instead, for a check that must not replace the committed run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
PACKINGS = ("megatron", "native", "bestfit")


def shards(documents: int) -> tuple[str, str]:
    """(plain prefix, masked prefix): the same tokens; the masked one has a mask shard beside it."""
    import numpy

    from statefulset import IndexedDatasetWriter

    folder = os.path.join(HERE, "out", "loss_masks", f"d{documents}")
    plain, masked = os.path.join(folder, "plain"), os.path.join(folder, "masked")
    if os.path.exists(masked + "_loss_mask.idx"):
        return plain, masked
    os.makedirs(folder, exist_ok=True)
    rng = numpy.random.default_rng(0)
    lengths = rng.geometric(1 / 600, size=documents).astype(numpy.int64)
    tokens = rng.integers(0, 50_000, size=int(lengths.sum())).astype(numpy.uint16)
    prompt = numpy.minimum(rng.geometric(1 / 200, size=documents), lengths)
    within = numpy.arange(tokens.size) - numpy.repeat(numpy.cumsum(lengths) - lengths, lengths)
    mask = (within >= numpy.repeat(prompt, lengths)).astype(numpy.uint8)
    for prefix in (plain, masked):
        with IndexedDatasetWriter(prefix, numpy.uint16) as w:
            w.add_documents(tokens, lengths)
    with IndexedDatasetWriter(masked + "_loss_mask", numpy.uint8) as w:
        w.add_documents(mask, lengths)
    return plain, masked


def assembly(prefixes: tuple[str, str], packing: str, args: argparse.Namespace) -> dict:
    """Seconds per batch, plain and masked, alternated over the same positions; and their ratio."""
    import numpy
    from provenance import alternate, ratio

    from statefulset.streams.documents import gather_fields
    from statefulset.streams.opening import open_stream

    cache = os.path.join(HERE, "out", "loss_masks", "cache")
    streams = {}
    for name, prefix in zip(("plain", "masked"), prefixes, strict=True):
        spec = {"data_path": prefix, "seq_length": args.seq_length, "split": "1", "packing": packing, "seed": 1,
                "path_to_cache": cache}  # fmt: skip
        streams[name] = open_stream(spec)
    count = min(len(s) for s in streams.values()) if packing == "megatron" else 10**9
    rng = numpy.random.default_rng(1)
    batches = [rng.integers(0, count, size=args.batch_size) for _ in range(args.batches)]

    clock = time.process_time if args.cpu_time else time.perf_counter

    def run(stream) -> float:
        started = clock()
        for positions in batches:
            gather_fields(stream, positions, False)
        return (clock() - started) / len(batches)

    found = alternate({name: (lambda s=s: run(s)) for name, s in streams.items()}, runs=args.runs)
    assert "loss_mask" in gather_fields(streams["masked"], batches[0], False)
    found["masked_over_plain"] = ratio(found["masked"], found["plain"])
    return found


def preprocess_rate(args: argparse.Namespace) -> dict:
    """Docs/s of segment lists against the same texts as plain strings."""
    from provenance import alternate, ratio

    from statefulset.tools.demo import generate_documents
    from statefulset.tools.preprocess import preprocess

    folder = os.path.join(HERE, "out", "loss_masks", f"pre{args.lines}")
    os.makedirs(folder, exist_ok=True)
    texts = [d["text"] for d in generate_documents(args.lines)]
    files = {"segments": os.path.join(folder, "segments.jsonl"), "plain": os.path.join(folder, "plain.jsonl")}
    with open(files["segments"], "w") as seg, open(files["plain"], "w") as plain:
        for text in texts:
            cut = len(text) // 3
            parts = [{"text": text[:cut], "loss": False}, {"text": text[cut:], "loss": True}]
            seg.write(json.dumps({"text": parts}) + "\n")
            plain.write(json.dumps({"text": text}) + "\n")

    def run(name: str) -> float:
        out = os.path.join(folder, f"out_{name}")
        result = preprocess([files[name]], out, append_eod=True, workers=1, show_progress=False)
        for path in os.listdir(folder):
            if path.startswith(f"out_{name}"):
                os.remove(os.path.join(folder, path))
        return result.documents / result.seconds

    found = alternate({name: (lambda n=name: run(n)) for name in files}, runs=args.runs)
    found["segments_over_plain"] = ratio(found["segments"], found["plain"])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke size; results under benchmarks/out/quick/")
    parser.add_argument("--documents", type=int, default=200_000)
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--packings", default=",".join(PACKINGS), help="comma-separated, of " + ", ".join(PACKINGS))
    parser.add_argument("--cpu-time", action="store_true", help="assembly in process CPU time, not wall clock")
    parser.add_argument("--out", help="the results file (default: benchmarks/results/bench_loss_masks.json)")
    args = parser.parse_args()
    packings = args.packings.split(",")
    if not set(packings) <= set(PACKINGS):
        parser.error(f"--packings {args.packings}: each must be one of {', '.join(PACKINGS)}")
    if args.quick:
        args.documents, args.seq_length, args.batches, args.lines, args.runs = 2000, 256, 20, 500, 3
    from provenance import write_results

    prefixes = shards(args.documents)
    results = {"arguments": vars(args), "assembly": {}, "preprocess": preprocess_rate(args)}
    for packing in packings:
        results["assembly"][packing] = assembly(prefixes, packing, args)
        ratio_found = results["assembly"][packing]["masked_over_plain"]["median"]
        print(f"{packing}: masked / plain seconds per batch {ratio_found:.3f}")
    print(f"preprocess: segments / plain docs/s {results['preprocess']['segments_over_plain']['median']:.3f}")
    print(write_results("bench_loss_masks", results, path=args.out, quick=args.quick))
    if args.quick:
        shutil.rmtree(os.path.join(HERE, "out", "loss_masks", "cache"), ignore_errors=True)


if __name__ == "__main__":
    main()
