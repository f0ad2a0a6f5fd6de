"""``statefulset demo``: the main job, end to end, on a corpus the package generates (no downloads).

It exercises every capability that exists and ends with one verdict line.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import time
from collections.abc import Callable

import numpy
import yaml

from statefulset import settings
from statefulset.loading.datasets import get_train_dataset
from statefulset.loading.loader import get_savable_loader
from statefulset.loading.worker_config import WorkerConfig
from statefulset.shards.merge import merge_datasets
from statefulset.shards.names import find_prefixes
from statefulset.shards.reader import IndexedDataset
from statefulset.shards.tokenizers import ByteTokenizer
from statefulset.shards.writer import IndexedDatasetWriter
from statefulset.streams.opening import open_stream
from statefulset.tools.inspection import inspect_shard
from statefulset.tools.preprocess import preprocess

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


def demo_spec(
    folder: str | None = None,
    packing: str = "native",
    documents: int = 2000,
    seq_length: int = 128,
    split: str = "98,2,0",
    **spec: object,
) -> str:
    """Write the built-in corpus as two byte-tokenised shards plus a YAML spec; return the spec's path.

    For examples and tutorials: no download, no preprocessing pool, a second of work. The blend
    is ``part_a`` 0.7 / ``part_b`` 0.3 with end-of-document token 256 (:class:`ByteTokenizer`);
    extra keywords are added to the spec (for example ``num_samples`` for megatron packing).
    An existing folder is reused: the shards are only written when missing. Call it once before
    starting ranks rather than from every rank at the same time.
    """
    folder = folder or os.path.join(settings.user_cache_dir(), "demo-corpus")
    os.makedirs(folder, exist_ok=True)
    tokenizer = ByteTokenizer()
    docs = generate_documents(documents)
    halves = {"part_a": docs[: documents // 2], "part_b": docs[documents // 2 :]}
    for name, part in halves.items():
        prefix = os.path.join(folder, f"{name}_{documents}")
        if os.path.exists(prefix + ".idx"):
            continue
        tokens, lengths = tokenizer.encode_batch([d["text"] for d in part])
        ends = numpy.cumsum(lengths)
        with IndexedDatasetWriter(prefix, numpy.uint16) as writer:
            for end, length in zip(ends, lengths, strict=True):
                writer.add_document(numpy.append(tokens[end - length : end], tokenizer.eod))
    weights = {"part_a": 0.7, "part_b": 0.3}
    body = {
        "data_path": {f"{name}_{documents}": weights[name] for name in halves},
        "seq_length": seq_length,
        "split": split,
        "seed": 1234,
        "packing": packing,
        **spec,
    }
    if packing == "megatron":
        body.setdefault("path_to_cache", "cache")
    digest = hashlib.blake2b(repr(sorted(body.items())).encode(), digest_size=4).hexdigest()
    path = os.path.join(folder, f"{packing}-{seq_length}-{digest}.yaml")
    with open(path + f".{os.getpid()}.tmp", "w", encoding="utf-8") as f:
        yaml.safe_dump(body, f, sort_keys=False)
    os.replace(path + f".{os.getpid()}.tmp", path)
    return path


def run_demo(folder: str = "statefulset-demo", documents: int = 6000, say: Callable[[str], None] = print) -> bool:
    """Run every step; return True when every check passed."""
    start = time.perf_counter()
    checks: list[tuple[str, bool]] = []
    raw = os.path.join(folder, "raw")
    shards = os.path.join(folder, "shards")
    say(f"[1/7] generating the built-in corpus: {documents:,} documents in {raw}")
    inputs = write_demo_corpus(raw, documents)

    say("[2/7] statefulset preprocess (byte-level tokenizer, --append-eod, --workers 2), one shard per part")
    for path in inputs:
        name = os.path.basename(path).split(".")[0]
        result = preprocess([path], os.path.join(shards, name), append_eod=True, workers=2, show_progress=False)
        say("      " + result.summary().splitlines()[0])

    say("[3/7] statefulset merge, natural order (part_1, part_2, part_10)")
    parts = find_prefixes(shards)
    say("      " + " + ".join(os.path.basename(p) for p in parts))
    corpus = merge_datasets(parts, os.path.join(folder, "corpus_text_document"))

    say("[4/7] statefulset inspect")
    report = inspect_shard(corpus.path_prefix, vocab_size=ByteTokenizer.vocab_size)
    say("\n".join("      " + line for line in report.text().splitlines()))
    checks.append(("inspect: valid, token ids inside the vocabulary", report.valid))

    say("[5/7] reading it back")
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

    say("[6/7] sample streams from YAML specs: the same blend in both packings")
    checks += _streams(folder, parts, tokenizer, say)

    say("[7/7] simulated data-parallel training: save mid-way, restore into fresh loaders, compare")
    checks += _training(os.path.join(folder, "native.yaml"), say)

    for name, ok in checks:
        say(f"      {'ok  ' if ok else 'FAIL'} {name}")
    passed = all(ok for _, ok in checks)
    seconds = time.perf_counter() - start
    verdict = "PASS" if passed else "FAIL"
    passed_count = sum(ok for _, ok in checks)
    say(f"demo: {verdict}: {passed_count}/{len(checks)} checks in {seconds:.1f} s; files in {folder}")
    return passed


def _streams(folder: str, parts: list[str], tokenizer: ByteTokenizer, say: Callable[[str], None]) -> list:
    blend = {os.path.relpath(p, folder): w for p, w in zip(parts, (0.5, 0.3, 0.2), strict=True)}
    common = {"data_path": blend, "seq_length": 128, "split": "98,2,0", "seed": 1234}
    specs = {
        "megatron": {**common, "packing": "megatron", "num_samples": 4000, "path_to_cache": "cache"},
        "native": {**common, "packing": "native"},
    }
    checks = []
    for packing, spec in specs.items():
        path = os.path.join(folder, f"{packing}.yaml")
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(spec, f, sort_keys=False)
        start = time.perf_counter()
        stream = open_stream(path)
        opened = time.perf_counter() - start
        size = "unbounded (any position)" if stream.unbounded else f"{len(stream):,} samples"
        say(f"      {path}: packing {packing}, {size}, opened in {opened * 1000:.1f} ms")
        for p in (0, 1):
            say(f"        sample {p}: {tokenizer.decode(stream[p]['text'][:60])!r}")
        picks = numpy.random.default_rng(1).integers(0, len(stream), 64)
        batch = stream.gather(picks)
        again = open_stream(path).gather(picks)
        ok = numpy.array_equal(batch, again) and all(
            numpy.array_equal(stream[int(p)]["text"], row) for p, row in zip(picks, batch, strict=True)
        )
        checks.append((f"{packing}: stream[p] is a pure function of (spec, p), batched or not, reopened", ok))
    return checks


def _take(loader, steps: int) -> list[list[int]]:
    return [b["sample_id"].tolist() for _, b in zip(range(steps), loader, strict=False)]


def _loaders(spec: str, world: int, workers: int, batch: int = 4) -> list:
    return [
        get_savable_loader(
            get_train_dataset(
                spec, batch_size=batch, worker_config=WorkerConfig(rank=r, world_size=world, num_workers=workers)
            )
        )
        for r in range(world)
    ]


def _training(spec: str, say: Callable[[str], None], steps: int = 40, cut: int = 17) -> list:
    """Two DP ranks train ``steps`` steps; a second run saves at ``cut`` and restores in other shapes."""
    from tqdm import tqdm

    reference = [_take(loader, steps) for loader in _loaders(spec, world=2, workers=1)]
    first = _loaders(spec, world=2, workers=1)
    bar = tqdm(total=cut, desc="      training (2 DP ranks)", unit="step", leave=False)
    for _ in range(cut):
        for loader in first:
            next(iter(loader))
        bar.update()
    bar.close()
    states = [loader.save_state_rank() for loader in first]  # what save_state_global gathers
    size = len(repr(states[0]))
    say(f"      saved at step {cut}: {size} bytes per rank, e.g. batches={states[0]['batches']}")
    checks = []
    same_dp = _loaders(spec, world=2, workers=2)
    for loader in same_dp:
        loader.restore_state_global(states)
    resumed = [_take(loader, steps - cut) for loader in same_dp]
    ok = all(reference[r][cut:] == resumed[r] for r in range(2))
    checks.append((f"restore with 2 workers instead of 1: steps {cut}..{steps} identical on both ranks", ok))
    one = _loaders(spec, world=1, workers=0, batch=8)[0]
    one.restore_state_global(states)
    merged = sorted(i for r in range(2) for row in reference[r][cut:] for i in row)
    got = [i for row in _take(one, steps - cut) for i in row]
    checks.append(("restore into 1 DP rank (batch 8): the same samples, no loss, no repeat", got == merged))
    say(f"      resumed streams: first ids after the save {resumed[0][0]} (rank 0), {resumed[1][0]} (rank 1)")
    return checks
