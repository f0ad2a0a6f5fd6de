"""Preprocessing JSON lines into bin/idx: Megatron-LM's ``preprocess_data.py`` loop against ours.

Ours is ``statefulset.tools.preprocess``.

Both sides read the same synthetic JSON-lines corpus (``jsonl_corpus.py``), use the same tokenizer
and worker count, append the end-of-document token, and write ``<prefix>_text_document.{bin,idx}``.

* ``anchor``: the essential loop of Megatron-LM's ``tools/preprocess_data.py`` (not installed here,
  so it is reproduced below): the main process opens the file in text mode and iterates
  ``multiprocessing.Pool(workers, initializer).imap(encode, fin, 32)``; ``encode`` parses one line
  and tokenises each sentence with one tokenizer call returning a Python list; the main process
  calls megatron-core's ``IndexedDatasetBuilder.add_document`` per document and ``finalize``. The
  progress print every ``--log-interval`` documents is left out (it costs nothing measurable).
* ``ours``: ``statefulset.tools.preprocess.preprocess(..., append_eod=True, workers=N, show_progress=False)``.

Tokenizers: ``bytes`` (UTF-8 bytes, EOD 256; the anchor calls ``list(text.encode("utf-8"))``) and
``hf``, a byte-level BPE trained here on the corpus (the anchor calls ``Tokenizer.encode(text).ids``
with ``TOKENIZERS_PARALLELISM=false`` in its workers; ours calls ``encode_batch`` on chunks).

Every run is a fresh child process. Imports happen before the timer; the timer covers opening the
input, starting the pool, tokenising and writing, up to ``finalize`` (anchor) or the return of
``preprocess`` (ours, which fsyncs its outputs; the anchor's fsync is measured after its timer
and reported separately). The input is read once before every run so the page cache is warm.

Output: a markdown section on stdout and in ``benchmarks/out/preprocess.md``, raw figures in
``benchmarks/out/preprocess.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import filecmp
import hashlib
import io
import json
import multiprocessing
import os
import pstats
import resource
import subprocess
import sys
import time
from typing import Any

from benchenv import busy_cpu_s, environment, environment_markdown, spread, wait_for_quiet
from jsonl_corpus import EOD_TOKEN, OUT_DIR, ensure_corpus, train_tokenizer
from plots import add_plot_argument, apply_quick, publish_result

DEFAULT_DOCS = 200_000
TOKENIZERS = ("bytes", "hf")
SIDES = ("anchor", "ours")
# The HF tokenizer's encode_batch spreads over a Rust thread pool when preprocess runs in-process
# (workers=1); this extra variant pins it to one thread to show what that is worth.
SERIAL = "ours_serial"
TARGET = 2.0
# Runs during which other processes used more than this many cores on average are redone (the
# machine may be shared); our own output's kernel writeback stays well below it.
FOREIGN_LIMIT = 0.15


# -- the anchor: Megatron-LM tools/preprocess_data.py, reduced to its essential loop ----------------
_ANCHOR: dict[str, Any] = {}


def _anchor_init(kind: str, tokenizer_path: str) -> None:
    """Pool initializer (Megatron's ``Encoder.initializer``): build the tokenizer once per process."""
    if kind == "hf":
        # What a multiprocessing job typically does: N processes already use the cores.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(tokenizer_path)
        _ANCHOR.update(
            tokenize=lambda text: backend.encode(text).ids,
            eod=backend.token_to_id(EOD_TOKEN),
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
        )
    else:
        _ANCHOR.update(tokenize=lambda text: list(text.encode("utf-8")), eod=256, vocab_size=257)
    _ANCHOR["json_keys"] = ("text",)


def _anchor_encode(json_line: str) -> tuple[dict, dict, int]:
    """Megatron's ``Encoder.encode``: one line in, token lists per key out."""
    data = json.loads(json_line)
    tokenize, eod = _ANCHOR["tokenize"], _ANCHOR["eod"]
    ids, lens = {}, {}
    for key in _ANCHOR["json_keys"]:
        text = data[key]
        sentences = text if isinstance(text, list) else [text]
        doc_ids: list[int] = []
        sentence_lens: list[int] = []
        for sentence in sentences:
            sentence_ids = tokenize(sentence)
            if len(sentence_ids) > 0:
                doc_ids.extend(sentence_ids)
                sentence_lens.append(len(sentence_ids))
        if len(doc_ids) > 0:  # --append-eod
            doc_ids.append(eod)
            sentence_lens[-1] += 1
        ids[key] = doc_ids
        lens[key] = sentence_lens
    return ids, lens, len(json_line)


def _run_anchor(kind: str, tokenizer_path: str, workers: int, input_path: str, prefix: str) -> dict[str, Any]:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    t0 = time.perf_counter()
    fin = open(input_path, encoding="utf-8")  # noqa: SIM115 - Megatron closes it after the loop
    _anchor_init(kind, tokenizer_path)  # Megatron builds one in the main process too, for vocab_size
    pool = multiprocessing.Pool(workers, initializer=_anchor_init, initargs=(kind, tokenizer_path))
    encoded_docs = pool.imap(_anchor_encode, fin, 32)
    bin_path, idx_path = prefix + "_text_document.bin", prefix + "_text_document.idx"
    builders = {"text": IndexedDatasetBuilder(bin_path, dtype=DType.optimal_dtype(_ANCHOR["vocab_size"]))}
    docs = tokens = total_bytes = 0
    for docs, (doc, sentence_lens, bytes_processed) in enumerate(encoded_docs, start=1):  # noqa: B007
        total_bytes += bytes_processed
        for key in doc:
            builders[key].add_document(doc[key], sentence_lens[key])
            tokens += len(doc[key])
    fin.close()
    builders["text"].finalize(idx_path)
    t1 = time.perf_counter()
    pool.close()
    pool.join()
    # Not timed: what making the anchor's output durable costs (ours fsyncs inside its timer).
    for path in (bin_path, idx_path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    t2 = time.perf_counter()
    return {"seconds": t1 - t0, "fsync_after_s": t2 - t1, "docs": docs, "tokens": tokens, "chars": total_bytes}


def _spec(kind: str, tokenizer_path: str):
    from statefulset.shards.tokenizers import TokenizerSpec

    # The EOD token is named explicitly so a stray tokenizer_config.json in the folder cannot change it.
    return TokenizerSpec("bytes") if kind == "bytes" else TokenizerSpec(tokenizer_path, eod_token=EOD_TOKEN)


def _run_ours(kind: str, tokenizer_path: str, workers: int, input_path: str, prefix: str) -> dict[str, Any]:
    from statefulset.tools.preprocess import preprocess

    spec = _spec(kind, tokenizer_path)
    t0 = time.perf_counter()
    result = preprocess(
        [input_path], prefix, json_keys=("text",), tokenizer=spec, append_eod=True, workers=workers,
        show_progress=False,
    )  # fmt: skip
    t1 = time.perf_counter()
    return {"seconds": t1 - t0, "docs": result.documents, "tokens": sum(result.tokens.values())}


def _loaded_sources() -> tuple[str, list[str]]:
    """Digest and file names of the statefulset modules this process imported (the code under test)."""
    digest, names = hashlib.sha256(), []
    for name in sorted(n for n in sys.modules if n == "statefulset" or n.startswith("statefulset.")):
        path = getattr(sys.modules[name], "__file__", None)
        if path:
            names.append(os.path.basename(path))
            with open(path, "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()[:12], names


def run_child(job: dict[str, Any]) -> None:
    """One timed run in this (fresh) process; prints its result as one JSON line."""
    # Import everything either side needs before any timer starts, so both pay the same (nothing).
    import megatron.core.datasets.indexed_dataset  # noqa: F401
    import tokenizers  # noqa: F401

    import statefulset.tools.preprocess  # noqa: F401

    source, modules = _loaded_sources()
    side = job["side"]
    if side == SERIAL:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    run = _run_anchor if side == "anchor" else _run_ours
    result = run(job["tokenizer"], job["tokenizer_path"], job["workers"], job["input"], job["prefix"])
    print(json.dumps({**job, **result, "source": source, "modules": modules}))


# -- parent side ----------------------------------------------------------------------------------
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git_state() -> dict[str, Any]:
    """Commit and uncommitted changes of the package (read-only git calls; no git, no entry)."""

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": git("status", "--porcelain", "--", "statefulset")}
    except (OSError, subprocess.CalledProcessError):
        return {}


def _warm(path: str) -> float:
    """Read the input once so every run starts with it in the page cache."""
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass
    return time.perf_counter() - t0


def _outputs(prefix: str) -> tuple[str, str]:
    return prefix + "_text_document.bin", prefix + "_text_document.idx"


def _remove(prefix: str) -> None:
    for path in _outputs(prefix):
        if os.path.exists(path):
            os.remove(path)


def _spawn(job: dict[str, Any], max_wait: float) -> dict[str, Any]:
    _remove(job["prefix"])
    _warm(job["input"])
    waited = wait_for_quiet(max_wait, 0.25, sample=2.0, pause=8.0, say=True)
    before_busy, before_child = busy_cpu_s(), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(job)]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    wall = time.perf_counter() - t0
    after_child = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (after_child.ru_utime - before_child.ru_utime) + (after_child.ru_stime - before_child.ru_stime)
    result = json.loads(out.strip().splitlines()[-1])
    # CPU the machine spent on anything but this child and its pool workers while it ran: a
    # measure of interference (kernel writeback of our own output counts too, so it is never 0).
    foreign = max(busy_cpu_s() - before_busy - own, 0.0)
    result.update(waited_s=waited, child_cpu_s=own, foreign_cores=foreign / wall)
    return result


def _identical(a: str, b: str) -> bool:
    return all(filecmp.cmp(x, y, shallow=False) for x, y in zip(_outputs(a), _outputs(b), strict=True))


def _tokenizer(args: argparse.Namespace) -> dict[str, Any]:
    """tokenizer.json in the output folder, trained once on the first ``--train-docs`` documents."""
    path = os.path.join(args.out_dir, "tokenizer.json")
    meta_path = path + ".meta.json"
    want = {"train_docs": args.train_docs, "requested_vocab_size": args.vocab_size}
    if os.path.exists(path) and os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if {k: meta.get(k) for k in want} == want:
            return meta
    # The first k documents do not depend on --docs, so every run trains on the same text.
    docs = args.docs if args.docs >= args.train_docs else args.train_docs
    source = ensure_corpus(docs, args.out_dir)["path"]
    meta = {**train_tokenizer(str(source), path, vocab_size=args.vocab_size, train_docs=args.train_docs), **want}
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def _profile(args: argparse.Namespace, corpus: str, tokenizer_path: str) -> dict[str, str]:
    """cProfile of ours at workers=1 (everything in one process, so the profile sees all of it)."""
    from statefulset.tools.preprocess import preprocess

    texts = {}
    for kind in args.tokenizers:
        prefix = os.path.join(args.out_dir, f"pp_profile_{kind}")
        profiler = cProfile.Profile()
        profiler.enable()
        preprocess(
            [corpus], prefix, json_keys=("text",), tokenizer=_spec(kind, tokenizer_path), append_eod=True,
            workers=1, show_progress=False,
        )  # fmt: skip
        profiler.disable()
        _remove(prefix)
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(15)
        texts[kind] = buf.getvalue()
        print(f"--- cProfile, ours, {kind}, workers=1 (by tottime) ---\n{texts[kind]}", file=sys.stderr)
    return texts


def _round_seconds(runs: list[dict[str, Any]], kind: str, workers: int) -> list[dict[str, float]]:
    """Per round, each side's seconds (its last undisturbed run, else its last run)."""
    by_round: dict[int, dict[str, float]] = {}
    for run in runs:
        if (run["tokenizer"], run["workers"]) != (kind, workers):
            continue
        sides = by_round.setdefault(run["round"], {})
        if not run["disturbed"] or run["side"] not in sides:
            sides[run["side"]] = run["seconds"]
    return [by_round[k] for k in sorted(by_round)]


def _summarise(runs: list[dict[str, Any]], identical: dict[str, list[bool]]) -> list[dict[str, Any]]:
    rows = []
    for kind in dict.fromkeys(r["tokenizer"] for r in runs):
        for workers in dict.fromkeys(r["workers"] for r in runs if r["tokenizer"] == kind):
            row: dict[str, Any] = {"tokenizer": kind, "workers": workers}
            for side in (*SIDES, SERIAL):
                mine = [r for r in runs if (r["tokenizer"], r["workers"], r["side"]) == (kind, workers, side)]
                if not mine:
                    continue
                clean = [r for r in mine if not r["disturbed"]]
                disturbed = len(mine) - len(clean)
                mine = clean or mine
                seconds = [r["seconds"] for r in mine]
                median = spread(seconds)["median"]  # the headline: the median run, not the best
                row[side] = {
                    "seconds": spread(seconds),
                    "best_s": min(seconds),
                    "median_s": median,
                    "docs": mine[0]["docs"],
                    "tokens": mine[0]["tokens"],
                    "docs_per_s": mine[0]["docs"] / median,
                    "tokens_per_s": mine[0]["tokens"] / median,
                    "runs_used": len(mine),
                    "runs_disturbed": disturbed,
                    "foreign_cores_max": max(r["foreign_cores"] for r in mine),
                }
                if side == "anchor":
                    row[side]["fsync_after_s"] = spread([r["fsync_after_s"] for r in mine])
            # The headline ratio: the median of the per-round ratios (anchor seconds / ours seconds of
            # the same round), with their spread; a round's run is its last undisturbed attempt.
            rounds = _round_seconds(runs, kind, workers)
            for side, key in (("ours", "ratio"), (SERIAL, "ratio_serial")):
                ratios = [r["anchor"] / r[side] for r in rounds if "anchor" in r and side in r]
                if ratios:
                    row[f"{key}_rounds"] = spread(ratios)
                    row[key] = row[f"{key}_rounds"]["median"]
            row["target_met"] = row["ratio"] >= TARGET
            row["byte_identical"] = identical[f"{kind}/{workers}"]
            rows.append(row)
    return rows


def _markdown(result: dict[str, Any], command: str) -> str:
    corpus, tok = result["corpus"], result["tokenizer"]
    rows = result["summary"]
    tokens = {r["tokenizer"]: r["anchor"]["tokens"] for r in rows}
    token_text = ", ".join(f"{n:,} {k} tokens" for k, n in tokens.items())
    git = result["git_before"]
    modules = sorted({m for r in result["runs"] for m in r.get("modules", [])})
    dirty = [line[3:].rsplit("/", 1)[-1] for line in git.get("dirty", "").splitlines()]
    touched = [d for d in dirty if d in modules or not modules]
    code = f"statefulset at commit `{git.get('commit', 'unknown')[:10]}`"
    if touched:
        code += f" plus uncommitted changes to {', '.join(touched)}"
    elif dirty:
        code += f" (uncommitted changes to {', '.join(dirty)}, which preprocessing does not import)"
    if len(result["sources"]) > 1:
        code += " (**warning: the package's sources changed during the run; figures mix versions**)"
    else:
        code += f"; every run imported the same module sources (digest `{result['sources'][0]}`)"
    lines = [
        "### Preprocessing: JSON lines to bin/idx",
        "",
        environment_markdown(result["environment"]) + f" Code: {code}.",
        "",
        f'Corpus: {corpus["docs"]:,} JSON lines (`{{"text": ...}}`, {corpus["bytes"] / 1e6:,.0f} MB), '
        f"synthetic pseudo-English from `benchmarks/jsonl_corpus.py` (seed 1234): Zipf-distributed words "
        f"over a 60,000-word vocabulary, punctuation, paragraph breaks, some non-ASCII and `\\u`-escaped "
        f"words; geometric document lengths, mean {corpus['mean_chars']:,.0f} characters. "
        f"It yields {token_text} (end-of-document tokens included).",
        "",
        f"Tokenizers: `bytes` (UTF-8 bytes, EOD 256) and `hf`, a byte-level BPE (`tokenizers` "
        f"{result['environment'].get('tokenizers', '')}, ByteLevel pre-tokenizer and decoder, "
        f"`{EOD_TOKEN}`) with a {tok['vocab_size']:,}-token vocabulary, trained on the first "
        f"{tok['train_docs']:,} documents (training not timed). Both write uint16 tokens.",
        "",
        "* **Anchor**: the loop of Megatron-LM `tools/preprocess_data.py` (reproduced in the script: "
        "`Pool(workers).imap(encode, fin, 32)`, one tokenizer call per text returning a Python list, "
        "megatron-core `IndexedDatasetBuilder.add_document` per document, `finalize`). "
        '`bytes`: `list(text.encode("utf-8"))`; `hf`: `Tokenizer.encode(text).ids` with '
        "`TOKENIZERS_PARALLELISM=false` in the workers. Its output is not fsynced; doing so afterwards "
        "took a further "
        + ", ".join(
            f"{r['anchor']['fsync_after_s']['median']:.1f} s ({r['tokenizer']}, {r['workers']} w)" for r in rows
        )
        + " (not counted).",
        "* **Ours**: `statefulset.tools.preprocess.preprocess([input], prefix, append_eod=True, workers=N, "
        "show_progress=False)`: 1 MiB chunks of lines, one `encode_batch` per chunk, arrays back to the "
        "main process, vectorised writer; the time includes its fsync of both outputs. With `workers=1` "
        "it runs in-process (no pool); with the `hf` tokenizer `encode_batch` may then use the Rust "
        "thread pool on both cores (the `ours, 1 thread` column sets `TOKENIZERS_PARALLELISM=false`). "
        "With `workers>1` it sets `TOKENIZERS_PARALLELISM=false` in its workers, like the anchor.",
        f"* Same input file, page cache warm (read before every run), each run a fresh process, "
        f"{result['repeats']} runs per configuration interleaved, the median run shown. The machine may be shared: "
        f"each run waits for an idle machine, and a run during which other processes used more than "
        f"{FOREIGN_LIMIT} cores on average is discarded and redone (discarded runs: {result['disturbed_runs']}). "
        f"Target: ours ≥ {TARGET:g}× the anchor's documents/s at the same worker count.",
        "",
        "Reproduce (full size; add `--docs 2000` for a smoke test):",
        "",
        "```bash",
        command,
        "```",
        "",
        "| Tokenizer | Workers | Anchor, s | Anchor docs/s | Ours, s | Ours docs/s | Ours tokens/s "
        "| Ours / anchor | Ours, 1 thread: docs/s (ratio) | Byte-identical `.bin` + `.idx` |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, o = r["anchor"], r["ours"]
        serial = f"{r[SERIAL]['docs_per_s']:,.0f} ({r['ratio_serial']:.2f}×)" if SERIAL in r else "="
        same = r["byte_identical"]
        lines.append(
            f"| {r['tokenizer']} | {r['workers']} | {a['median_s']:.1f} | {a['docs_per_s']:,.0f} "
            f"| {o['median_s']:.1f} | {o['docs_per_s']:,.0f} | {o['tokens_per_s'] / 1e6:,.2f}M "
            f"| **{r['ratio']:.2f}×** {_range(r.get('ratio_rounds'))}{'' if r['target_met'] else ' (below target)'} "
            f"| {serial} "
            f"| {'yes' if all(same) else '**NO**'} ({sum(same)}/{len(same)} runs) |"
        )
    return "\n".join(lines)


def _range(stat: dict[str, float] | None) -> str:
    return f"({stat['min']:.2f}–{stat['max']:.2f})" if stat else ""


def _write_report(result: dict[str, Any], out_dir: str) -> None:
    text = _markdown(result, result.get("command", "python benchmarks/bench_preprocess.py"))
    with open(os.path.join(out_dir, "preprocess.md"), "w") as f:
        f.write(text + "\n")
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=DEFAULT_DOCS, help=f"documents (default {DEFAULT_DOCS:,})")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts (default 1,2)")
    parser.add_argument("--tokenizers", default=",".join(TOKENIZERS), help="bytes, hf or both (default)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per configuration; the median is the headline (default 3)"
    )
    parser.add_argument("--train-docs", type=int, default=20_000, help="documents to train the BPE on")
    parser.add_argument("--vocab-size", type=int, default=32_000, help="BPE vocabulary size (default 32,000)")
    parser.add_argument("--out-dir", default=OUT_DIR, help="where everything goes (default benchmarks/out)")
    parser.add_argument("--keep-outputs", action="store_true", help="keep the last bin/idx of each side")
    parser.add_argument("--profile", action="store_true", help="also cProfile ours at workers=1 (not timed)")
    parser.add_argument(
        "--retries", type=int, default=2, help="extra runs when another process competed for the CPU (default 2)"
    )
    parser.add_argument(
        "--max-wait", type=float, default=1800, help="seconds to wait for an idle machine before each run"
    )
    parser.add_argument("--render", action="store_true", help="only rebuild preprocess.md from preprocess.json")
    add_plot_argument(parser)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    apply_quick(
        args, "bench_preprocess", docs=2_000, repeats=1, train_docs=1_000, vocab_size=2_000, retries=0, max_wait=1.0,
    )  # fmt: skip
    if args.child:
        run_child(json.loads(args.child))
        return
    args.out_dir = os.path.abspath(args.out_dir)
    if args.render:
        with open(os.path.join(args.out_dir, "preprocess.json")) as f:
            result = json.load(f)
        _write_report(result, args.out_dir)
        publish_result("bench_preprocess", result, not args.no_plot, quick=args.quick)
        return
    args.tokenizers = [t for t in args.tokenizers.split(",") if t]
    if not set(args.tokenizers) <= set(TOKENIZERS):
        parser.error(f"--tokenizers: choose from {', '.join(TOKENIZERS)}")
    worker_counts = [int(w) for w in args.workers.split(",")]

    corpus = ensure_corpus(args.docs, args.out_dir)
    print(f"corpus: {corpus['path']} ({corpus['bytes']:,} B)", file=sys.stderr)
    tok = _tokenizer(args) if "hf" in args.tokenizers else {"path": "", "vocab_size": 0, "train_docs": 0}
    tokenizer_path = str(tok["path"])

    git_before = _git_state()
    runs: list[dict[str, Any]] = []
    identical: dict[str, list[bool]] = {}
    for kind in args.tokenizers:
        for workers in worker_counts:
            sides = [*SIDES, SERIAL] if kind == "hf" and workers == 1 else list(SIDES)
            prefixes = {s: os.path.join(args.out_dir, f"pp_{s}_{kind}_w{workers}") for s in sides}
            same = identical.setdefault(f"{kind}/{workers}", [])
            for round_ in range(args.repeats):
                for side in sides:
                    job = {
                        "side": side,
                        "tokenizer": kind,
                        "workers": workers,
                        "input": corpus["path"],
                        "prefix": prefixes[side],
                        "tokenizer_path": tokenizer_path,
                        "round": round_,
                    }
                    for attempt in range(args.retries + 1):
                        run = _spawn(job, args.max_wait)
                        run["disturbed"] = run["foreign_cores"] > FOREIGN_LIMIT
                        runs.append(run)
                        print(
                            f"{kind} w={workers} round {round_ + 1}/{args.repeats} {side}: {run['seconds']:.2f} s, "
                            f"{run['docs'] / run['seconds']:,.0f} docs/s, others used {run['foreign_cores']:.2f} cores"
                            + (" (disturbed)" if run["disturbed"] else ""),
                            file=sys.stderr,
                        )
                        if not run["disturbed"]:
                            break
                        if attempt < args.retries:
                            print("  retrying: another process competed for the CPU", file=sys.stderr)
                same += [_identical(prefixes["anchor"], prefixes[s]) for s in sides if s != "anchor"]
            if not args.keep_outputs:
                for prefix in prefixes.values():
                    _remove(prefix)

    # Mean characters per document, from the anchor's own count of characters per line.
    first = next(r for r in runs if r["side"] == "anchor")
    corpus["mean_chars"] = (first["chars"] - first["docs"] * len('{"text": ""}\n')) / first["docs"]
    env = environment()
    import tokenizers

    env["tokenizers"] = tokenizers.__version__
    sources = sorted({r["source"] for r in runs})
    if len(sources) > 1:
        print(f"WARNING: statefulset's sources changed during the benchmark ({sources}); rerun it", file=sys.stderr)
    result: dict[str, Any] = {
        "script": "benchmarks/bench_preprocess.py",
        "environment": env,
        "corpus": corpus,
        "tokenizer": tok,
        "repeats": args.repeats,
        "target_ratio": TARGET,
        "summary": _summarise(runs, identical),
        "disturbed_runs": sum(r["disturbed"] for r in runs),
        "git_before": git_before,
        "git_after": _git_state(),
        "sources": sources,
        "runs": runs,
    }
    if args.profile:
        result["profile"] = _profile(args, str(corpus["path"]), tokenizer_path)
    result["command"] = "python benchmarks/bench_preprocess.py" + (
        f" --docs {args.docs}" if args.docs != DEFAULT_DOCS else ""
    )
    with open(os.path.join(args.out_dir, "preprocess.json"), "w") as f:
        json.dump(result, f, indent=2)
    _write_report(result, args.out_dir)
    publish_result("bench_preprocess", result, not args.no_plot, quick=args.quick)
    if not all(all(v) for v in identical.values()):
        raise SystemExit("byte-identity check FAILED")


if __name__ == "__main__":
    main()
