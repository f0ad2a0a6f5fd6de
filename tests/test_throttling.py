"""A store that throttles makes the loader slow down, not give up (issue 24 §1, "four workers on S3").

The limiter (statefulset.shards.throttle) on its own: slots, one cut per round of failures, growth
on success, wider merges while cut. Then four DataLoader workers reading ``packing: megatron`` from
moto behind the fault proxy set to answer 503 SlowDown above 4 requests in flight: every batch
equals the local one. ``benchmarks/bench_throttled_store.py`` is the long form, with timings.
"""

from __future__ import annotations

import asyncio

import numpy
import pytest
import torch
from s3_servers import moto_server, proxy, upload

from statefulset import IndexedDatasetWriter, WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.shards.throttle import Limiter


def test_the_limit_holds_requests_cuts_once_per_round_and_grows_back():
    async def scenario() -> None:
        lim = Limiter(most=4)
        epochs = [await lim.acquire() for _ in range(4)]
        fifth = asyncio.ensure_future(lim.acquire())
        await asyncio.sleep(0)
        assert not fifth.done() and lim.inflight == 4  # the fifth waits for a slot
        for epoch in epochs[:3]:  # three failures of one round: one cut
            lim.release(epoch, failed=True, cause="SlowDown")
        assert lim.limit == 2 and lim.cuts == 1
        assert lim.merge_gap(64 << 10, 16 << 20) == 128 << 10  # half the requests: twice the merge gap
        second = await asyncio.wait_for(fifth, 60)  # after the shared pause, a slot below the new limit
        assert lim.inflight == 2  # the fourth, still in flight, and the fifth: the new limit
        lim.release(epochs[3], failed=True, cause="SlowDown")  # sent before the cut: no second cut
        assert lim.cuts == 1 and lim.limit == 2
        lim.release(second, failed=False)
        for _ in range(8):
            e = await asyncio.wait_for(lim.acquire(), 60)
            lim.release(e, failed=False)
        assert 2 < lim.limit <= 4  # grows back by 1/limit per success

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def server():
    with moto_server() as s:
        yield s


def _spec(path: str, cache, options=None) -> dict:
    spec = {"data_path": path, "seq_length": 256, "split": "100,0,0", "packing": "megatron", "seed": 2,
            "num_samples": 400, "path_to_cache": str(cache)}  # fmt: skip
    if options:
        spec["storage_options"] = options
    return spec


def _batches(spec: dict, workers: int, steps: int) -> list[torch.Tensor]:
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    it = iter(get_savable_loader(get_train_dataset(spec, batch_size=8, worker_config=wc), watchdog_timeout_seconds=300))
    return [next(it)["text"] for _ in range(steps)]


def test_four_workers_slow_down_to_what_a_throttling_store_serves(server, tmp_path, monkeypatch):
    """Failed on 5cf6a81-equivalent main: 'the storage kept failing transiently' (each worker kept
    every request of 8 batches in flight, and each batch's retries gave up)."""
    rng = numpy.random.default_rng(4)
    prefix = tmp_path / "web"
    with IndexedDatasetWriter(prefix, dtype=numpy.uint16) as w:
        for _ in range(3000):
            w.add_document(rng.integers(0, 60000, int(rng.geometric(1 / 100))))
    upload(server, "corpus", {f"t/web{e}": f"{prefix}{e}" for e in (".bin", ".idx")})
    want = _batches(_spec(str(prefix), tmp_path / "c0"), 0, 12)
    monkeypatch.setenv("STATEFULSET_REMOTE_CACHE", str(tmp_path / "node"))
    with proxy(server) as p:
        p.set(max_inflight=4, latency=0.005)
        spec = _spec("s3://corpus/t/web", tmp_path / "c1", {**server.options(), "endpoint_url": p.endpoint})
        got = _batches(spec, 4, 12)
        assert p.stats()["503s"] > 0  # the store did throttle
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


_READER = """
import json, sys
from statefulset import IndexedDataset, WorkerConfig, get_savable_loader, get_train_dataset
spec = json.loads(sys.argv[1])
IndexedDataset(spec["data_path"], storage_options=spec["storage_options"])[1]  # the parent's own client
wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
it = iter(get_savable_loader(get_train_dataset(spec, batch_size=8, worker_config=wc), multiprocessing_context="fork"))
for _ in range(12):
    next(it)
print("read")
"""


@pytest.mark.parametrize("client", ["s3fs", "obstore"])
def test_a_process_reading_s3_through_forked_workers_prints_nothing_of_its_clients(client, server, tmp_path):
    """No "Task exception was never retrieved" / "attached to a different loop" from aiobotocore: forked
    workers keep their parent's s3fs clients instead of closing them on a loop that does not run there."""
    import json
    import os
    import subprocess
    import sys

    rng = numpy.random.default_rng(5)
    prefix = tmp_path / "web"
    with IndexedDatasetWriter(prefix, dtype=numpy.uint16) as w:
        for _ in range(2000):
            w.add_document(rng.integers(0, 60000, int(rng.geometric(1 / 100))))
    upload(server, "corpus", {f"quiet/web{e}": f"{prefix}{e}" for e in (".bin", ".idx")})
    env = {**os.environ, "STATEFULSET_S3_CLIENT": client, "STATEFULSET_REMOTE_CACHE": str(tmp_path / "node")}
    with proxy(server) as p:
        p.set(max_inflight=3, latency=0.005)  # connections opened and dropped all along
        spec = _spec("s3://corpus/quiet/web", tmp_path / "c", {**server.options(), "endpoint_url": p.endpoint})
        run = subprocess.run([sys.executable, "-c", _READER, json.dumps(spec)], capture_output=True, text=True,
                             env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0 and "read" in run.stdout, run.stderr
    noise = [line for line in run.stderr.splitlines()
             if not line.startswith("statefulset: ") and "kernels were not installed" not in line]  # fmt: skip
    assert not noise, run.stderr[-4000:]
