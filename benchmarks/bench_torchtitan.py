"""torchtitan's loaders side by side (issue 30): ``python benchmarks/bench_torchtitan.py [--quick]``.

The same documents two ways: Megatron ``bin/idx`` shards for ``StatefulsetDataLoader``, and a local
JSON-lines dataset for torchtitan 0.3's ``HuggingFaceTextDataLoader`` (registered in its
``DATASETS`` table as ``statefulset_bench``; a document's text is its token ids, which a tokenizer
here splits back, so both loaders hand out the same tokens and no BPE time is measured). Both
loaders are built as torchtitan's ``Trainer`` builds them (DP 1, ``local_batch_size`` x ``seq_len``).

For each loader, in a fresh process per run, alternated, ``--repeats`` rounds:

- tokens/s: ``--batches`` batches through ``next()`` after the first (workers started);
- resume: after those batches, ``state_dict()``; then the seconds from building a new loader to
  its first batch, ``load_state_dict()`` included (what a restarted job waits for).

Median and spread (min, max) of each. Results: ``benchmarks/results/bench_torchtitan.json``
(``--quick``: ``benchmarks/out/quick/``, a smoke size). Needs torchtitan 0.3 and ``datasets``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

LOADERS = ("statefulset", "huggingface")
VOCAB = 50_000


def corpus(documents: int) -> tuple[str, str]:
    """(shard prefix, JSON-lines file) of the same documents, written once under benchmarks/out/torchtitan."""
    import numpy

    from statefulset import IndexedDatasetWriter

    folder = os.path.join(HERE, "out", "torchtitan", f"d{documents}")
    prefix, jsonl = os.path.join(folder, "corpus"), os.path.join(folder, "corpus.jsonl")
    if os.path.exists(prefix + ".idx") and os.path.exists(jsonl):
        return prefix, jsonl
    os.makedirs(folder, exist_ok=True)
    rng = numpy.random.default_rng(30)
    lengths = numpy.minimum(rng.geometric(1 / 500, documents), 8000)
    eos = VOCAB - 1
    with IndexedDatasetWriter(prefix, numpy.uint16) as writer, open(jsonl + ".tmp", "w") as f:
        for n in lengths.tolist():
            ids = rng.integers(0, eos, n).tolist()
            writer.add_document(numpy.array([*ids, eos], dtype=numpy.uint16))  # what the tokenizer's add_eos gives
            f.write(json.dumps({"text": " ".join(map(str, ids))}) + "\n")
    os.replace(jsonl + ".tmp", jsonl)
    return prefix, jsonl


def _ids_tokenizer():
    from torchtitan.components.tokenizer import BaseTokenizer

    class IdsTokenizer(BaseTokenizer):
        """Token ids written as text, read back: no BPE cost in either loader."""

        def __init__(self) -> None:
            super().__init__()
            self.eos_id, self.bos_id = VOCAB - 1, None

        def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
            return [*map(int, text.split()), *([self.eos_id] if add_eos else [])]

        def decode(self, ids: list[int]) -> str:
            return " ".join(map(str, ids))

        def get_vocab_size(self) -> int:
            return VOCAB

    return IdsTokenizer()


def _build(job: dict):
    kwargs = {"dp_world_size": 1, "dp_rank": 0, "tokenizer": _ids_tokenizer(), "seq_len": job["seq_len"],
              "local_batch_size": job["batch"], "snapshot_every_n_steps": job["snapshot_every"]}  # fmt: skip
    if job["loader"] == "statefulset":
        from statefulset.integrations.torchtitan import StatefulsetDataLoader

        return StatefulsetDataLoader.Config(data_path=job["prefix"], split="100,0,0", packing="native",
                                            num_workers=job["workers"]).build(**kwargs)  # fmt: skip
    from datasets import load_dataset
    from torchtitan.hf_datasets import DatasetConfig, text_datasets

    text_datasets.DATASETS["statefulset_bench"] = DatasetConfig(
        path=job["jsonl"],
        loader=lambda path: load_dataset("json", data_files=path, split="train"),
        sample_processor=lambda sample: sample["text"],
    )
    config = text_datasets.HuggingFaceTextDataLoader.Config(dataset="statefulset_bench", num_workers=job["workers"])
    return config.build(**kwargs)


def child(job: dict) -> dict[str, float]:
    """One run of one loader: tokens/s, then the resume time."""
    loader = _build(job)
    batches = iter(loader)
    next(batches)  # workers started and warm
    start = time.perf_counter()
    for _ in range(job["batches"]):
        next(batches)
    tokens_per_s = job["batches"] * job["batch"] * job["seq_len"] / (time.perf_counter() - start)
    state = loader.state_dict()
    start = time.perf_counter()
    resumed = _build(job)
    resumed.load_state_dict(state)
    next(iter(resumed))
    return {"tokens_per_s": tokens_per_s, "resume_seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=20_000)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--snapshot-every", type=int, default=1, help="torchdata's snapshot_every_n_steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="300 documents, 5 batches of 2 x 256")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from provenance import summary, write_results

    if args.quick:
        args.documents, args.batches, args.batch, args.seq_len = 300, 5, 2, 256
    prefix, jsonl = corpus(args.documents)
    runs: dict[str, dict[str, list[float]]] = {name: {"tokens_per_s": [], "resume_seconds": []} for name in LOADERS}
    for _ in range(args.repeats):
        for name in LOADERS:  # alternated: a change in machine load spreads over both
            job = {"loader": name, "prefix": prefix, "jsonl": jsonl, "batches": args.batches, "batch": args.batch,
                   "seq_len": args.seq_len, "workers": args.workers, "snapshot_every": args.snapshot_every}  # fmt: skip
            done = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], capture_output=True,
                                  text=True, check=True, timeout=1800)  # fmt: skip
            for key, value in json.loads(done.stdout.strip().splitlines()[-1]).items():
                runs[name][key].append(value)
    figures = {name: {key: summary(values) for key, values in rows.items()} for name, rows in runs.items()}
    settings = {k: getattr(args, k) for k in ("documents", "batches", "batch", "seq_len", "workers", "snapshot_every")}
    path = write_results("bench_torchtitan", {"settings": settings, "loaders": figures},
                         extra=("torchtitan", "datasets"), quick=args.quick)  # fmt: skip
    print(path)
    for name in LOADERS:
        tps, resume = figures[name]["tokens_per_s"], figures[name]["resume_seconds"]
        print(f"{name:12s} {tps['median']:>14,.0f} tokens/s   resume {resume['median']:.3f} s")


if __name__ == "__main__":
    main()
