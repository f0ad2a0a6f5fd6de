"""``loader.metrics()`` (issue 29, CONTRACT §17): data wait, per-source counts and weights, storage counters.

Per-source counts are compared with a brute-force count of the stream's source at every
position below the rank's place; storage counters come from real DataLoader workers reading moto
through the fault proxy (tests/s3_proxy.py). The only timing checks are the issue's own, as lower
bounds: a delay injected on one rank's storage shows in that rank's ``data_wait_seconds``.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import Counter

import numpy
import pytest
import torch
from corpora import write_sources
from ranks import init_rank, spawn
from s3_servers import moto_server, proxy, upload

from statefulset import IndexedDatasetWriter, WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.errors import StatefulsetError
from statefulset.shards import storage_stats
from statefulset.streams.standing import weights_at

SEQ = 16
NAMES = ("web", "code", "math")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    sizes = {name: 120 + 30 * s for s, name in enumerate(NAMES)}
    return dict(zip(NAMES, write_sources(tmp_path_factory.mktemp("metrics"), sizes, seed=3, longest=60), strict=True))


def _spec(shards, cache) -> dict:
    stages = [(0, {"web": 0.7, "code": 0.3}), (96, {"web": 0.2, "code": 0.3, "math": 0.5})]
    return {
        "seq_length": SEQ, "split": "1", "packing": "native", "seed": 9, "path_to_cache": str(cache),
        "stages": [{"start": start, "data_path": {shards[n]: w for n, w in mix.items()}} for start, mix in stages],
    }  # fmt: skip


def _brute_force(stream, position: int) -> Counter:
    """Every position's source, one at a time (``explain``: another code path than the blend tree's counts)."""
    return Counter(stream.explain(p).source for p in range(position))


def test_per_source_counts_weights_and_epochs_follow_the_stream_across_a_stage_change(shards, tmp_path):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
    ds = get_train_dataset(_spec(shards, tmp_path / "c"), batch_size=4, worker_config=wc)
    loader = get_savable_loader(ds)
    it = iter(loader)
    before = loader.metrics()
    assert before["batches"] == 0 and before["data_wait_seconds"] == 0
    assert before["source/" + shards["web"] + "/weight"] == pytest.approx(0.7)
    assert before["source/" + shards["math"] + "/weight"] == 0
    for step in range(1, 31):  # 30 batches of 4: positions [0, 120), across the stage change at 96
        next(it)
        if step in (10, 30):
            m = loader.metrics()
            want = _brute_force(ds.stream, 4 * step)
            for name in NAMES:
                prefix = shards[name]
                assert m[f"source/{prefix}/samples"] == want.get(prefix, 0), (step, name)
                per_epoch = ds.stream.epoch_sizes[prefix]
                assert m[f"source/{prefix}/epoch"] == pytest.approx(want.get(prefix, 0) / per_epoch)
    assert m["batches"] == 30 and m["tokens"] == 30 * 4 * SEQ and m["position"] == 120
    waited = 0.0
    while loader.metrics()["workers/ready_batches"] == 0 and waited < 120:  # the workers fill their slots
        time.sleep(0.05)
        waited += 0.05
    ready = loader.metrics()["workers/ready_batches"]
    ring = loader._options["meter"].ring
    assert 0 < ready <= ring.workers * ring.slots * ring.bundle
    assert m["data_wait_seconds"] > 0
    assert m["source/" + shards["math"] + "/weight"] == pytest.approx(0.5)  # the second stage's mixture
    assert m["source/" + shards["web"] + "/weight"] == pytest.approx(0.2)
    assert m["read_ahead/batches"] == 0 and m["storage/requests"] == 0  # local shards: no storage requests
    assert all(isinstance(v, float) for v in m.values())

    # Restored: the stream's counts continue exactly; this loader's own counters start again.
    state = loader.save_state_rank()
    again = get_savable_loader(get_train_dataset(_spec(shards, tmp_path / "c"), batch_size=4, worker_config=wc))
    again.restore_state_rank(state)
    r = again.metrics()
    assert r["batches"] == 0 and r["data_wait_seconds"] == 0
    assert {k: v for k, v in r.items() if k.startswith("source/")} == {
        k: v for k, v in m.items() if k.startswith("source/")
    }


def test_every_read_is_a_new_dict_of_the_current_values(shards, tmp_path):
    """Reads keep one dict and update it in place (issue 29's cost): what a caller gets is its own copy,
    with the same keys in the same order, every value current, whether the position moved or not."""
    ds = get_train_dataset(
        _spec(shards, tmp_path / "c"), batch_size=4, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0)
    )
    loader = get_savable_loader(ds)
    it = iter(loader)
    first = loader.metrics()
    first["batches"], first["mine"] = -1.0, 1.0
    keys = list(loader.metrics())
    assert loader.metrics() is not loader.metrics() and "mine" not in keys and loader.metrics()["batches"] == 0
    for step in range(1, 31):  # across the stage change at position 96
        next(it)
        m = loader.metrics()
        assert list(m) == keys and m == loader.metrics()  # read twice at one place: the same values
        assert m["batches"] == step and m["position"] == 4 * step and m["tokens"] == 4 * step * SEQ
        # Per-source values come from a walk of the blend tree ahead of the reads: at each step they
        # are the scalar walk's at that position (and a brute-force count where it is checked).
        counts = dict(zip(ds.stream.prefixes, ds.stream.source_counts(4 * step), strict=True))
        stage_weights = dict(zip(ds.stream.prefixes, weights_at(ds.stream, 4 * step)[1], strict=True))
        for prefix, count in counts.items():
            assert m[f"source/{prefix}/samples"] == count, (step, prefix)
            assert m[f"source/{prefix}/epoch"] == count / ds.stream.epoch_sizes[prefix], (step, prefix)
            assert m[f"source/{prefix}/weight"] == pytest.approx(stage_weights[prefix] / sum(stage_weights.values()))
        if step in (23, 24, 25, 30):
            want = _brute_force(ds.stream, 4 * step)
            for name in NAMES:
                assert m[f"source/{shards[name]}/samples"] == want.get(shards[name], 0), (step, name)
    assert m[f"source/{shards['math']}/weight"] == pytest.approx(0.5)
    before = loader.metrics()
    ticket = storage_stats.request_started("s3://bucket/" + shards["web"] + ".bin")  # this process's own row
    storage_stats.request_ended(ticket, 1000, retried=False)
    after = loader.metrics()
    assert after["storage/requests"] == before["storage/requests"] + 1
    assert after["storage/bytes"] == before["storage/bytes"] + 1000 and list(after) == keys


def test_log_metrics_writes_every_metric_to_a_summary_writer_like_object(shards, tmp_path):
    class Writer:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    loader = get_savable_loader(get_train_dataset(_spec(shards, tmp_path / "c"), batch_size=2, worker_config=wc))
    next(iter(loader))
    w = Writer()
    loader.log_metrics(w, 7)
    assert {tag for tag, _, _ in w.scalars} == {"data/" + k for k in loader.metrics()}
    assert {step for _, _, step in w.scalars} == {7}
    with pytest.raises(StatefulsetError, match="add_scalar"):
        loader.log_metrics(object(), 7)


@pytest.fixture(scope="module")
def server():
    with moto_server() as s:
        yield s


@pytest.fixture(scope="module")
def remote(server, tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    rng = numpy.random.default_rng(4)
    prefix = root / "web"
    with IndexedDatasetWriter(prefix, dtype=numpy.uint16) as w:
        for _ in range(400):
            w.add_document(rng.integers(0, 60000, int(rng.integers(20, 200))))
    upload(server, "metrics", {f"t/web{e}": f"{prefix}{e}" for e in (".bin", ".idx")})
    return "s3://metrics/t/web"


def _remote_spec(url, options, cache) -> dict:
    return {"data_path": url, "seq_length": 64, "split": "1", "packing": "native", "seed": 2,
            "path_to_cache": str(cache), "storage_options": options}  # fmt: skip


def test_storage_counters_of_the_workers_reach_the_trainer(server, remote, tmp_path, monkeypatch):
    monkeypatch.setenv("STATEFULSET_REMOTE_CACHE", str(tmp_path / "node"))
    with proxy(server) as p:
        p.set(latency=0.02)
        spec = _remote_spec(remote, {**server.options(), "endpoint_url": p.endpoint}, tmp_path / "c")
        wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
        loader = get_savable_loader(get_train_dataset(spec, batch_size=4, worker_config=wc))
        it = iter(loader)
        for _ in range(8):
            next(it)
        m = loader.metrics()
    assert m["storage/requests"] >= 8  # at least a ranged GET per batch, made in the worker processes
    assert m["storage/bytes"] >= 8 * 4 * 65 * 2  # uint16 tokens of 8 batches
    assert m["storage/latency_p50_seconds"] >= 0.02 and m["storage/latency_p99_seconds"] >= 0.02
    assert m["storage/retries"] == 0 and m["storage/failures"] == 0
    assert m["read_ahead/batches"] >= 8


def test_a_delay_on_storage_shows_in_data_wait(server, remote, tmp_path, monkeypatch):
    """The issue's own timing check, as a lower bound: without read-ahead each batch waits for at
    least one GET, each delayed 0.4 s by the proxy."""
    monkeypatch.setenv("STATEFULSET_REMOTE_CACHE", str(tmp_path / "node"))
    monkeypatch.setenv("STATEFULSET_READ_AHEAD", "0")
    with proxy(server) as p:
        spec = _remote_spec(remote, {**server.options(), "endpoint_url": p.endpoint}, tmp_path / "c")
        wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
        loader = get_savable_loader(get_train_dataset(spec, batch_size=4, worker_config=wc))
        it = iter(loader)
        next(it)  # opened and warm
        p.set(latency=0.4)
        start = loader.metrics()["data_wait_seconds"]
        for _ in range(5):
            next(it)
        waited = loader.metrics()["data_wait_seconds"] - start
    assert waited >= 5 * 0.4


def test_the_stall_warning_names_the_worker_batch_and_the_stalled_url(server, remote, tmp_path, monkeypatch, caplog):
    """The proxy never answers the worker's first GET (``stall``, set before the worker starts); the
    client's read timeout (3 s) ends it and the retry succeeds: the first next() always waits past
    stall_seconds=1 for that request, and the loader goes on."""
    monkeypatch.setenv("STATEFULSET_REMOTE_CACHE", str(tmp_path / "node"))
    options = {**server.options(), "config_kwargs": {"read_timeout": 3, "connect_timeout": 3}}
    with proxy(server) as p:
        spec = _remote_spec(remote, {**options, "endpoint_url": p.endpoint}, tmp_path / "c")
        wc = WorkerConfig(rank=0, world_size=1, num_workers=1)
        loader = get_savable_loader(get_train_dataset(spec, batch_size=4, worker_config=wc), stall_seconds=1)
        p.set(stall=1)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="statefulset"):
            it = iter(loader)
            for _ in range(3):
                next(it)
    stalls = [r.getMessage() for r in caplog.records if "statefulset stall" in r.getMessage()]
    named = [t for t in stalls if "oldest storage request in flight" in t]
    assert named, stalls
    text = named[0]
    assert re.search(r"DataLoader worker 0 of 1 was building micro-batch 0 \(stream positions 0\.\.3\)", text)
    assert remote + ".bin" in text  # the shard the batch reads
    assert f"reading {remote}.*" in text  # the request in flight
    m = loader.metrics()
    # At a bounded rate: at 1 s, 2 s, 4 s ... of one wait, so at most 1 + log2(wait) warnings.
    assert m["stall_warnings"] == len(stalls) <= 1 + math.log2(max(m["data_wait_seconds"], 1.0))
    assert m["storage/retries"] >= 1


def _across_rank(rank, world, init_file, specs, cache, out):
    import os

    init_rank(rank, world, init_file)
    os.environ["STATEFULSET_READ_AHEAD"] = "0"  # each batch waits for its own GETs
    os.environ["STATEFULSET_REMOTE_CACHE"] = cache
    wc = WorkerConfig(rank=rank, world_size=world, num_workers=0)
    loader = get_savable_loader(get_train_dataset(specs[rank], batch_size=2, worker_config=wc), stall_seconds=None)
    it = iter(loader)
    for _ in range(5):
        next(it)
    torch.save(loader.metrics(across_ranks=True), f"{out}/{rank}.pt")


def test_across_ranks_names_the_rank_whose_storage_is_slow(server, remote, tmp_path):
    """Two gloo ranks; rank 1's store answers every GET 1 s late (its own proxy): its data wait is at
    least 5 s, and it is the cross-rank max."""
    with proxy(server) as fast, proxy(server) as slow:
        slow.set(latency=1.0)
        specs = [
            _remote_spec(remote, {**server.options(), "endpoint_url": p.endpoint}, tmp_path / f"c{r}")
            for r, p in enumerate((fast, slow))
        ]
        spawn(_across_rank, 2, tmp_path, specs, str(tmp_path / "node"), str(tmp_path))
    got = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    waits = [g["data_wait_seconds"] for g in got]
    assert waits[1] >= 5 * 1.0
    for g in got:
        assert g["data_wait_seconds/max"] == waits[1] and g["data_wait_seconds/max_rank"] == 1
        assert g["data_wait_seconds/min"] == waits[0]
        assert g["data_wait_seconds/mean"] == pytest.approx(sum(waits) / 2)
    assert got[0]["batches"] == got[1]["batches"] == 5


def test_across_ranks_on_one_rank_needs_no_process_group(shards, tmp_path):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    loader = get_savable_loader(get_train_dataset(_spec(shards, tmp_path / "c"), batch_size=2, worker_config=wc))
    next(iter(loader))
    m = loader.metrics(across_ranks=True)
    assert m["data_wait_seconds/max"] == m["data_wait_seconds/min"] == m["data_wait_seconds"]
    assert m["data_wait_seconds/max_rank"] == 0


def test_the_megatron_helper_writes_at_log_interval_to_tensorboard_and_wandb(shards, tmp_path):
    from types import SimpleNamespace

    from statefulset.integrations.megatron import log_loader_metrics

    class Board:
        def __init__(self):
            self.tags = {}

        def add_scalar(self, tag, value, step):
            self.tags[tag] = (value, step)

    class Wandb:
        def __init__(self):
            self.logged = []

        def log(self, values, step):
            self.logged.append((step, values))

    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    loader = get_savable_loader(get_train_dataset(_spec(shards, tmp_path / "c"), batch_size=2, worker_config=wc))
    it = iter(loader)
    wrapped = SimpleNamespace(iterable=SimpleNamespace(loader=loader))  # as Megatron's RerunDataIterator holds ours
    board, wandb = Board(), Wandb()
    for iteration in range(1, 5):
        next(it)
        log_loader_metrics(wrapped, iteration, 2, writer=board, wandb_writer=wandb)
    assert [step for step, _ in wandb.logged] == [2, 4]
    assert wandb.logged[-1][1]["data/batches"] == 4 and board.tags["data/batches"] == (4.0, 4)
    assert log_loader_metrics(SimpleNamespace(loader=None), 4, 2, writer=board) is None  # a receiving stage
    with pytest.raises(StatefulsetError, match="log_interval"):
        log_loader_metrics(loader, 4, 0, writer=board)


def test_report_draws_shares_and_data_wait_from_metrics_lines_and_from_a_state(shards, tmp_path):
    import json

    import yaml

    from statefulset.tools.cli import main

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(_spec(shards, tmp_path / "c"), sort_keys=False))
    lines = []
    loaders = [
        get_savable_loader(
            get_train_dataset(str(spec), batch_size=4, worker_config=WorkerConfig(rank=r, world_size=2, num_workers=0))
        )
        for r in range(2)
    ]
    iterators = [iter(loader) for loader in loaders]
    for step in range(1, 16):  # 15 steps of 2 ranks x 4: positions [0, 120), across the stage change at 96
        for rank, (loader, it) in enumerate(zip(loaders, iterators, strict=True)):
            next(it)
            lines.append(json.dumps({"step": step, "rank": rank, **loader.metrics()}))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(lines) + "\n")
    assert main(["report", str(metrics), "--spec", str(spec), "--out", str(tmp_path / "a")]) == 0
    for name in ("shares.png", "data_wait.png"):
        assert (tmp_path / "a" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    torch.save(loaders[0].save_state_rank(), tmp_path / "state.pt")
    assert main(["report", str(tmp_path / "state.pt"), "--spec", str(spec), "--out", str(tmp_path / "b")]) == 0
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["shares.png"]

    (tmp_path / "bad.jsonl").write_text('{"rank": 0}\n')
    assert main(["report", str(tmp_path / "bad.jsonl"), "--spec", str(spec)]) == 2  # named: no int 'step'


def test_a_validation_loader_counts_over_its_passes(shards, tmp_path):
    from statefulset import get_loader, get_val_dataset

    spec = {**_spec(shards, tmp_path / "c"), "split": "80,20,0"}
    wc = WorkerConfig(rank=0, world_size=1, num_workers=1)
    loader = get_loader(get_val_dataset(spec, batch_size=4, worker_config=wc))
    first = sum(1 for _ in loader)
    second = sum(1 for _ in loader)
    m = loader.metrics()
    assert first == second > 0 and m["batches"] == first + second
    assert m["tokens"] == m["batches"] * 4 * SEQ
    assert not any(k.startswith("source/") for k in m)  # one pass: no place in a training stream
