"""``statefulset demo``: the main job, end to end, on a corpus the package generates (no downloads).

It exercises every capability that exists and ends with one verdict line.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from collections.abc import Callable

import numpy

from .indexed import IndexedDataset
from .inspection import inspect_shard
from .preprocess import preprocess
from .tokenization import ByteTokenizer
from .writer import find_prefixes, merge_datasets

_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when what if can more no out so said who "
    "data model token shard index sample stream batch worker rank state loader epoch seed order resume "
    "checkpoint gradient layer tensor pipeline parallel memory file read write merge split blend weight "
    "quick brown fox jumps over lazy dog river mountain forest city light night morning winter summer"
).split()


def generate_documents(count: int, seed: int = 1234) -> list[dict[str, str]]:
    """Deterministic pseudo-English documents with Zipf-distributed words and varied lengths."""
    rng = numpy.random.default_rng(seed)
    weights = 1.0 / numpy.arange(1, len(_WORDS) + 1)
    weights /= weights.sum()
    docs = []
    for i in range(count):
        sentences = []
        for _ in range(int(rng.geometric(0.15))):
            words = [_WORDS[w] for w in rng.choice(len(_WORDS), size=int(rng.integers(4, 18)), p=weights)]
            sentences.append(" ".join(words).capitalize() + ".")
        docs.append({"id": str(i), "text": " ".join(sentences)})
    return docs


def write_demo_corpus(folder: str, documents: int = 6000) -> list[str]:
    """Three JSON-lines parts, one gzipped, named so that natural order matters (1, 2, 10)."""
    os.makedirs(folder, exist_ok=True)
    docs = generate_documents(documents)
    cut = [0, documents // 3, 2 * documents // 3, documents]
    paths = []
    for part, name in enumerate(("part_1.jsonl", "part_2.jsonl.gz", "part_10.jsonl")):
        path = os.path.join(folder, name)
        lines = "".join(json.dumps(d) + "\n" for d in docs[cut[part] : cut[part + 1]]).encode()
        with (gzip.open if name.endswith(".gz") else open)(path, "wb") as f:
            f.write(lines)
        paths.append(path)
    return paths


def run_demo(folder: str = "statefulset-demo", documents: int = 6000, say: Callable[[str], None] = print) -> bool:
    """Run every step; return True when every check passed."""
    start = time.perf_counter()
    checks: list[tuple[str, bool]] = []
    raw = os.path.join(folder, "raw")
    shards = os.path.join(folder, "shards")
    say(f"[1/5] generating the built-in corpus: {documents:,} documents in {raw}")
    inputs = write_demo_corpus(raw, documents)

    say("[2/5] statefulset preprocess (byte-level tokenizer, --append-eod, --workers 2), one shard per part")
    for path in inputs:
        name = os.path.basename(path).split(".")[0]
        result = preprocess([path], os.path.join(shards, name), append_eod=True, workers=2, show_progress=False)
        say("      " + result.summary().splitlines()[0])

    say("[3/5] statefulset merge, natural order (part_1, part_2, part_10)")
    parts = find_prefixes(shards)
    say("      " + " + ".join(os.path.basename(p) for p in parts))
    corpus = merge_datasets(parts, os.path.join(folder, "corpus_text_document"))

    say("[4/5] statefulset inspect")
    report = inspect_shard(corpus.path_prefix, vocab_size=ByteTokenizer.vocab_size)
    say("\n".join("      " + line for line in report.text().splitlines()))
    checks.append(("inspect: valid, token ids inside the vocabulary", report.valid))

    say("[5/5] reading it back")
    tokenizer = ByteTokenizer()
    expected = generate_documents(documents)
    decoded_ok = len(corpus) == documents and all(
        tokenizer.decode(corpus[i]) == expected[i]["text"] and int(corpus[i][-1]) == tokenizer.eod
        for i in range(len(corpus))
    )
    checks.append((f"all {documents:,} documents decode to their text, in input order", decoded_ok))
    rng = numpy.random.default_rng(0)
    picks = rng.integers(0, len(corpus), 1000)
    reopened = IndexedDataset(corpus.path_prefix)
    checks.append(
        (
            "1,000 random reads agree after reopening",
            all(numpy.array_equal(reopened[i], corpus[i]) for i in picks),
        )
    )
    say(f"      sample document {int(picks[0])}: {tokenizer.decode(corpus[int(picks[0])])[:72]!r}...")

    for name, ok in checks:
        say(f"      {'ok  ' if ok else 'FAIL'} {name}")
    passed = all(ok for _, ok in checks)
    seconds = time.perf_counter() - start
    verdict = "PASS" if passed else "FAIL"
    passed_count = sum(ok for _, ok in checks)
    say(f"demo: {verdict}: {passed_count}/{len(checks)} checks in {seconds:.1f} s; files in {folder}")
    return passed
