"""Task encoders' cost: tokens/s through 2 DataLoader workers, without an encoder and with cheap ones.

Each variant runs in a fresh process that iterates ``get_savable_loader`` (native packing,
micro-batch 8 x 2049 tokens, seed 3, 2 workers) for ``--batches`` batches after the first (so
the workers are started and warm):

- ``none``: no task encoder (batches travel through the shared-memory ring);
- ``identity``: ``encode_sample`` returns its sample; the worker gathers the rows into its ring slot
  (``text`` as int64, the dtype the encoder sees) and the kept samples' rows are already there
  (statefulset.loading.encoded_ring);
- ``identity_keyed``: the same under ``@stateless(restore_seeds=True)`` (the three global RNGs
  saved, seeded and restored per sample);
- ``rng``: ``encode_sample(self, sample, rng)`` drawing one number from the keyed generator;
- ``fim``: ``statefulset.transforms.FillInTheMiddle`` in token mode (rate 0.5, SPM rate 0.5, the
  corpus's EOD token splitting segments; sentinels just above the vocabulary), as Megatron-LM's
  ``--fim-rate 0.5 --fim-spm-rate 0.5`` (the loader's compiled micro-batch path).

The variants alternate (A B C D A B C D ...), ``--repeats`` rounds; median tokens/s with min and
max, and each variant's ratio to ``none`` per round. Issue 27 asks identity >= 90% of none and FIM
(token mode) >= 50%.

    python benchmarks/bench_task_encoder.py            # full size
    python benchmarks/bench_task_encoder.py --quick    # smoke run (20,000 documents, 100 batches)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
VARIANTS = ("none", "identity", "identity_keyed", "rng", "fim")
BATCH, SEQ, WORKERS = 8, 2048, 2


class Identity:
    def encode_sample(self, sample):
        return sample


class IdentityKeyed:
    def __init__(self) -> None:
        from statefulset import stateless

        type(self).encode_sample = stateless(restore_seeds=True)(Identity.encode_sample)


class DrawsFromRng:
    def encode_sample(self, sample, rng):
        sample.coin = bool(rng.random() < 0.5)
        return sample


def fill_in_the_middle():
    from corpus import EOD

    from statefulset.transforms import FillInTheMiddle

    return FillInTheMiddle(0.5, 0.5, EOD + 1, EOD + 2, EOD + 3, EOD + 4, eod_id=EOD)


def child(prefix: str, variant: str, batches: int) -> float:
    from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

    encoder = {"none": None, "identity": Identity, "identity_keyed": IdentityKeyed, "rng": DrawsFromRng,
               "fim": fill_in_the_middle}[variant]  # fmt: skip
    spec = {"data_path": prefix, "seq_length": SEQ, "split": "100,0,0", "packing": "native", "seed": 3}
    wc = WorkerConfig(rank=0, world_size=1, num_workers=WORKERS)
    ds = get_train_dataset(spec, batch_size=BATCH, worker_config=wc, task_encoder=encoder() if encoder else None)
    loader = iter(get_savable_loader(ds))
    next(loader)  # workers started and warm
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    return batches * BATCH * SEQ / (time.perf_counter() - start)


def _shard(docs: int, name: str) -> str:
    """A shard of ``docs`` documents of the shared benchmark corpus (written once under benchmarks/out)."""
    import numpy
    from corpus import make_corpus

    from statefulset import IndexedDatasetWriter

    prefix = os.path.join(HERE, "out", "task_encoder", name)
    if not os.path.exists(prefix + ".idx"):
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        tokens, lengths = make_corpus(docs)
        with IndexedDatasetWriter(prefix, dtype=numpy.uint16) as w:
            w.add_documents(tokens, lengths)
    return prefix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--docs", type=int, default=200_000, help="documents in the benchmark shard")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each round runs every variant once")
    parser.add_argument("--quick", action="store_true", help="20,000 documents, 100 batches")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        job = json.loads(args.child)
        print(child(job["prefix"], job["variant"], job["batches"]))
        return
    from provenance import alternate, ratio, write_results

    if args.quick:
        args.docs, args.batches = 20_000, 100
    prefix = _shard(args.docs, f"c{args.docs}")

    def run(variant: str) -> float:
        job = json.dumps({"prefix": prefix, "variant": variant, "batches": args.batches})
        done = subprocess.run([sys.executable, __file__, "--child", job], capture_output=True, text=True,
                              check=True, timeout=1800)  # fmt: skip
        return float(done.stdout.strip().splitlines()[-1])

    measured = alternate({v: (lambda v=v: run(v)) for v in VARIANTS}, runs=args.repeats)
    ratios = {v: ratio(measured[v], measured["none"]) for v in VARIANTS if v != "none"}
    for v in VARIANTS:
        m = measured[v]
        said = f"  ({ratios[v]['median']:.2f} of none)" if v in ratios else ""
        print(
            f"{v:>15}: {m['median'] / 1e6:8.2f} M tokens/s (min {m['min'] / 1e6:.2f}, max {m['max'] / 1e6:.2f}){said}"
        )
    config = {"batch_size": BATCH, "seq_length": SEQ, "workers": WORKERS, "batches": args.batches, "docs": args.docs}
    path = write_results(
        "bench_task_encoder", {"config": config, "tokens_per_s": measured, "ratio_to_none": ratios}, quick=args.quick
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
