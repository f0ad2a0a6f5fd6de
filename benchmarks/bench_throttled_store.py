"""A store that throttles: does the loader slow down, or give up? (issue 24 §1, "four workers on S3").

Reported: ``packing: megatron``, 4 DataLoader workers, a 150M-token shard on s3rver behind a
one-thread proxy adding 10 ms per request: after ~130 s a batch failed with "the storage kept
failing transiently; cause: ConnectTimeoutError", while 0 and 2 workers read fine. Each worker
keeps 8 batches read ahead, each batch ~5 ranged GETs per sample, all sent at once: hundreds of
requests in flight against a store that serves a few at a time.

Here the store is moto on loopback behind ``tests/s3_proxy.py`` set to answer 503 SlowDown to any
request that arrives while ``--max-inflight`` others are in flight (as a real store throttles
above what it can serve), with ``--latency`` added per request. For each worker count the script
reads ``--steps`` batches ``--runs`` times, compares every batch with the same spec on local disk,
and records whether the run finished, its seconds (median and spread), and the proxy's counts
(requests, 503s answered, most requests in flight).

    python benchmarks/bench_throttled_store.py                  # this checkout
    PYTHONPATH=/path/to/old/checkout python benchmarks/bench_throttled_store.py --out old.json

Results: ``benchmarks/results/throttled_store.json`` (commit, machine, versions).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

from benchenv import environment, git_state, spread  # noqa: E402
from s3_servers import moto_server, proxy, upload  # noqa: E402

import statefulset  # noqa: E402
from statefulset import IndexedDatasetWriter, WorkerConfig, get_savable_loader, get_train_dataset  # noqa: E402


def write_shard(folder: str, tokens: int) -> str:
    rng = numpy.random.default_rng(11)
    prefix = os.path.join(folder, "web")
    with IndexedDatasetWriter(prefix, dtype=numpy.uint16) as w:
        written = 0
        while written < tokens:
            n = int(rng.geometric(1 / 400))
            w.add_document(rng.integers(0, 60000, n))
            written += n
    return prefix


def spec(data_path: str, cache: str, options: dict | None = None) -> dict:
    out = {"data_path": data_path, "seq_length": 2048, "split": "100,0,0", "packing": "megatron", "seed": 3,
           "num_samples": 4000, "path_to_cache": cache}  # fmt: skip
    if options:
        out["storage_options"] = options
    return out


def batches(the_spec: dict, workers: int, steps: int) -> list[torch.Tensor]:
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    loader = get_savable_loader(get_train_dataset(the_spec, batch_size=8, worker_config=wc),
                                watchdog_timeout_seconds=600)  # fmt: skip
    it = iter(loader)
    return [next(it)["text"] for _ in range(steps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=5_000_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-inflight", type=int, default=8)
    parser.add_argument("--latency", type=float, default=0.01)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "throttled_store.json"))
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="bench-throttle-")
    prefix = write_shard(folder, args.tokens)
    want = batches(spec(prefix, os.path.join(folder, "c0")), 0, args.steps)
    rows = []
    with moto_server() as server:
        upload(server, "corpus", {f"t/web{e}": prefix + e for e in (".bin", ".idx")})
        with proxy(server) as p:
            options = {**server.options(), "endpoint_url": p.endpoint}
            for workers in args.workers:
                for run in range(args.runs):
                    os.environ["STATEFULSET_REMOTE_CACHE"] = os.path.join(folder, f"node-{workers}-{run}")
                    p.reset()
                    p.set(max_inflight=args.max_inflight, latency=args.latency)
                    started, error = time.perf_counter(), None
                    try:
                        got = batches(spec("s3://corpus/t/web", os.path.join(folder, f"c-{workers}-{run}"), options),
                                      workers, args.steps)  # fmt: skip
                        same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
                    except Exception as exc:  # the reproducer records the failure instead of stopping
                        error, same = f"{type(exc).__name__}: {exc}"[:600], None
                    seconds = time.perf_counter() - started
                    stats = p.stats()
                    row = {"workers": workers, "run": run, "finished": error is None, "identical": same,
                           "seconds": round(seconds, 2), "error": error, "requests": stats["requests"],
                           "503s": stats["503s"], "most_inflight": stats["most_inflight"]}  # fmt: skip
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    summary = {}
    for workers in args.workers:
        mine = [r for r in rows if r["workers"] == workers]
        done = [r["seconds"] for r in mine if r["finished"]]
        summary[str(workers)] = {
            "finished": f"{len(done)}/{len(mine)}",
            "identical": all(r["identical"] for r in mine if r["finished"]),
            "seconds": spread(done) if done else None,
            "median_503s": statistics.median(r["503s"] for r in mine),
        }
    result = {
        "args": vars(args),
        "summary": summary,
        "rows": rows,
        "git": git_state(),
        "library": os.path.dirname(statefulset.__file__),
        "environment": environment(),
    }
    from provenance import write_results

    write_results("throttled_store", result, path=args.out)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
