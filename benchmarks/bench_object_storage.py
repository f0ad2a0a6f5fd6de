"""Object storage, like with like: statefulset against megatron-core's S3 reader and the store itself, one run.

A uint16 shard (``benchmarks/corpus.py``; 300,000 documents, 150M tokens at full size) on a
loopback S3 server (npm ``s3rver``) behind ``tests/s3_proxy.py``, which adds 10 ms to every
request (a same-region object store's first-byte latency). Micro-batches of B=8 samples of
S=2048 tokens (+1). Both loaders read GPTDataset's samples 0..n in order (the same seed, split and
number of samples); the first batch of every row is hashed and the run checks the hashes are equal.

Rows, each round running all of them in turn (``--rounds``, at least 3: median and spread), each
row in a fresh process with a fresh node cache:

- ``ours``: ``get_savable_loader`` on ``s3://`` with ``packing: megatron`` (the same samples as
  megatron-core) and ``packing: native`` (its own samples: one window of the ``.bin`` each), 0, 2
  and 4 workers (``--ours-packing``, ``--ours-workers``);
- ``megatron-core``: ``GPTDataset`` with ``object_storage_cache_path`` (its S3 reader: the
  ``.idx`` cached locally, the ``.bin`` read in ``bin_chunk_nbytes`` chunks, one request at a time
  per process) in a ``torch.utils.data.DataLoader`` with 4, 8, 16 and 32 workers and 1 MiB and
  256 KiB chunks;
- ``store capacity``: no loader (``store_capacity.py``): the ranged GETs our loader asks for the
  same samples of each packing (each sample's pieces, merged per batch as our reader merges them),
  from 1, 2 and 4 processes (as many as our loader reads from: the main process at 0 workers, else
  one per worker), each keeping 32 in flight (our request limit per process).

Reported per row: tokens/s, requests per sample (the proxy's ranged GETs over the measured window,
which opens after a warm-up of ``--warmup`` seconds, against the documents a sample spans), the
client's CPU per request (the row's processes, workers included, over the window: a figure the
machine's load hardly changes), ours as a fraction of the
store's capacity at as many processes and the same packing's requests, and ours (``packing:
megatron`` only: the same samples) and megatron-core's rows against megatron-core's best row of the
same round. ``--out`` writes a run on a loaded machine elsewhere.

    S3RVER_BIN=/path/to/node_modules/.bin/s3rver python benchmarks/bench_object_storage.py   # full size
    python benchmarks/bench_object_storage.py --docs 60000 --samples 20000 --seconds 4 --megatron-workers 4 8 16
    python benchmarks/bench_object_storage.py --quick     # smoke size, results to benchmarks/out/quick/
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from corpus import OUT_DIR, make_corpus  # noqa: E402
from object_storage_table import markdown  # noqa: E402
from process_cpu import tree_cpu  # noqa: E402
from provenance import summary, write_results  # noqa: E402

B, S = 8, 2048
BUCKET = "bench"
LATENCY = 0.010
INFLIGHT = 32  # our loader's request limit per process (STATEFULSET_STORAGE_MAX_REQUESTS)
PIECE_SAMPLES = 8192  # samples whose requests the store-capacity loop cycles through
EXTRA = ("megatron-core", "s3fs", "obstore", "boto3")
KEYS = ("tokens_per_s", "requests_per_sample", "open_and_first_batch_s", "requests_per_s", "client_cpu_ms_per_request",
        "requests_per_built_sample")  # fmt: skip


def _shard(docs: int) -> str:
    prefix = os.path.join(OUT_DIR, "s3", f"c{docs}")
    if not os.path.exists(prefix + ".idx"):
        import numpy

        from statefulset import IndexedDatasetWriter

        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        tokens, lengths = make_corpus(docs)
        with IndexedDatasetWriter(prefix, dtype=numpy.uint16) as w:
            w.add_documents(tokens, lengths)
    return prefix


# -- one measurement, in a process of its own ---------------------------------------------------
def _proxy_stats() -> dict:
    with urllib.request.urlopen(os.environ["AWS_ENDPOINT_URL"] + "/__proxy__/stats", timeout=30) as answer:
        return json.loads(answer.read())


def _digest(tokens) -> str:
    import numpy

    return hashlib.sha256(numpy.ascontiguousarray(tokens.numpy().astype(numpy.int64)).tobytes()).hexdigest()[:16]


def _measure(batches, seconds: float, digest, counters=None, warmup: float = 0.0) -> dict:
    """tokens/s and ranged GETs per sample over a window that opens ``warmup`` seconds after the first
    batch (the loader's pipeline then full: workers started, read-ahead and prefetch in flight, so the
    requests of batches made ready before the window and of batches still in flight at its end
    balance); ``counters``: the loader's own (requests, batches built), counted over the same window."""
    first = digest(next(batches))
    first_at = time.perf_counter()
    while time.perf_counter() - first_at < warmup:
        next(batches)
    before, cpu, own = _proxy_stats(), tree_cpu(), counters() if counters else None
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        next(batches)
        count += 1
    elapsed, cpu = time.perf_counter() - start, tree_cpu() - cpu
    ranged = _proxy_stats()["ranged"] - before["ranged"]
    out = {"first_batch_at": first_at, "batches": count, "seconds": elapsed, "tokens_per_s": count * B * S / elapsed,
           "requests_per_sample": ranged / max(1, count * B), "digest": first,
           "client_cpu_ms_per_request": cpu * 1e3 / max(1, ranged)}  # fmt: skip
    if own is not None:  # the requests per sample the loader's processes sent for the samples they built
        requests, built = (b - a for a, b in zip(own, counters(), strict=True))
        out["requests_per_built_sample"] = requests / max(1, built * B)
    return out


def run_ours(job: dict) -> dict:
    from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

    spec = our_spec(job["prefix"], job["packing"], job["num_samples"])
    start = time.perf_counter()
    wc = WorkerConfig(rank=0, world_size=1, num_workers=job["workers"])
    loader = get_savable_loader(get_train_dataset(spec, batch_size=B, worker_config=wc), prefetch_factor=4)

    def counters() -> tuple[float, float]:
        found = loader.metrics()
        return found["storage/requests"], found["read_ahead/batches"]

    result = _measure(iter(loader), job["seconds"], lambda batch: _digest(batch["text"]), counters, job["warmup"])
    result["open_and_first_batch_s"] = result.pop("first_batch_at") - start
    return result


def our_spec(prefix: str, packing: str, num_samples: int) -> dict:
    """Our loader's spec: GPTDataset's samples with ``packing: megatron``, native's own without."""
    spec = {"data_path": prefix, "seq_length": S, "split": "100,0,0", "packing": packing, "seed": 3}
    if packing == "megatron":
        spec["num_samples"] = num_samples
    return spec


def megatron_dataset(prefix: str, num_samples: int, cache: str, idx_cache: str | None, chunk: int = 1 << 20):
    """megatron-core's GPTDataset over ``prefix`` (``idx_cache``: through its object-storage reader)."""
    from megatron.core.datasets import gpt_dataset
    from megatron.core.datasets.object_storage_utils import ObjectStorageConfig

    # GPTDataset builds its ObjectStorageConfig itself: the chunk size is its only knob.
    gpt_dataset.ObjectStorageConfig = functools.partial(ObjectStorageConfig, bin_chunk_nbytes=chunk)
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    config = gpt_dataset.GPTDatasetConfig(
        random_seed=3, sequence_length=S, blend=([prefix], None), split="100,0,0",
        tokenizer=NullTokenizer(50257), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, mmap_bin_files=False, path_to_cache=cache, object_storage_cache_path=idx_cache,
    )  # fmt: skip
    sizes = [num_samples, None, None]
    return BlendedMegatronDatasetBuilder(gpt_dataset.GPTDataset, sizes, lambda: True, config).build()[0]


def run_megatron(job: dict) -> dict:
    import torch

    start = time.perf_counter()
    dataset = megatron_dataset(job["prefix"], job["num_samples"], job["cache"], job["idx_cache"], job["chunk"])
    loader = torch.utils.data.DataLoader(dataset, batch_size=B, num_workers=job["workers"], prefetch_factor=4)

    def digest(batch) -> str:
        return _digest(torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1))

    result = _measure(iter(loader), job["seconds"], digest, warmup=job["warmup"])
    result["open_and_first_batch_s"] = result.pop("first_batch_at") - start
    return result


def run_pieces(job: dict) -> dict:
    """The requests of the store-capacity loop for one packing: megatron's from megatron-core's indices
    over the local shard, native's from our stream's own account of each sample (``explain``)."""
    from store_capacity import batch_requests, explained_pieces, sample_pieces

    count = min(PIECE_SAMPLES, job["num_samples"])
    if job["packing"] == "megatron":
        dataset = megatron_dataset(job["prefix"], job["num_samples"], job["cache"], None)
        pieces = sample_pieces(dataset, count)
    else:
        from statefulset import open_stream

        spec = {**our_spec(job["prefix"], job["packing"], job["num_samples"]), "path_to_cache": job["cache"] + "-ours"}
        pieces = explained_pieces(open_stream(spec), count)
    batches = batch_requests(pieces, B)
    with open(job["out"], "w") as f:
        json.dump(batches, f)
    return {"documents_per_sample": sum(map(len, pieces)) / len(pieces),
            "merged_requests_per_sample": sum(map(len, batches)) / (len(batches) * B)}  # fmt: skip


def _command(job: dict) -> list[str]:
    return [sys.executable, __file__, "--child", json.dumps(job)]


def _child(job: dict) -> dict:
    env = {**os.environ, **job.pop("env", {})}
    out = subprocess.run(_command(job), env=env, capture_output=True, text=True, timeout=job["seconds"] * 4 + 600)
    if out.returncode != 0:
        raise RuntimeError(f"{job['name']} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _capacity(job: dict, batches_file: str) -> dict:
    """``job['processes']`` loop processes started together; their answers summed."""
    with open(batches_file) as f:
        batches = json.load(f)
    env = {**os.environ, **job.pop("env", {})}
    start_at = time.time() + 8.0  # every process set up before the window opens (else its window is shorter)
    procs = []
    for index in range(job["processes"]):
        part = [b for i, b in enumerate(batches) if i % job["processes"] == index]
        path = f"{batches_file}.{index}"
        with open(path, "w") as f:
            json.dump(part, f)
        sub = {**job, "index": 0, "processes": 1, "batches_file": path, "start_at": start_at, "inflight": INFLIGHT}
        procs.append(
            subprocess.Popen(_command(sub), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    answers = []
    for proc in procs:
        out, err = proc.communicate(timeout=job["seconds"] + 300)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{job['name']}: process {len(answers)} exited {proc.returncode}:\n{err[-4000:]}{out[-500:]}"
            )
        answers.append(json.loads(out.strip().splitlines()[-1]))
    per_sample = sum(map(len, batches)) / (len(batches) * B)
    rate = sum(a["requests"] / a["seconds"] for a in answers if a["seconds"] > 0)
    cpu_ms = sum(a["cpu_s"] for a in answers) * 1e3 / max(1, sum(a["requests"] for a in answers))
    return {"requests_per_s": rate, "tokens_per_s": rate / per_sample * S, "requests_per_sample": per_sample,
            "shortest_window_s": min(a["seconds"] for a in answers), "client_cpu_ms_per_request": cpu_ms}  # fmt: skip


def plan(url: str, args: argparse.Namespace) -> list[dict]:
    """The rows of one round."""
    processes = sorted({max(1, w) for w in args.ours_workers})
    rows = []
    for packing in args.ours_packing:
        rows += [{"name": f"store capacity, {packing} ranges: {p} process{'es' if p > 1 else ''} x {INFLIGHT} GETs "
                  "in flight", "kind": "capacity", "packing": packing, "processes": p} for p in processes]  # fmt: skip
        rows += [{"name": f"ours, packing: {packing}, {w} workers", "kind": "ours", "packing": packing, "workers": w,
                  "processes": max(1, w)} for w in args.ours_workers]  # fmt: skip
    rows += [{"name": f"megatron-core, chunk {_size(c)}, {w} workers", "kind": "megatron", "packing": "megatron",
              "workers": w, "chunk": c} for c in args.chunks for w in args.megatron_workers]  # fmt: skip
    for row in rows:
        row.update(prefix=url, num_samples=args.samples, seconds=args.seconds, warmup=args.warmup)
    return rows


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _round(rows: list[dict], scratch: str, p, env: dict, batches_files: dict[str, str], r: int) -> dict[str, dict]:
    """Every row once, each in fresh processes with a fresh node cache."""
    measured = {}
    for i, row in enumerate(rows):
        node = os.path.join(scratch, f"r{r}-node{i}")
        job = {**row, "cache": os.path.join(scratch, "megatron-indices"), "idx_cache": os.path.join(node, "idx"),
               "env": {**env, "STATEFULSET_REMOTE_CACHE": os.path.join(node, "remote-idx"),
                       "XDG_CACHE_HOME": os.path.join(node, "xdg")}}  # fmt: skip
        p.reset()
        p.set(latency=LATENCY)
        try:
            result = _capacity(job, batches_files[row["packing"]]) if row["kind"] == "capacity" else _child(job)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            result = {"error": str(exc)[-2000:]}
        measured[row["name"]] = result
        shown = (
            f"{result['tokens_per_s'] / 1e3:9.1f}k tok/s {result['requests_per_sample']:6.2f} req/sample "
            f"{result.get('client_cpu_ms_per_request', 0):5.2f} CPU ms/req"
            if ("tokens_per_s" in result)
            else "FAILED " + result["error"][-300:]
        )
        print(f"round {r} {row['name']:55s} {shown}", flush=True)
    return measured


def _capacity_row(rows: list[dict], row: dict) -> str | None:
    """The store-capacity row that ``row`` is set against: the same packing's requests, as many processes."""
    return next((c["name"] for c in rows if c["kind"] == "capacity" and c["packing"] == row["packing"]
                 and c["processes"] == row.get("processes")), None)  # fmt: skip


def combine(rows: list[dict], rounds: list[dict[str, dict]]) -> dict:
    """Median and spread per row; per-round ratios to megatron-core's best (megatron's samples only) and
    to the store's capacity (same packing, same processes)."""
    out = {}
    megatron_rows = [r["name"] for r in rows if r["kind"] == "megatron"]
    for row in rows:
        runs = [rd[row["name"]] for rd in rounds]
        ok = [x for x in runs if "tokens_per_s" in x]
        entry = {k: row[k] for k in ("kind", "packing", "workers", "chunk", "processes") if k in row}
        entry["finished"] = f"{len(ok)}/{len(runs)}"
        entry["errors"] = [x["error"] for x in runs if "error" in x]
        for key in KEYS:
            if ok and key in ok[0]:
                entry[key] = summary([x[key] for x in ok])
        entry["digests"] = sorted({x["digest"] for x in ok if "digest" in x})
        to_best, of_capacity = [], []
        capacity = _capacity_row(rows, row) if row["kind"] == "ours" else None
        for rd in rounds:
            mine = rd[row["name"]].get("tokens_per_s")
            best = max((rd[k]["tokens_per_s"] for k in megatron_rows if "tokens_per_s" in rd[k]), default=None)
            if mine and best and row["kind"] != "capacity" and row["packing"] == "megatron":
                to_best.append(mine / best)
            cap = rd[capacity].get("tokens_per_s") if capacity else None
            if mine and cap:
                of_capacity.append(mine / cap)
        if to_best:
            entry["to_megatron_best"] = summary(to_best)
        if of_capacity:
            entry["of_store_capacity"] = summary(of_capacity)
        out[row["name"]] = entry
    return out


def main() -> None:
    from s3_servers import proxy, s3rver_server, upload

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=300_000, help="documents in the shard (300,000: 150M tokens)")
    parser.add_argument("--samples", type=int, default=200_000, help="GPTDataset's num_samples, both sides")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window of each row")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ours-workers", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument(
        "--ours-packing",
        nargs="+",
        choices=["megatron", "native"],
        default=["megatron", "native"],
        help="megatron: the same samples as megatron-core; native: its own, one window each",
    )
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds after the first batch before the window")
    parser.add_argument("--megatron-workers", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1 << 20, 256 << 10], help="megatron-core's bytes")
    parser.add_argument("--quick", action="store_true", help="smoke size: 20,000 documents, 3 s, fewer rows")
    parser.add_argument("--out", help="results file (default benchmarks/results/object_storage.json)")
    args = parser.parse_args()
    if args.quick:
        args.docs, args.samples, args.seconds, args.warmup = 20_000, 4_000, 3.0, 1.0
        args.ours_workers, args.megatron_workers, args.chunks = [0, 2], [4], [1 << 20]
    if args.rounds < 3:
        parser.error("--rounds: a figure needs at least 3")
    started = time.time()
    prefix = _shard(args.docs)
    name = os.path.basename(prefix)
    with tempfile.TemporaryDirectory() as scratch, s3rver_server(os.path.join(scratch, "s3")) as server:
        upload(server, BUCKET, {f"{name}.{e}": f"{prefix}.{e}" for e in ("bin", "idx")})
        batches_files = {packing: os.path.join(scratch, f"requests-{packing}.json") for packing in args.ours_packing}
        mix = {}
        for packing in args.ours_packing:
            job = {"name": f"pieces ({packing})", "kind": "pieces", "packing": packing, "prefix": prefix,
                   "num_samples": args.samples, "cache": os.path.join(scratch, "local-indices"),
                   "out": batches_files[packing], "seconds": 60}  # fmt: skip
            mix[packing] = _child(job)
        with proxy(server) as p:
            env = {**server.env(), "AWS_ENDPOINT_URL": p.endpoint}
            rows = plan(f"s3://{BUCKET}/{name}", args)
            rounds = []
            for r in range(args.rounds):  # the file is written after each round: a run cut short keeps its rounds
                rounds.append(_round(rows, scratch, p, env, batches_files, r))
                report = _report(args, prefix, mix, rows, rounds, started)
                write_results("object_storage", report, EXTRA, args.out, quick=args.quick)
    print(markdown(report))


def _report(args: argparse.Namespace, prefix: str, mix: dict, rows: list[dict], rounds: list[dict], started: float):
    results = combine(rows, rounds)
    same = {}  # per packing: one first batch on every loader row (megatron's: megatron-core's rows too)
    for packing in args.ours_packing:
        digests = {d for v in results.values() if v["kind"] != "capacity" and v["packing"] == packing
                   for d in v["digests"]}  # fmt: skip
        same[packing] = len(digests) == 1
    return {
        "latency_s": LATENCY, "seconds": args.seconds, "warmup_s": args.warmup, "rounds": args.rounds,
        "docs": args.docs, "tokens": int(os.path.getsize(prefix + ".bin") // 2), "num_samples": args.samples,
        "batch": B, "seq": S, "inflight_per_process": INFLIGHT, **mix.get("megatron", {}), "packings": mix,
        "same_first_batch": all(same.values()), "same_first_batch_by_packing": same,
        "rounds_done": len(rounds), "wall_s": round(time.time() - started, 1), "results": results,
        "command": "python benchmarks/bench_object_storage.py " + " ".join(sys.argv[1:]),
    }  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        job = json.loads(sys.argv[2])
        if job["kind"] == "capacity":
            from store_capacity import run_capacity

            with open(job["batches_file"]) as f:
                job["batches"] = json.load(f)
            print(json.dumps(run_capacity(job)), flush=True)
            os._exit(0)  # obstore's runtime can abort at interpreter exit (SIGABRT) after the loop is done
        else:
            run = {"megatron": run_megatron, "ours": run_ours, "pieces": run_pieces}[job["kind"]]
            print(json.dumps(run(job)))
    else:
        main()
