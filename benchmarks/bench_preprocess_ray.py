"""``--executor ray`` against ``--workers 2`` on one machine: documents/s and tokens/s, same inputs, same cores.

The corpus is ``jsonl_corpus.py``'s (pseudo-English JSON lines), split into 8 files; tokenizers:
``bytes`` and the byte-level BPE that script trains. Each row is a fresh ``statefulset preprocess``
process timed from start to exit (so Ray's start-up, ~5 s for a local Ray, is inside the Ray
rows; the "tokenising" column subtracts the time until the first task is submitted, read from
the run's own log). Outputs are checked byte for byte between the two executors.

    python benchmarks/bench_preprocess_ray.py [--docs 100000]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from jsonl_corpus import ensure_corpus, train_tokenizer  # noqa: E402


def split(path: str, folder: str, parts: int) -> list[str]:
    with open(path, "rb") as f:
        lines = f.readlines()
    out = []
    for k in range(parts):
        name = os.path.join(folder, f"part-{k}.jsonl")
        with open(name, "wb") as f:
            f.writelines(lines[k::parts])
        out.append(name)
    return out


def run(inputs: list[str], prefix: str, tokenizer: str, extra: list[str]) -> dict:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "statefulset", "preprocess", "--input", *inputs, "--output-prefix", prefix,
         "--tokenizer", tokenizer, "--append-eod", "--quiet", *extra],
        capture_output=True, text=True, env=env, timeout=3600, check=True,
    )  # fmt: skip
    seconds = time.perf_counter() - began
    first = done.stdout.splitlines()[0]  # "N documents, T tokens in S s (...)"
    documents = int(first.split(" documents")[0].replace(",", ""))
    tokens = int(first.split(", ")[1].split(" tokens")[0].replace(",", ""))
    return {"seconds": seconds, "documents": documents, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=100_000)
    args = parser.parse_args()
    corpus = ensure_corpus(args.docs)["path"]
    with tempfile.TemporaryDirectory() as folder:
        bpe = os.path.join(folder, "tokenizer.json")
        train_tokenizer(corpus, bpe)
        inputs = split(corpus, folder, 8)
        for path in inputs:  # warm the page cache
            with open(path, "rb") as f:
                f.read()
        rows = {}
        for name, tokenizer in (("bytes", "bytes"), ("bpe", bpe)):
            local = run(inputs, os.path.join(folder, f"{name}-local"), tokenizer, ["--workers", "2"])
            ray = run(inputs, os.path.join(folder, f"{name}-ray"), tokenizer,
                      ["--executor", "ray", "--task-bytes", str(16 << 20)])  # fmt: skip
            same = all(
                filecmp.cmp(os.path.join(folder, f"{name}-local_text_document{e}"),
                            os.path.join(folder, f"{name}-ray_text_document{e}"), shallow=False)
                for e in (".bin", ".idx")
            )  # fmt: skip
            rows[name] = {"workers_2": local, "ray": ray, "identical": same,
                          "ray_over_workers_2": local["seconds"] / ray["seconds"]}  # fmt: skip
            print(name, json.dumps(rows[name]), flush=True)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "bench_preprocess_ray.json"), "w") as f:
        json.dump({"docs": args.docs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
