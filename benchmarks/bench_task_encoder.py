"""Task encoders' cost: tokens/s through 2 DataLoader workers, without an encoder and with cheap ones.

Each variant runs in a fresh process that iterates ``get_savable_loader`` (native packing,
micro-batch 8 x 2049 tokens, seed 3, 2 workers) for ``--batches`` batches after ``WARMUP`` (100)
untimed ones (the workers started, their rings filled and drained: :func:`measure`, which
bench_fim.py's loader rows use too), on the shared synthetic corpus (benchmarks/corpus.py: uniform
random tokens, geometric document lengths of mean 500, each document ending in the EOD token 50256):

- ``none``: no task encoder (batches travel through the shared-memory ring);
- ``identity``: ``encode_sample`` returns its sample; the worker gathers the rows into its ring slot
  (``text`` in the corpus dtype, widened to int64 only where an encoder reads it:
  statefulset.transforms.sample) and the kept samples' rows are already there
  (statefulset.loading.encoded_ring);
- ``identity_keyed``: the same under ``@stateless(restore_seeds=True)`` (the three global RNGs
  saved, seeded and restored per sample);
- ``rng``: ``encode_sample(self, sample, rng)`` drawing one number from the keyed generator;
- ``fim``: ``statefulset.transforms.FillInTheMiddle`` in token mode (rate 0.5, SPM rate 0.5, the
  corpus's EOD token splitting segments; sentinels just above the vocabulary), as Megatron-LM's
  ``--fim-rate 0.5 --fim-spm-rate 0.5`` (the loader's compiled micro-batch path).

The variants alternate (A B C D A B C D ...), ``--repeats`` rounds; median tokens/s with min and
max, and each variant's ratio to ``none`` per round; beside them each run's CPU time per micro-batch
of the trainer and of its workers (``/proc``) and none's total over the variant's, per round: on
this 2-core machine three busy processes share two cores, so tokens/s moves with any other load
while CPU time does not. Issue 27 asks identity >= 90% of none and FIM (token mode) >= 50%: this
script's ``identity`` and ``fim`` rows are the figures that claim them (bench_fim.py measures FIM's
loader rows the same way on a text corpus, as a cross-check, and carries the tokenizer-mode
comparison).

    python benchmarks/bench_task_encoder.py            # full size
    python benchmarks/bench_task_encoder.py --quick    # smoke run (20,000 documents, 100 batches)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
VARIANTS = ("none", "identity", "identity_keyed", "rng", "fim")
BATCH, SEQ, WORKERS = 8, 2048, 2
WARMUP = 100  # batches taken before the clock starts


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


def child(prefix: str, variant: str, batches: int) -> dict:
    encoder = {"none": None, "identity": Identity, "identity_keyed": IdentityKeyed, "rng": DrawsFromRng,
               "fim": fill_in_the_middle}[variant]  # fmt: skip
    return measure(prefix, encoder() if encoder else None, batches)


def measure(prefix: str, encoder: object, batches: int, warmup: int = WARMUP) -> dict:
    """One loader run: ``get_savable_loader`` over ``prefix`` (native packing, micro-batches of BATCH x
    SEQ + 1, seed 3, WORKERS workers) with ``encoder``; ``warmup`` batches taken first (the workers
    started, their rings filled and drained once), then ``batches`` timed. Tokens/s (wall) and the CPU
    seconds per micro-batch of the trainer and of its workers together (``/proc``: load-independent
    where wall time is not). bench_fim.py measures its loader rows with this same function."""
    from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

    spec = {"data_path": prefix, "seq_length": SEQ, "split": "100,0,0", "packing": "native", "seed": 3}
    wc = WorkerConfig(rank=0, world_size=1, num_workers=WORKERS)
    ds = get_train_dataset(spec, batch_size=BATCH, worker_config=wc, task_encoder=encoder)
    loader = iter(get_savable_loader(ds))
    for _ in range(min(warmup, batches)):
        next(loader)
    workers = [p.pid for p in multiprocessing.active_children()]
    cpu = (_cpu_s([os.getpid()]), _cpu_s(workers))
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    seconds = time.perf_counter() - start
    trainer, worker = _cpu_s([os.getpid()]) - cpu[0], _cpu_s(workers) - cpu[1]
    return {"tokens_per_s": batches * BATCH * SEQ / seconds, "trainer_cpu_us": trainer / batches * 1e6,
            "workers_cpu_us": worker / batches * 1e6, "workers": len(workers)}  # fmt: skip


def spawned(script: str, job: dict, cpu: list[dict]) -> float:
    """``script --child job`` in a fresh process: its tokens/s; its CPU figures appended to ``cpu``."""
    done = subprocess.run([sys.executable, script, "--child", json.dumps(job)], capture_output=True, text=True,
                          check=True, timeout=1800)  # fmt: skip
    found = json.loads(done.stdout.strip().splitlines()[-1])
    cpu.append(found)
    return float(found["tokens_per_s"])


def cpu_per_batch(cpu: dict[str, list[dict]], baseline: str) -> dict[str, dict]:
    """Per variant: the trainer's, the workers' and their total CPU microseconds per micro-batch (median,
    min, max over the rounds), and ``baseline``'s total over the variant's, round by round (the
    load-independent counterpart of the tokens/s ratio)."""
    from provenance import summary

    total = {v: [r["trainer_cpu_us"] + r["workers_cpu_us"] for r in runs] for v, runs in cpu.items()}
    return {
        v: {
            "trainer": summary([r["trainer_cpu_us"] for r in runs]),
            "workers": summary([r["workers_cpu_us"] for r in runs]),
            "total": summary(total[v]),
            "none_over_this": summary([b / t for b, t in zip(total[baseline], total[v], strict=True) if t]),
        }
        for v, runs in cpu.items()
    }


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of the processes ``pids`` (Linux ``/proc``; NaN elsewhere)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


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
    # 100 + 20,000 batches fit the ~30,500 of one epoch of the 1,000,000-document shard (no epoch
    # boundary timed). 20,000 batches time each run for ~1-3 s (5,000 timed 0.2 s, where one scheduling
    # hiccup of the machine moved a round's ratio by 10%), and make CPU time per batch exact to ~0.5 us
    # (10 ms clock ticks).
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--docs", type=int, default=1_000_000, help="documents in the benchmark shard")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each round runs every variant once")
    parser.add_argument("--quick", action="store_true", help="20,000 documents, 100 batches")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        job = json.loads(args.child)
        print(json.dumps(child(job["prefix"], job["variant"], job["batches"])))
        return
    from provenance import alternate, ratio, write_results

    if args.quick:
        args.docs, args.batches = 20_000, 100
    prefix = _shard(args.docs, f"c{args.docs}")
    cpu: dict[str, list[dict]] = {v: [] for v in VARIANTS}

    def run(variant: str) -> float:
        job = {"prefix": prefix, "variant": variant, "batches": args.batches}
        return spawned(__file__, job, cpu[variant])

    measured = alternate({v: (lambda v=v: run(v)) for v in VARIANTS}, runs=args.repeats)
    ratios = {v: ratio(measured[v], measured["none"]) for v in VARIANTS if v != "none"}
    per_batch = cpu_per_batch(cpu, "none")
    for v in VARIANTS:
        m, c = measured[v], per_batch[v]
        said = f"  ({ratios[v]['median']:.2f} of none)" if v in ratios else ""
        print(f"{v:>15}: {m['median'] / 1e6:8.2f} M tokens/s (min {m['min'] / 1e6:.2f}, max {m['max'] / 1e6:.2f})"
              f"{said}; CPU {c['total']['median']:.0f} us a batch (none's / this "
              f"{c['none_over_this']['median']:.2f})")  # fmt: skip
    config = {"batch_size": BATCH, "seq_length": SEQ, "workers": WORKERS, "batches": args.batches, "docs": args.docs,
              "warmup": WARMUP}  # fmt: skip
    data = {"config": config, "tokens_per_s": measured, "ratio_to_none": ratios, "cpu_us_per_batch": per_batch}
    path = write_results("bench_task_encoder", data, quick=args.quick)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
