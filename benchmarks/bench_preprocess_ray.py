"""Preprocessing side by side on one machine: ``--executor ray`` vs ``--workers 2`` vs datatrove vs preprocess_data.py.

Same inputs (``jsonl_corpus.py``'s pseudo-English JSON lines, split into 8 files), same tokenizer,
same 2 worker processes, end-of-document token appended, for each tokenizer:

* ``ours --workers 2`` and ``ours --executor ray`` (a local Ray started and stopped by the run):
  ``statefulset preprocess`` as a fresh process; outputs checked byte for byte between the two.
* ``datatrove``: ``MegatronDocumentTokenizer`` under ``LocalPipelineExecutor(tasks=8, workers=2)``
  in its own venv (``--datatrove-python``; ``benchmarks/anchor_datatrove_tokenize.py``). It writes
  one unmerged bin/idx per task. datatrove takes only a Hugging Face tokenizer, so its ``bytes`` row
  uses a byte-level BPE with no merges (one token per UTF-8 byte, the same token count).
* ``preprocess_data.py``: the recreation of Megatron-LM's loop in ``bench_preprocess.py``
  (``multiprocessing.Pool(2).imap`` over the single corpus file, megatron-core's builder).

Every row is a whole child process timed from start to exit (imports, Ray's start-up, the merge:
what a user waits for). Then how ``--executor ray`` scales with the number of tasks, one worker vs
two (per-core rate), the memory of a task, the cost of a task and the rate of the final merge, the
figures the 100-node estimate uses.

Every section runs its variants in ``--rounds`` (>= 3) alternating rounds (A B C A B C ...: a change
of load falls on all alike) and keeps the median and spread of each figure and of each per-round
ratio (``provenance.summary``, ``provenance.ratio``); each section is stamped as it finishes. Tables:
``preprocess_ray_tables.py``.

    python benchmarks/bench_preprocess_ray.py [--docs 100000] [--datatrove-python PY]
    python benchmarks/bench_preprocess_ray.py --quick   # smoke run: 2,000 documents, one round
    python benchmarks/bench_preprocess_ray.py --sections bpe --datatrove-python PY --out bench_preprocess_ray_bpe.json

Like with like: only the ``bpe`` rows give both tools the same ``tokenizer.json`` (``--sections bpe``,
the comparison that counts, with CPU seconds and ours with the piece cache off once). The ``bytes``
rows do not (ours is ``str.encode`` plus one numpy call, datatrove a full ``tokenizers`` pipeline
with an empty merge list), so a ratio to datatrove counts toward a target only from ``bpe``.
A file holds one run (``--sections`` writes only the sections it ran).
"""

from __future__ import annotations

import argparse
import filecmp
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from jsonl_corpus import EOD_TOKEN, ensure_corpus, train_tokenizer  # noqa: E402
from preprocess_ray_tables import render  # noqa: E402
from process_cpu import proc_cpu  # noqa: E402
from provenance import MIN_RUNS, ratio, stamp, summary, write_results  # noqa: E402
from report_tables import load  # noqa: E402

EXTRA = ("ray", "tokenizers", "pyarrow", "datatrove")


def split(path: str, folder: str, parts: int) -> list[str]:
    with open(path, "rb") as f:
        lines = f.readlines()
    os.makedirs(folder, exist_ok=True)
    out = []
    for k in range(parts):
        name = os.path.join(folder, f"part-{k}.jsonl")
        with open(name, "wb") as f:
            f.writelines(lines[k::parts])
        out.append(name)
    return out


def byte_tokenizer(path: str) -> None:
    """A Hugging Face byte-level BPE without merges: every UTF-8 byte one token, plus the EOD token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOD_TOKEN])
    tokenizer.save(path)


CPU = {"seconds": 0.0}  # CPU seconds (user + system) of the last timed() command's processes


def session_cpu(sid: int, seen: dict[int, float]) -> None:
    """The CPU seconds so far of every live process of session ``sid`` into ``seen`` (pid -> seconds)."""
    seen.update(proc_cpu(3, sid))


def timed(command: list[str], env: dict | None = None) -> tuple[float, str]:
    """Wall seconds of a fresh process; in CPU["seconds"], the CPU of every process of its session (the
    command in a session of its own), sampled every 0.2 s: workers of a forkserver (datatrove's), which
    no parent waits for, included; the last < 0.2 s of each process is missed."""
    seen: dict[int, float] = {}
    began = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True, env=env, start_new_session=True)
        while child.poll() is None:
            session_cpu(child.pid, seen)
            if time.perf_counter() - began > 7200:
                child.kill()
                raise RuntimeError(f"{command[:4]}: still running after 7200 s, killed")
            time.sleep(0.2)
        seconds = time.perf_counter() - began
        session_cpu(child.pid, seen)  # what is left of it
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    CPU["seconds"] = sum(seen.values())
    if child.returncode:
        raise RuntimeError(f"{command[:4]} failed:\n{stderr[-3000:]}")
    return seconds, stdout


def ours(inputs: list[str], prefix: str, tokenizer: str, extra: list[str], env: dict | None = None) -> dict:
    env = {**(env or os.environ), "RAY_AUTH_MODE": "disabled"}
    seconds, out = timed(
        [sys.executable, "-m", "statefulset", "preprocess", "--input", *inputs, "--output-prefix", prefix,
         "--tokenizer", tokenizer, "--append-eod", "--quiet", *extra], env,
    )  # fmt: skip
    first = out.splitlines()[0]  # "N documents, T tokens in S s (...)"
    documents = int(first.split(" documents")[0].replace(",", ""))
    tokens = int(first.split(", ")[1].split(" tokens")[0].replace(",", ""))
    row = {"seconds": seconds, "documents": documents, "tokens": tokens, "cpu_seconds": CPU["seconds"]}
    for line in out.splitlines():  # "  largest task memory: 212 MiB (peak RSS of a Ray worker)"
        if "largest task memory:" in line:
            row["peak_task_mib"] = int(line.split(":")[1].split("MiB")[0].replace(",", ""))
    return row


def datatrove(python: str, folder: str, tokenizer: str, out: str) -> dict:
    script = os.path.join(HERE, "anchor_datatrove_tokenize.py")
    seconds, stdout = timed([python, script, folder, tokenizer, EOD_TOKEN, out, "8", "2"])
    return {**json.loads(stdout.strip().splitlines()[-1]), "seconds": seconds, "cpu_seconds": CPU["seconds"]}


def megatron_recreation(corpus: str, kind: str, tokenizer: str, prefix: str) -> dict:
    call = f"b._run_anchor({kind!r}, {tokenizer!r}, 2, {corpus!r}, {prefix!r})"
    code = f"import json, sys; sys.path.insert(0, {HERE!r}); import bench_preprocess as b; print(json.dumps({call}))"
    seconds, stdout = timed([sys.executable, "-c", code])
    got = json.loads(stdout.strip().splitlines()[-1])
    return {"seconds": seconds, "documents": got["docs"], "tokens": got["tokens"], "cpu_seconds": CPU["seconds"]}


def same(a: str, b: str) -> bool:
    return all(filecmp.cmp(a + e, b + e, shallow=False) for e in (".bin", ".idx"))


Run = Callable[[str], dict]  # a variant: given its round's output folder, one fresh process's row


def alternating(variants: dict[str, Run], rounds: int, folder: str, tag: str,
                check: Callable[[str], None] | None = None) -> dict[str, list[dict]]:  # fmt: skip
    """Each variant once a round, in turn (A B C A B C ...), so a change of the machine's load falls on
    every variant alike. Round k writes under ``folder/<tag>-k``; ``check`` looks at it, then it is removed
    (the bytes outputs are ~400 MB each)."""
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for k in range(rounds):
        where = os.path.join(folder, f"{tag}-{k}")
        os.makedirs(where)
        for name, run in variants.items():
            runs[name].append(run(where))
            print(tag, name, k, json.dumps(runs[name][-1]), flush=True)
        if check is not None:
            check(where)
        shutil.rmtree(where)
    return runs


def summed(got: list[dict]) -> dict:
    """Median and spread over the rounds of one variant's rows; every round must have made the same output."""
    docs, tokens = got[0]["documents"], got[0]["tokens"]
    if any((r["documents"], r["tokens"]) != (docs, tokens) for r in got):
        raise RuntimeError(f"rounds disagree on documents/tokens: {[(r['documents'], r['tokens']) for r in got]}")
    row = {"documents": docs, "tokens": tokens, "seconds": summary([r["seconds"] for r in got]),
           "docs_per_s": summary([docs / r["seconds"] for r in got]),
           "tokens_per_s": summary([tokens / r["seconds"] for r in got])}  # fmt: skip
    if all("cpu_seconds" in r for r in got):
        row["cpu_ms_per_doc"] = summary([1e3 * r["cpu_seconds"] / docs for r in got])
    if all("peak_task_mib" in r for r in got):
        row["peak_task_mib"] = summary([r["peak_task_mib"] for r in got])
    return row


def _ours_run(inputs: list[str], name: str, tokenizer: str, extra: list[str], env: dict | None = None) -> Run:
    return lambda where: ours(inputs, os.path.join(where, name), tokenizer, extra, env)


def tools(args: argparse.Namespace, corpus: str, inputs: list[str], name: str, toks: tuple[str, str]) -> dict:
    """The compare section's variants for one tokenizer: ours twice, datatrove and the recreation."""
    ours_tok, hf_tok = toks
    runs = {"ours_workers_2": _ours_run(inputs, f"{name}-w2", ours_tok, ["--workers", "2"]),
            "ours_ray": _ours_run(inputs, f"{name}-ray", ours_tok, ["--executor", "ray"])}  # fmt: skip
    if args.datatrove_python and not args.only_ours:
        in_folder = os.path.join(os.path.dirname(inputs[0]))
        runs["datatrove"] = lambda where: datatrove(args.datatrove_python, in_folder, hf_tok,
                                                    os.path.join(where, f"{name}-dt"))  # fmt: skip
    if not args.only_ours:
        kind = "bytes" if name == "bytes" else "hf"
        runs["preprocess_data_py"] = lambda where: megatron_recreation(corpus, kind, hf_tok,
                                                                       os.path.join(where, f"{name}-meg"))  # fmt: skip
    return runs


def compare(args: argparse.Namespace, corpus: str, inputs: list[str], tokenizers: dict, folder: str) -> dict:
    """Every tool and tokenizer once a round, in turn; ratios to ``--workers 2`` and of Ray to each, per round."""
    names = args.tokenizers.split(",")
    per_tok = {name: tools(args, corpus, inputs, name, tokenizers[name]) for name in names}
    variants = {f"{name}:{tool}": run for name, runs in per_tok.items() for tool, run in runs.items()}
    identical: dict[str, list[bool]] = {name: [] for name in names}

    def check(where: str) -> None:
        for name in names:
            w2, ray = (os.path.join(where, f"{name}-{t}_text_document") for t in ("w2", "ray"))
            identical[name].append(same(w2, ray))

    got = alternating(variants, args.rounds, folder, "compare", check)
    section: dict = {"rounds": args.rounds}
    for name, runs in per_tok.items():
        row: dict = {tool: summed(got[f"{name}:{tool}"]) for tool in runs}
        for tool, r in row.items():
            if tool != "ours_workers_2":
                r["over_workers_2"] = ratio(r["docs_per_s"], row["ours_workers_2"]["docs_per_s"])
            if tool != "ours_ray":
                r["ray_over_this"] = ratio(row["ours_ray"]["docs_per_s"], r["docs_per_s"])
        section[name] = {**row, "identical": all(identical[name]), "identical_rounds": identical[name]}
    return section


def like_for_like(args: argparse.Namespace, inputs: list[str], bpe: str, folder: str) -> dict:
    """The BPE comparison that counts, one ``tokenizer.json`` on both sides: ours ``--workers 2`` (piece
    cache on), datatrove and, unless ``--no-ray``, ours ``--executor ray``, alternating for ``--rounds``
    rounds; ours with every text through tokenizers' pipeline (STATEFULSET_PIECE_CACHE=0) once, for the
    byte-for-byte check and as the rate before the piece cache."""
    if not args.datatrove_python:
        raise SystemExit("--sections bpe needs --datatrove-python (datatrove in its own venv)")
    pipeline = ours(inputs, os.path.join(folder, "l-pipe"), bpe, ["--workers", "2"],
                    {**os.environ, "STATEFULSET_PIECE_CACHE": "0"})  # fmt: skip
    pipe_prefix = os.path.join(folder, "l-pipe_text_document")
    in_folder = os.path.dirname(inputs[0])
    variants = {
        "ours_workers_2": _ours_run(inputs, "l-w2", bpe, ["--workers", "2"]),
        "datatrove": lambda where: datatrove(args.datatrove_python, in_folder, bpe, os.path.join(where, "l-dt")),
    }
    if not args.no_ray:
        variants["ours_ray"] = _ours_run(inputs, "l-ray", bpe, ["--executor", "ray"])
    checks: dict[str, list[bool]] = {"identical_to_pipeline": [], "identical_to_ray": []}

    def check(where: str) -> None:
        w2 = os.path.join(where, "l-w2_text_document")
        checks["identical_to_pipeline"].append(same(w2, pipe_prefix))
        if not args.no_ray:
            checks["identical_to_ray"].append(same(w2, os.path.join(where, "l-ray_text_document")))

    runs = alternating(variants, args.rounds, folder, "bpe", check)
    row: dict = {"rounds": args.rounds, **{k: all(v) for k, v in checks.items() if v}}
    for name, got in [*runs.items(), ("ours_pipeline_workers_2", [pipeline])]:
        row[name] = summed(got)
    for name in runs:
        if name != "datatrove":
            row[f"{name}_over_datatrove"] = ratio(row[name]["docs_per_s"], row["datatrove"]["docs_per_s"])
    row["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    versions = "from importlib.metadata import version as v; print(v('datatrove'), v('tokenizers'))"
    got = subprocess.run([args.datatrove_python, "-c", versions], capture_output=True, text=True, timeout=120)
    row["datatrove_venv"] = dict(zip(("datatrove", "tokenizers"), got.stdout.split(), strict=False))
    return row


def scaling(args: argparse.Namespace, inputs: list[str], bpe: str, corpus_bytes: int, folder: str) -> dict:
    """BPE: one core (Rust threads off), two worker processes, and Ray with 2..32 tasks of equal size,
    alternating; each row's ratio to ``--workers 2`` per round."""
    one_core = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    variants = {"one_core": _ours_run(inputs, "s-w1", bpe, ["--workers", "1"], one_core),
                "workers_2": _ours_run(inputs, "s-w2", bpe, ["--workers", "2"])}  # fmt: skip
    for count in [int(c) for c in args.task_counts.split(",") if c]:
        task_bytes = str(-(-corpus_bytes // count))
        variants[f"ray_{count}_tasks"] = _ours_run(inputs, f"s-{count}", bpe, ["--executor", "ray", "--task-bytes",
                                                                               task_bytes])  # fmt: skip
    runs = alternating(variants, args.rounds, folder, "scaling")
    rows: dict = {"rounds": args.rounds, **{name: summed(got) for name, got in runs.items()}}
    for name in variants:
        if name != "workers_2":
            rows[name]["over_workers_2"] = ratio(rows[name]["docs_per_s"], rows["workers_2"]["docs_per_s"])
    return rows


def memory_rows(args: argparse.Namespace, corpus: str, folder: str) -> dict:
    """Peak memory of the Ray workers, bytes tokenizer, one task: a tiny file, the corpus plain and gzipped
    (one unit, so one task streams all of it), alternating. It should not follow the input's size."""
    tiny = os.path.join(folder, "tiny.jsonl")
    with open(corpus, "rb") as f, open(tiny, "wb") as out:
        out.writelines(line for _, line in zip(range(100), f, strict=False))
    packed = os.path.join(folder, "corpus.jsonl.gz")
    with open(corpus, "rb") as f, gzip.open(packed, "wb", compresslevel=1) as out:
        shutil.copyfileobj(f, out)
    paths = {"tiny": tiny, "plain": corpus, "gzip": packed}
    one_task = ["--executor", "ray", "--task-bytes", str(64 << 30)]
    variants = {name: _ours_run([path], f"mem-{name}", "bytes", one_task) for name, path in paths.items()}
    runs = alternating(variants, args.rounds, folder, "memory")
    rows = {name: {**summed(runs[name]), "input_bytes": os.path.getsize(paths[name])} for name in paths}
    return {"rounds": args.rounds, **rows}


def task_overhead(args: argparse.Namespace, inputs: list[str], folder: str) -> dict:
    """Ray's cost per task: the bytes job in tasks of 1 MB and of 100 KB, alternating; the per-round
    difference of seconds over the difference of task counts."""
    from statefulset.tools.part_tasks import plan

    sizes = {"few": 1_000_000, "many": 100_000}
    counts = {name: len(plan(inputs, ("text",), size)) for name, size in sizes.items()}
    variants = {name: _ours_run(inputs, f"t-{name}", "bytes", ["--executor", "ray", "--task-bytes", str(size)])
                for name, size in sizes.items()}  # fmt: skip
    runs = alternating(variants, args.rounds, folder, "tasks")
    extra = [1e3 * (m["seconds"] - f["seconds"]) / (counts["many"] - counts["few"])
             for f, m in zip(runs["few"], runs["many"], strict=True)]  # fmt: skip
    rows = {name: {**summed(runs[name]), "task_bytes": sizes[name], "tasks": counts[name]} for name in sizes}
    return {"rounds": args.rounds, **rows, "ms_per_extra_task": summary(extra)}


def merge_rate(args: argparse.Namespace, inputs: list[str], folder: str) -> dict:
    """The final merge alone, ``--rounds`` times: the bytes output copied through ``merge_datasets`` (page
    cache warm)."""
    from statefulset.shards.merge import merge_datasets

    prefix = os.path.join(folder, "merge-in")
    ours(inputs, prefix, "bytes", ["--workers", "2"])
    prefix += "_text_document"
    size = os.path.getsize(prefix + ".bin") + os.path.getsize(prefix + ".idx")
    seconds = []
    for _ in range(args.rounds):
        target = os.path.join(folder, "merged_text_document")
        began = time.perf_counter()
        merge_datasets([prefix], target)
        seconds.append(time.perf_counter() - began)
        for ext in (".bin", ".idx"):
            os.remove(target + ext)
    return {"rounds": args.rounds, "bytes": size, "seconds": summary(seconds),
            "gb_per_s": summary([size / s / 1e9 for s in seconds])}  # fmt: skip


def sections(args: argparse.Namespace, corpus: str, folder: str) -> dict:
    """Run the sections of ``--sections`` in order, each stamped as it finishes, with its wall seconds."""
    corpus_bytes = os.path.getsize(corpus)
    bpe_path = os.path.join(folder, "bpe.json")
    tokenizers = {"bytes": ("bytes", os.path.join(folder, "bytes.json")), "bpe": (bpe_path, bpe_path)}
    train_tokenizer(corpus, bpe_path)
    byte_tokenizer(tokenizers["bytes"][1])
    inputs = split(corpus, os.path.join(folder, "in"), 8)
    for path in [*inputs, corpus]:  # warm the page cache
        with open(path, "rb") as f:
            f.read()
    makers = {
        "compare": ("rows", lambda: compare(args, corpus, inputs, tokenizers, folder)),
        "bpe": ("bpe", lambda: like_for_like(args, inputs, bpe_path, folder)),
        "scaling": ("scaling_bpe", lambda: scaling(args, inputs, bpe_path, corpus_bytes, folder)),
        "memory": ("memory", lambda: memory_rows(args, corpus, folder)),
        "tasks": ("tasks", lambda: task_overhead(args, inputs, folder)),
        "merge": ("merge", lambda: merge_rate(args, inputs, folder)),
    }
    results: dict = {}
    for name in args.sections.split(","):
        key, make = makers[name]
        began = time.perf_counter()
        section = make()
        results[key] = stamp({**section, "wall_seconds": round(time.perf_counter() - began, 1)}, EXTRA)
        print(name, json.dumps(results[key]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--datatrove-python", default=os.environ.get("DATATROVE_PYTHON", ""))
    parser.add_argument("--tokenizers", default="bytes,bpe")
    parser.add_argument("--sections", default="compare,scaling,memory,tasks,merge", help="also: bpe")
    parser.add_argument("--task-counts", default="2,8,32", help="Ray tasks for the scaling rows (BPE)")
    parser.add_argument("--only-ours", action="store_true", help="compare: ours --workers 2 and Ray only")
    parser.add_argument("--rounds", type=int, default=MIN_RUNS, help="alternating rounds of every section")
    parser.add_argument("--no-ray", action="store_true", help="bpe: leave out ours --executor ray")
    parser.add_argument("--out", default="bench_preprocess_ray.json", help="file name under benchmarks/results")
    parser.add_argument("--render", action="store_true", help="print the markdown tables of the saved figures")
    parser.add_argument("--quick", action="store_true", help="2,000 documents, one round (a smoke run, no figure)")
    args = parser.parse_args()
    if args.render:
        large = load("bench_preprocess_ray_400k")
        print(render(load("bench_preprocess_ray"), large))
        return
    if args.quick:
        args.docs, args.task_counts, args.rounds = 2_000, "2", 1
    elif args.rounds < MIN_RUNS:
        raise SystemExit(f"--rounds {args.rounds}: a figure needs at least {MIN_RUNS} alternating rounds")
    corpus = ensure_corpus(args.docs)["path"]
    # A file holds one run: sections not run now are absent, never carried over from an older run.
    results: dict = {"docs": args.docs, "corpus_bytes": os.path.getsize(corpus), "cpus": os.cpu_count(),
                     "sections": args.sections.split(","), "command": " ".join(sys.argv[1:])}  # fmt: skip
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        results.update(sections(args, corpus, folder))
    results["wall_seconds"] = round(time.perf_counter() - began, 1)
    print("wrote", write_results(args.out, results, EXTRA, quick=args.quick))


if __name__ == "__main__":
    main()
