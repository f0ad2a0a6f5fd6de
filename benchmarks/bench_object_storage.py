"""Object storage, side by side: statefulset against megatron-core 0.16's S3 reader, one run.

A 150M-token uint16 shard (``benchmarks/corpus.py``, 300,000 documents) on a loopback S3 server
(npm ``s3rver``: objects are files, so a ranged GET costs the same anywhere in the object) behind
``tests/s3_proxy.py``, which adds 10 ms to every request (a same-region object store's first-byte
latency). Micro-batches of B=8 samples of S=2048 tokens (+1), random access.

Variants, each in a fresh process with a fresh node cache (so the first batch pays the ``.idx``
download):

- ``ours``: ``get_savable_loader`` on ``s3://`` over ``packing: megatron`` (GPTDataset's samples,
  sample for sample: the like-for-like rows against megatron-core) with 0, 2, 4 and 8 workers,
  over ``packing: native`` (one contiguous window per sample: a different workload, one ranged GET
  per sample) with 0, 1, 4 and 8 workers, and ``packing: native`` on the local files with 4
  workers (what the same loader does without a network);
- ``plain GET loop``: no loader, sample-sized ranged GETs at random offsets, one process issuing
  synchronous batches of 64 (obstore). It is a simple client loop, not a ceiling on what the
  store serves (our loader beats it);
- ``megatron``: megatron-core ``GPTDataset`` with ``object_storage_cache_path`` (its S3 reader:
  the ``.idx`` cached locally, the ``.bin`` read in ``bin_chunk_nbytes`` chunks through one boto3
  client per process) in a ``torch.utils.data.DataLoader``: 1 MiB chunks with 4, 8, 16 and 32
  workers (its reader waits on one request at a time per process, so more processes help), and
  its default 256 MiB chunk with 4 workers.

The ratio to quote is ours ``packing: megatron`` against megatron-core's best row: the same
samples on both sides. Rows with ``packing: native`` read other samples and are not a
comparison with megatron-core.

Reported: tokens/s over the measured window (after the first batch), requests per sample (the
proxy's count), the first-batch time of a cold node. Run::

    S3RVER_BIN=/path/to/node_modules/.bin/s3rver python benchmarks/bench_object_storage.py

``--seconds`` bounds each measurement (default 20), ``--quick`` runs a 5-second smoke version of
a few rows (results to ``benchmarks/out/quick/``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from corpus import OUT_DIR, make_corpus  # noqa: E402
from provenance import write_results  # noqa: E402

B, S = 8, 2048
DOCS = 300_000
BUCKET = "bench"
LATENCY = 0.010
MEGATRON_SAMPLES = 200_000
GET_LOOP = "plain GET loop: one process, synchronous batches of 64 ranged GETs (obstore; not a ceiling)"
EXTRA = ("megatron-core", "s3fs", "obstore", "boto3")


def _shard() -> str:
    prefix = os.path.join(OUT_DIR, "s3", "c150m")
    if not os.path.exists(prefix + ".idx"):
        import numpy

        from statefulset import IndexedDatasetWriter

        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        tokens, lengths = make_corpus(DOCS)
        with IndexedDatasetWriter(prefix, dtype=numpy.uint16) as w:
            w.add_documents(tokens, lengths)
    return prefix


# -- one measurement, in a process of its own ---------------------------------------------------
def _measure(batches, seconds: float) -> dict[str, float]:
    start = time.perf_counter()
    next(batches)
    first = time.perf_counter() - start
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        next(batches)
        count += 1
    elapsed = time.perf_counter() - start
    return {"first_batch_s": first, "batches": count, "seconds": elapsed, "tokens_per_s": count * B * S / elapsed}


def run_ours(job: dict) -> dict[str, float]:
    from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

    spec = {"data_path": job["prefix"], "seq_length": S, "split": "100,0,0", "packing": job["packing"], "seed": 3}
    if job["packing"] == "megatron":  # GPTDataset's samples, as the megatron-core rows build them
        spec["num_samples"] = MEGATRON_SAMPLES
    if job.get("storage_options"):
        spec["storage_options"] = job["storage_options"]
    start = time.perf_counter()
    wc = WorkerConfig(rank=0, world_size=1, num_workers=job["workers"])
    loader = get_savable_loader(get_train_dataset(spec, batch_size=B, worker_config=wc), prefetch_factor=4)
    result = _measure(iter(loader), job["seconds"])
    result["open_and_first_batch_s"] = time.perf_counter() - start - result["seconds"]
    return result


def run_megatron(job: dict) -> dict[str, float]:
    import torch
    from megatron.core.datasets import gpt_dataset
    from megatron.core.datasets.object_storage_utils import ObjectStorageConfig

    # GPTDataset builds its ObjectStorageConfig itself: the chunk size is its only knob.
    gpt_dataset.ObjectStorageConfig = functools.partial(ObjectStorageConfig, bin_chunk_nbytes=job["chunk"])
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    start = time.perf_counter()
    config = gpt_dataset.GPTDatasetConfig(
        random_seed=3, sequence_length=S, blend=([job["prefix"]], None), split="100,0,0",
        tokenizer=NullTokenizer(50257), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, mmap_bin_files=False, path_to_cache=job["cache"],
        object_storage_cache_path=job["idx_cache"],
    )  # fmt: skip
    sizes = [job["num_samples"], None, None]
    dataset = BlendedMegatronDatasetBuilder(gpt_dataset.GPTDataset, sizes, lambda: True, config).build()[0]
    loader = torch.utils.data.DataLoader(dataset, batch_size=B, num_workers=job["workers"], prefetch_factor=4)
    result = _measure(iter(loader), job["seconds"])
    result["open_and_first_batch_s"] = time.perf_counter() - start - result["seconds"]
    return result


def run_reference(job: dict) -> dict[str, float]:
    """A plain client loop: sample-sized ranged GETs at random offsets, synchronous batches of 64 from
    one process through obstore. Not a ceiling: a loader that keeps requests in flight beats it."""
    import numpy
    import obstore
    from obstore.store import S3Store

    bucket, key = job["prefix"][len("s3://") :].split("/", 1)
    store = S3Store(
        bucket, endpoint=os.environ["AWS_ENDPOINT_URL"], access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"], region="us-east-1",
        client_options={"allow_http": True},
    )  # fmt: skip
    size = obstore.head(store, key + ".bin")["size"]
    rng = numpy.random.default_rng(0)
    nbytes = (S + 1) * 2

    def batches():
        while True:
            starts = (rng.integers(0, size - nbytes, 64) // 2 * 2).tolist()
            obstore.get_ranges(store, key + ".bin", starts=starts, lengths=[nbytes] * 64)
            for _ in range(64 // B):
                yield

    start = time.perf_counter()
    result = _measure(batches(), job["seconds"])
    result["open_and_first_batch_s"] = time.perf_counter() - start - result["seconds"]
    return result


def _child(job: dict) -> dict:
    env = {**os.environ, **job.pop("env", {})}
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(job)],
        env=env, capture_output=True, text=True, timeout=job["seconds"] * 4 + 600,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{job['name']} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from s3_servers import proxy, s3rver_server, upload

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="5-second measurements")
    args = parser.parse_args()
    seconds = 5.0 if args.quick else args.seconds
    prefix = _shard()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as scratch, s3rver_server(os.path.join(scratch, "s3")) as server:
        upload(server, BUCKET, {f"c150m.{e}": f"{prefix}.{e}" for e in ("bin", "idx")})
        with proxy(server) as p:
            p.set(latency=LATENCY)
            env = {**server.env(), "AWS_ENDPOINT_URL": p.endpoint}
            url = f"s3://{BUCKET}/c150m"
            jobs = plan(url, prefix, args.quick)
            for i, job in enumerate(jobs):
                node = os.path.join(scratch, f"node{i}")
                job.update(
                    seconds=seconds,
                    cache=os.path.join(node, "indices"),
                    idx_cache=os.path.join(node, "idx"),
                    env={**env, **job.get("env", {}), "STATEFULSET_REMOTE_CACHE": os.path.join(node, "remote-idx"),
                         "XDG_CACHE_HOME": os.path.join(node, "xdg")},
                )  # fmt: skip
                p.reset()
                p.set(latency=LATENCY)
                result = _child(dict(job))
                stats = p.stats()
                samples = (result["batches"] + 1) * B
                result["requests"] = stats["requests"]
                result["requests_per_sample"] = stats["ranged"] / samples
                results[job["name"]] = result
                print(
                    f"{job['name']:45s} {result['tokens_per_s'] / 1e6:8.2f}M tok/s  "
                    f"{result['requests_per_sample']:6.2f} req/sample  "
                    f"first batch {result['open_and_first_batch_s']:.2f} s",
                    flush=True,
                )
    report = {"latency_s": LATENCY, "seconds": seconds, "results": results}
    write_results("object_storage", report, EXTRA, quick=args.quick)
    print(markdown(report))


def plan(url: str, prefix: str, quick: bool) -> list[dict]:
    """The rows of one run (``quick``: one of each kind)."""
    ours = [("megatron", w) for w in ((0, 2) if quick else (0, 2, 4, 8))]
    ours += [("native", w) for w in ((0,) if quick else (0, 1, 4, 8))]
    megatron = [(1 << 20, "1 MiB", w) for w in ((4,) if quick else (4, 8, 16, 32))]
    megatron += [] if quick else [(256 << 20, "256 MiB", 4)]
    return [
        {"name": GET_LOOP, "kind": "reference", "prefix": url, "workers": 0},
        {"name": "ours, local files, packing: native, 4 workers", "kind": "ours", "prefix": prefix, "workers": 4,
         "packing": "native"},
        *({"name": f"ours, S3, packing: {packing}, {w} workers", "kind": "ours", "prefix": url, "workers": w,
           "packing": packing} for packing, w in ours),
        *([] if quick else [{"name": "ours, S3 through s3fs only, packing: native, 4 workers", "kind": "ours",
                             "prefix": url, "workers": 4, "packing": "native",
                             "env": {"STATEFULSET_S3_CLIENT": "s3fs"}}]),
        *({"name": f"megatron-core, S3, chunk {label}, {w} workers", "kind": "megatron", "prefix": url,
           "workers": w, "chunk": chunk, "num_samples": MEGATRON_SAMPLES} for chunk, label, w in megatron),
    ]  # fmt: skip


# Row names of runs before the rename (the 'reference' row was never a ceiling; those rows were native).
LEGACY_NAMES = {
    "reference: raw ranged GETs, one process, 64 in flight": GET_LOOP,
    "ours, local files, 4 workers": "ours, local files, packing: native, 4 workers",
    **{f"ours, S3, {w} workers": f"ours, S3, packing: native, {w} workers" for w in (0, 1, 4, 8)},
    "ours, S3 through s3fs only, 4 workers": "ours, S3 through s3fs only, packing: native, 4 workers",
}


def markdown(report: dict) -> str:
    results = report["results"]
    """The table of docs/benchmarks.md; ``÷ megatron-core`` only where the samples are the same."""
    results = report["results"]
    local = next(v for k, v in results.items() if k.startswith("ours, local files"))["tokens_per_s"]
    loop = next(v for k, v in results.items() if k.startswith(("plain GET loop", "reference")))["tokens_per_s"]
    best_megatron = max(v["tokens_per_s"] for k, v in results.items() if k.startswith("megatron"))
    results = {LEGACY_NAMES.get(k, k): v for k, v in results.items()}
    rows = [
        "| Loader | tokens/s | ÷ megatron-core (best), same samples | of ours on local files | ÷ plain GET loop "
        "| requests/sample | cold first batch, s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        like = "packing: megatron" in name or name.startswith("megatron")
        ratio = f"{r['tokens_per_s'] / best_megatron:.3g}×" if like else "— (other samples)"
        rows.append(
            f"| {name} | {r['tokens_per_s'] / 1e6:.3g}M | {ratio} | "
            f"{r['tokens_per_s'] / local:.2%} | {r['tokens_per_s'] / loop:.2f} | "
            f"{r['requests_per_sample']:.2f} | {r['open_and_first_batch_s']:.2f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        job = json.loads(sys.argv[2])
        run = {"megatron": run_megatron, "ours": run_ours, "reference": run_reference}[job["kind"]]
        print(json.dumps(run(job)))
    else:
        main()
