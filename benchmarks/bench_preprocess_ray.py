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
two (per-core rate), and the rate of the final merge, the figures the 100-node estimate uses.

    python benchmarks/bench_preprocess_ray.py [--docs 100000] [--datatrove-python PY]
    python benchmarks/bench_preprocess_ray.py --quick   # smoke run
    python benchmarks/bench_preprocess_ray.py --sections bpe --datatrove-python PY --out bench_preprocess_ray_bpe.json

``--sections bpe`` is the comparison that counts (BPE_COMMAND; ``render_bpe``): one ``tokenizer.json``
for ours and datatrove, alternating rounds, wall seconds and CPU seconds of each command's processes,
and ours with the piece cache off once, compared byte for byte.

Like with like: only the ``bpe`` rows give both tools the same ``tokenizer.json``. The ``bytes``
rows do not (ours is ``str.encode`` plus one numpy call, datatrove a full ``tokenizers`` pipeline
with an empty merge list), so a ratio to datatrove counts toward a target only from ``bpe``.
Each section carries its own provenance stamp; a file holds one run (``--sections`` writes only
the sections it ran).
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

from jsonl_corpus import EOD_TOKEN, ensure_corpus, train_tokenizer  # noqa: E402
from process_cpu import proc_cpu  # noqa: E402
from provenance import ratio, stamp, summary, write_results  # noqa: E402

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


def memory_rows(corpus: str, folder: str) -> dict:
    """Peak memory of the Ray workers, bytes tokenizer: a tiny file, the corpus plain (ranges of about
    1/16 of it per task) and gzipped (one unit, so one task streams all of it). It should not follow the
    input's size."""
    import gzip
    import shutil

    tiny = os.path.join(folder, "tiny.jsonl")
    with open(corpus, "rb") as f, open(tiny, "wb") as out:
        out.writelines(line for _, line in zip(range(100), f, strict=False))
    packed = os.path.join(folder, "corpus.jsonl.gz")
    with open(corpus, "rb") as f, gzip.open(packed, "wb", compresslevel=1) as out:
        shutil.copyfileobj(f, out)
    rows = {}
    for name, path in (("tiny", tiny), ("plain", corpus), ("gzip", packed)):
        one_task = ["--executor", "ray", "--task-bytes", str(64 << 30)]
        row = ours([path], os.path.join(folder, f"mem-{name}"), "bytes", one_task)
        rows[name] = {**row, "input_bytes": os.path.getsize(path)}
    return rows


def datatrove(python: str, folder: str, tokenizer: str, out: str) -> dict:
    script = os.path.join(HERE, "anchor_datatrove_tokenize.py")
    seconds, stdout = timed([python, script, folder, tokenizer, EOD_TOKEN, out, "8", "2"])
    return {**json.loads(stdout.strip().splitlines()[-1]), "seconds": seconds, "cpu_seconds": CPU["seconds"]}


def megatron_recreation(corpus: str, kind: str, tokenizer: str, prefix: str) -> dict:
    call = f"b._run_anchor({kind!r}, {tokenizer!r}, 2, {corpus!r}, {prefix!r})"
    code = f"import json, sys; sys.path.insert(0, {HERE!r}); import bench_preprocess as b; print(json.dumps({call}))"
    seconds, stdout = timed([sys.executable, "-c", code])
    got = json.loads(stdout.strip().splitlines()[-1])
    return {"seconds": seconds, "documents": got["docs"], "tokens": got["tokens"]}


def same(a: str, b: str) -> bool:
    return all(filecmp.cmp(a + e, b + e, shallow=False) for e in (".bin", ".idx"))


def merge_rate(prefix: str, folder: str) -> dict:
    """The final merge alone: the largest output copied through ``merge_datasets`` (page cache warm)."""
    from statefulset.shards.merge import merge_datasets

    size = os.path.getsize(prefix + ".bin") + os.path.getsize(prefix + ".idx")
    began = time.perf_counter()
    merge_datasets([prefix], os.path.join(folder, "merged_text_document"))
    seconds = time.perf_counter() - began
    return {"bytes": size, "seconds": seconds, "gb_per_s": size / seconds / 1e9}


def compare(args: argparse.Namespace, corpus: str, inputs: list[str], tokenizers: dict, folder: str) -> dict:
    rows = {}
    for name in args.tokenizers.split(","):
        ours_tok, hf_tok = tokenizers[name]
        row: dict = {}
        row["ours_workers_2"] = ours(inputs, os.path.join(folder, f"{name}-w2"), ours_tok, ["--workers", "2"])
        row["ours_ray"] = ours(inputs, os.path.join(folder, f"{name}-ray"), ours_tok, ["--executor", "ray"])
        row["identical"] = same(os.path.join(folder, f"{name}-w2_text_document"),
                                os.path.join(folder, f"{name}-ray_text_document"))  # fmt: skip
        if args.datatrove_python and not args.only_ours:
            row["datatrove"] = datatrove(args.datatrove_python, os.path.join(folder, "in"), hf_tok,
                                         os.path.join(folder, f"{name}-dt"))  # fmt: skip
        if not args.only_ours:
            kind = "bytes" if name == "bytes" else "hf"
            row["preprocess_data_py"] = megatron_recreation(corpus, kind, hf_tok, os.path.join(folder, f"{name}-meg"))
        for value in row.values():
            if isinstance(value, dict):
                value["docs_per_s"] = value["documents"] / value["seconds"]
                value["tokens_per_s"] = value["tokens"] / value["seconds"]
        row["ray_over_workers_2"] = row["ours_ray"]["docs_per_s"] / row["ours_workers_2"]["docs_per_s"]
        if "datatrove" in row:
            row["ray_over_datatrove"] = row["ours_ray"]["docs_per_s"] / row["datatrove"]["docs_per_s"]
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    return rows


def like_for_like(args: argparse.Namespace, inputs: list[str], bpe: str, folder: str) -> dict:
    """The BPE comparison that counts, one ``tokenizer.json`` on both sides: ours ``--workers 2`` (piece
    cache on), datatrove and, unless ``--no-ray``, ours ``--executor ray``, alternating for ``--rounds``
    rounds; ours with every text through tokenizers' pipeline (STATEFULSET_PIECE_CACHE=0) once, for the
    byte-for-byte check and as the rate before the piece cache."""
    if not args.datatrove_python:
        raise SystemExit("--sections bpe needs --datatrove-python (datatrove in its own venv)")
    pipeline_env = {**os.environ, "STATEFULSET_PIECE_CACHE": "0"}
    variants = {
        "ours_workers_2": lambda k: ours(inputs, os.path.join(folder, f"l-w2-{k}"), bpe, ["--workers", "2"]),
        "datatrove": lambda k: datatrove(
            args.datatrove_python, os.path.join(folder, "in"), bpe, os.path.join(folder, f"l-dt-{k}")
        ),
    }
    if not args.no_ray:
        variants["ours_ray"] = lambda k: ours(inputs, os.path.join(folder, f"l-ray-{k}"), bpe, ["--executor", "ray"])
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for k in range(args.rounds):
        for name, run in variants.items():
            runs[name].append(run(k))
            print(name, k, json.dumps(runs[name][-1]), flush=True)
    pipeline = ours(inputs, os.path.join(folder, "l-pipe"), bpe, ["--workers", "2"], pipeline_env)
    first = os.path.join(folder, "l-w2-0_text_document")
    row: dict = {"rounds": args.rounds}
    row["identical_to_pipeline"] = same(first, os.path.join(folder, "l-pipe_text_document"))
    if not args.no_ray:
        row["identical_to_ray"] = same(first, os.path.join(folder, "l-ray-0_text_document"))
    for name, got in [*runs.items(), ("ours_pipeline_workers_2", [pipeline])]:
        docs = got[0]["documents"]
        row[name] = {"documents": docs, "tokens": got[0]["tokens"], "seconds": summary([r["seconds"] for r in got]),
                     "docs_per_s": summary([docs / r["seconds"] for r in got]),
                     "cpu_ms_per_doc": summary([1e3 * r["cpu_seconds"] / docs for r in got])}  # fmt: skip
    for name in runs:
        if name != "datatrove":
            row[f"{name}_over_datatrove"] = ratio(row[name]["docs_per_s"], row["datatrove"]["docs_per_s"])
    row["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    versions = "from importlib.metadata import version as v; print(v('datatrove'), v('tokenizers'))"
    got = subprocess.run([args.datatrove_python, "-c", versions], capture_output=True, text=True, timeout=120)
    row["datatrove_venv"] = dict(zip(("datatrove", "tokenizers"), got.stdout.split(), strict=False))
    print("bpe", json.dumps(row), flush=True)
    return row


def scaling(args: argparse.Namespace, inputs: list[str], bpe: str, corpus_bytes: int, folder: str) -> dict:
    """BPE: one core (Rust threads off), two worker processes, and Ray with 2..32 tasks of equal size."""
    one_core = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    rows = {
        "one_core": ours(inputs, os.path.join(folder, "s-w1"), bpe, ["--workers", "1"], one_core),
        "workers_2": ours(inputs, os.path.join(folder, "s-w2"), bpe, ["--workers", "2"]),
    }
    for count in [int(c) for c in args.task_counts.split(",") if c]:
        task_bytes = -(-corpus_bytes // count)
        rows[f"ray_{count}_tasks"] = ours(inputs, os.path.join(folder, f"s-{count}"), bpe,
                                          ["--executor", "ray", "--task-bytes", str(task_bytes)])  # fmt: skip
    for value in rows.values():
        value["docs_per_s"] = value["documents"] / value["seconds"]
        value["tokens_per_s"] = value["tokens"] / value["seconds"]
    print("scaling", json.dumps(rows), flush=True)
    return rows


def render(results: dict, large: dict | None) -> str:
    """The markdown tables of docs/benchmarks.md from the saved figures."""
    names = {"ours_workers_2": "statefulset `--workers 2`", "ours_ray": "statefulset `--executor ray` (local Ray)",
             "datatrove": "datatrove `MegatronDocumentTokenizer`, 8 tasks, 2 workers",
             "preprocess_data_py": "`preprocess_data.py` loop, 2 workers"}  # fmt: skip
    out = [
        "| tokenizer | tool | s | docs/s | tokens/s | vs `--workers 2` | Ray vs this |",
        "|---|---|---|---|---|---|---|",
    ]
    for tok, row in results["rows"].items():
        if tok == "provenance":
            continue
        base = row["ours_workers_2"]["docs_per_s"]
        for key, label in names.items():
            if key in row:
                r = row[key]
                ray = row["ours_ray"]["docs_per_s"] / r["docs_per_s"]
                rate = f"{r['tokens_per_s'] / 1e6:.2f}M"
                ratio = f"{ray:.2f}x"
                if key == "datatrove" and tok == "bytes":  # its byte-level BPE pipeline against our str.encode
                    label += " (a `tokenizers` pipeline: not the same tokenizer as ours)"
                    ratio = f"{ray:.2f}x, not like for like"
                out.append(f"| {tok} | {label} | {r['seconds']:.1f} | {r['docs_per_s']:,.0f} | {rate} | "
                           f"{r['docs_per_s'] / base:.2f}x | {ratio} |")  # fmt: skip
    if large:
        row = large["rows"]["bpe"]
        w2, ray = row["ours_workers_2"], row["ours_ray"]
        out += ["", f"{large['docs']:,} documents ({large['corpus_bytes'] / 1e6:,.0f} MB), BPE: `--workers 2` "
                f"{w2['seconds']:.1f} s, `--executor ray` {ray['seconds']:.1f} s: Ray at "
                f"{row['ray_over_workers_2']:.2f}x; outputs identical: {row['identical']}."]  # fmt: skip
    scale = results.get("scaling_bpe", {})
    if scale:
        out += ["", f"| BPE, {results['docs']:,} documents | s | docs/s | tokens/s | peak task memory |",
                "|---|---|---|---|---|"]  # fmt: skip
    for key, r in scale.items():
        if key == "provenance":
            continue
        mem = f"{r['peak_task_mib']} MiB" if "peak_task_mib" in r else "-"
        out.append(f"| {key.replace('_', ' ')} | {r['seconds']:.1f} | {r['docs_per_s']:,.0f} | "
                   f"{r['tokens_per_s'] / 1e6:.2f}M | {mem} |")  # fmt: skip
    if results.get("memory"):
        out += ["", "| memory: input (bytes tokenizer, Ray) | input bytes | peak task memory |", "|---|---|---|"]
    for key, r in results.get("memory", {}).items():
        if key == "provenance":
            continue
        out.append(f"| {key} | {r['input_bytes']:,} | {r['peak_task_mib']} MiB |")
    m = results.get("merge")
    if m:
        out += ["", f"Merge alone: {m['bytes']:,} bytes in {m['seconds']:.2f} s ({m['gb_per_s']:.2f} GB/s)."]
    return "\n".join(out)


BPE_COMMAND = (
    "python benchmarks/bench_preprocess_ray.py --sections bpe --tokenizers bpe --rounds 3 "
    "--datatrove-python /path/to/datatrove-venv/bin/python --out bench_preprocess_ray_bpe.json"
)


def _mmm(stat: dict, form: str) -> str:
    if stat["min"] == stat["max"]:
        return format(stat["median"], form)
    return f"{format(stat['median'], form)} ({format(stat['min'], form)}–{format(stat['max'], form)})"


def render_bpe(record: dict) -> str:
    """The like-for-like table (``--sections bpe``): one ``tokenizer.json`` on both sides."""
    row = record["bpe"]
    names = {"ours_workers_2": "statefulset `--workers 2`", "ours_ray": "statefulset `--executor ray` (local Ray)",
             "datatrove": "datatrove `MegatronDocumentTokenizer`, 8 tasks, 2 workers",
             "ours_pipeline_workers_2": "statefulset `--workers 2`, every text through `tokenizers`' pipeline "
                                        "(`STATEFULSET_PIECE_CACHE=0`), one run"}  # fmt: skip
    venv = row.get("datatrove_venv", {})
    dt = f"datatrove {venv.get('datatrove', '?')} with tokenizers {venv.get('tokenizers', '?')} in its own venv"
    out = [f"{record['docs']:,} documents ({record['corpus_bytes'] / 1e6:,.0f} MB), BPE, median (min–max) of "
           f"{row['rounds']} alternating rounds, every row a fresh process; {dt}:", "",
           "| tool | s | docs/s | CPU ms per document | ÷ datatrove (docs/s, per round) |",
           "|---|---|---|---|---|"]  # fmt: skip
    base = row["datatrove"]["docs_per_s"]["median"]
    for key, label in names.items():
        if key not in row:
            continue
        r, q = row[key], row.get(f"{key}_over_datatrove")
        over = _mmm(q, ".2f") + "x" if q else f"{r['docs_per_s']['median'] / base:.2f}x"
        cpu = _mmm(r["cpu_ms_per_doc"], ".2f") + (" (Ray's own processes may be missed)" if key == "ours_ray" else "")
        out.append(f"| {label} | {_mmm(r['seconds'], '.1f')} | {_mmm(r['docs_per_s'], ',.0f')} | {cpu} | {over} |")
    best = row["ours_workers_2_over_datatrove"]["median"]
    same = [f"with the pipeline: {row['identical_to_pipeline']}"]
    same += [f"with `--executor ray`: {row['identical_to_ray']}"] if "identical_to_ray" in row else []
    out += ["", f"Target ≥ 1.5× datatrove's documents/s with the same `tokenizer.json`: "
            f"**{'met' if best >= 1.5 else 'missed'}** ({best:.2f}× with `--workers 2`). "
            f"Outputs byte for byte identical {', '.join(same)}."]  # fmt: skip
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--datatrove-python", default=os.environ.get("DATATROVE_PYTHON", ""))
    parser.add_argument("--tokenizers", default="bytes,bpe")
    parser.add_argument("--sections", default="compare,scaling,memory,merge")
    parser.add_argument("--task-counts", default="2,4,8,16,32", help="Ray tasks for the scaling rows (BPE)")
    parser.add_argument("--only-ours", action="store_true", help="compare: ours --workers 2 and Ray only")
    parser.add_argument("--rounds", type=int, default=3, help="bpe: alternating rounds (median and spread)")
    parser.add_argument("--no-ray", action="store_true", help="bpe: leave out ours --executor ray")
    parser.add_argument("--out", default="bench_preprocess_ray.json", help="file name under benchmarks/results")
    parser.add_argument("--render", action="store_true", help="print the markdown tables of the saved figures")
    parser.add_argument("--quick", action="store_true", help="2,000 documents, compare and merge only")
    args = parser.parse_args()
    if args.render:
        with open(os.path.join(HERE, "results", "bench_preprocess_ray.json")) as f:
            results = json.load(f)
        large_path = os.path.join(HERE, "results", "bench_preprocess_ray_400k.json")
        large = json.load(open(large_path)) if os.path.exists(large_path) else None  # noqa: SIM115
        print(render(results, large))
        return
    if args.quick:
        args.docs, args.tokenizers, args.task_counts = 2_000, "bytes,bpe", "2"
        args.sections = "compare,merge"
    sections = args.sections.split(",")
    corpus = ensure_corpus(args.docs)["path"]
    corpus_bytes = os.path.getsize(corpus)
    # A file holds one run: sections not run now are absent, never carried over from an older run.
    results: dict = {"docs": args.docs, "corpus_bytes": corpus_bytes, "cpus": os.cpu_count(), "sections": sections}
    with tempfile.TemporaryDirectory() as folder:
        bpe_path = os.path.join(folder, "bpe.json")
        tokenizers = {"bytes": ("bytes", os.path.join(folder, "bytes.json")), "bpe": (bpe_path, bpe_path)}
        train_tokenizer(corpus, bpe_path)
        byte_tokenizer(tokenizers["bytes"][1])
        inputs = split(corpus, os.path.join(folder, "in"), 8)
        for path in [*inputs, corpus]:  # warm the page cache
            with open(path, "rb") as f:
                f.read()
        if "compare" in sections:
            results["rows"] = stamp(compare(args, corpus, inputs, tokenizers, folder), EXTRA)
        if "bpe" in sections:
            results["bpe"] = stamp(like_for_like(args, inputs, bpe_path, folder), EXTRA)
        if "scaling" in sections:
            results["scaling_bpe"] = stamp(scaling(args, inputs, bpe_path, corpus_bytes, folder), EXTRA)
        if "memory" in sections:
            results["memory"] = stamp(memory_rows(corpus, folder), EXTRA)
            print("memory", json.dumps(results["memory"]), flush=True)
        if "merge" in sections:
            prefix = os.path.join(folder, "bytes-w2")
            if not os.path.exists(prefix + "_text_document.bin"):
                ours(inputs, prefix, "bytes", ["--workers", "2"])
            results["merge"] = stamp(merge_rate(prefix + "_text_document", folder), EXTRA)
            print("merge", json.dumps(results["merge"]), flush=True)
    write_results(args.out, results, EXTRA, quick=args.quick)


if __name__ == "__main__":
    main()
