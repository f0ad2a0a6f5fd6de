"""Shards on a real S3 API server (moto's, on loopback): identical batches and states, faults, errors.

Every comparison is against the same files on local disk, whole streams, with 0, 1 and 2 workers
and the fork and spawn start methods.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import numpy
import pytest
import torch
from s3_servers import moto_server, proxy, upload

from statefulset import (
    IndexedDataset,
    IndexedDatasetWriter,
    StatefulsetError,
    WorkerConfig,
    get_savable_loader,
    get_train_dataset,
    open_stream,
)
from statefulset.shards.ranged_reads import OVERLOAD_TRIES

BUCKET = "corpus"
STEPS = 12


@pytest.fixture(scope="module")
def server():
    with moto_server() as s:
        yield s


@pytest.fixture(scope="module")
def shards(tmp_path_factory, server):
    root = tmp_path_factory.mktemp("s3corpus")
    rng = numpy.random.default_rng(7)
    for name, docs, dtype in (("web", 500, numpy.uint16), ("code", 250, numpy.int32)):
        with IndexedDatasetWriter(root / name, dtype=dtype) as w:
            for _ in range(docs):
                w.add_document(rng.integers(0, 60000, int(rng.geometric(1 / 60))))
    upload(server, BUCKET, {f"shards/{n}.{e}": str(root / f"{n}.{e}") for n in ("web", "code") for e in ("bin", "idx")})
    return root


@pytest.fixture(params=["obstore", "s3fs"])
def client(request, monkeypatch):
    """Ranged reads through obstore (the default when installed) and through s3fs."""
    monkeypatch.setenv("STATEFULSET_S3_CLIENT", request.param)
    return request.param


@pytest.fixture
def remote_cache(tmp_path, monkeypatch):
    """A fresh node: no local copies of any .idx yet."""
    monkeypatch.setenv("STATEFULSET_REMOTE_CACHE", str(tmp_path / "node-cache"))
    return tmp_path / "node-cache"


def _spec(where: str, packing: str, server=None, cache=None) -> dict:
    spec = {
        "data_path": {f"{where}/web": 0.7, f"{where}/code": 0.3},
        "seq_length": 64,
        "split": "90,10,0",
        "packing": packing,
        "seed": 5,
    }
    if packing == "megatron":
        spec["num_samples"] = 400
    if server is not None:
        spec["storage_options"] = server.options()
    if cache is not None:
        spec["path_to_cache"] = str(cache)
    return spec


def _batches(spec: dict, workers: int, steps: int = STEPS, context=None, state=None):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    loader = get_savable_loader(
        get_train_dataset(spec, batch_size=4, worker_config=wc),
        multiprocessing_context=context,
        watchdog_timeout_seconds=120,
    )
    if state is not None:
        loader.restore_state_rank(state)
    it = iter(loader)
    got = [next(it) for _ in range(steps)]
    return loader, torch.cat([b["text"] for b in got]), torch.cat([b["sample_id"] for b in got])


@pytest.mark.parametrize("packing", ["native", "megatron"])
def test_batches_equal_local_files(packing, client, server, shards, remote_cache, tmp_path):
    local = _spec(str(shards), packing, cache=tmp_path / "c1")
    remote = _spec(f"s3://{BUCKET}/shards", packing, server, cache=tmp_path / "c2")
    _, want, want_ids = _batches(local, 0)
    for workers, context in ((0, None), (1, "fork"), (2, "fork"), (2, "spawn")):
        _, got, ids = _batches(remote, workers, context=context)
        assert torch.equal(got, want) and torch.equal(ids, want_ids), (workers, context)
    stream, local_stream = open_stream(remote), open_stream(local)
    assert stream.fingerprint == local_stream.fingerprint  # content, not location
    positions = numpy.arange(0, 40 * 7, 7)
    numpy.testing.assert_array_equal(stream.gather(positions), local_stream.gather(positions))


def test_state_saved_on_local_files_restores_on_s3_with_other_workers(server, shards, remote_cache):
    local = _spec(str(shards), "native")
    remote = _spec(f"s3://{BUCKET}/shards", "native", server)
    loader, _, _ = _batches(local, 0, steps=5)
    state = loader.save_state_rank()
    _, want, _ = _batches(local, 0, steps=STEPS)
    _, resumed, _ = _batches(remote, 2, steps=STEPS - 5, state=state, context="fork")
    assert torch.equal(resumed, want[5 * 4 :])
    moved, _, _ = _batches(remote, 1, steps=3, context="fork")
    again, _, _ = _batches(local, 0, steps=3, state=moved.save_state_rank())  # and back
    assert again.batches_taken == 6


def test_environment_variables_reach_the_client(server, shards, remote_cache, monkeypatch):
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    ds = IndexedDataset(f"s3://{BUCKET}/shards/web")
    numpy.testing.assert_array_equal(ds[3], IndexedDataset(shards / "web")[3])


def test_index_downloaded_once_per_node(server, shards, remote_cache):
    url = f"s3://{BUCKET}/shards/web"
    code = (
        "import sys, json; from statefulset import IndexedDataset; "
        "from statefulset.shards.index_copies import index_copy; "
        f"ds = IndexedDataset({url!r}, storage_options=json.loads(sys.argv[1])); "
        f"print(index_copy({url + '.idx'!r}, json.loads(sys.argv[1])).downloaded)"
    )
    import json

    env = {**os.environ, "STATEFULSET_REMOTE_CACHE": str(remote_cache)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, json.dumps(server.options())], env=env, stdout=subprocess.PIPE)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs.count(b"False\n") == 3  # each found the copy (one process downloaded it under the lock)
    copies = [f for f in os.listdir(remote_cache) if f.endswith(".idx")]
    assert len(copies) == 1
    assert (remote_cache / copies[0]).read_bytes() == (shards / "web.idx").read_bytes()


def test_requests_are_batched(client, server, shards, remote_cache):
    with proxy(server) as p:
        opts = {**server.options(), "endpoint_url": p.endpoint}
        spec = {"data_path": f"s3://{BUCKET}/shards/web", "seq_length": 64, "split": "100,0,0", "packing": "native"}
        spec["storage_options"] = opts
        stream = open_stream(spec)
        p.reset()
        stream.gather(numpy.arange(0, 32 * 5, 5))
        # Native samples are one range each: at most one request per sample, all in one batch.
        assert 1 <= p.stats()["requests"] <= 32


class TestFaults:
    @pytest.fixture
    def faulty(self, server, shards, remote_cache, monkeypatch):
        monkeypatch.setenv("STATEFULSET_STORAGE_RETRIES", "4")
        with proxy(server) as p:
            opts = {**server.options(), "endpoint_url": p.endpoint, "config_kwargs": {"read_timeout": 3}}
            spec = {"data_path": f"s3://{BUCKET}/shards/web", "seq_length": 64, "split": "100,0,0", "packing": "native"}
            spec["storage_options"] = opts
            yield p, spec

    def test_transient_faults_are_retried(self, client, faulty, shards, caplog):
        p, spec = faulty
        stream = open_stream(spec)
        local = open_stream({**spec, "data_path": str(shards / "web"), "storage_options": None})
        want = local.gather(numpy.arange(20))
        for fault in ("fail503", "drop"):
            p.set(**{fault: 2})
            with caplog.at_level(logging.WARNING, logger="statefulset"):
                numpy.testing.assert_array_equal(stream.gather(numpy.arange(20)), want)
        p.set(latency=0.2)
        numpy.testing.assert_array_equal(stream.gather(numpy.arange(20)), want)

    def test_persistent_503_gives_up_with_the_url(self, client, faulty, monkeypatch):
        p, spec = faulty
        stream = open_stream(spec)
        # A read that succeeds ends any run of failures of the process's limiter (an earlier test's, in
        # this process, left its pauses doubling: this test took 10-14 s through s3fs, run after obstore's).
        stream.gather(numpy.arange(4))
        # One retry: a 503 SlowDown is an overload answer, allowed OVERLOAD_TRIES times as many
        # attempts, each after the limiter's doubling pause. One request (4 native samples in a row).
        monkeypatch.setenv("STATEFULSET_STORAGE_RETRIES", "1")
        p.set(fail503=-1)
        start = time.monotonic()
        attempts = 1 + OVERLOAD_TRIES
        with pytest.raises(StatefulsetError, match=rf"s3://corpus/shards/web\.bin: .*after {attempts} attempts"):
            stream.gather(numpy.arange(4))
        assert time.monotonic() - start < 60
        # Every attempt reached the store once: no client's own retries stacked under ours (issue 26).
        assert p.stats()["503s"] == attempts

    def test_wrong_credentials(self, faulty):
        p, spec = faulty
        p.set(deny=-1)
        with pytest.raises(StatefulsetError, match=r"s3://corpus/shards/web\.bin: access refused"):
            open_stream(spec)

    def test_missing_object(self, faulty):
        _, spec = faulty
        spec = {**spec, "data_path": f"s3://{BUCKET}/shards/nothing"}
        with pytest.raises(StatefulsetError, match=r"key 'data_path'.*s3://corpus/shards/nothing\.bin: no such object"):
            open_stream(spec)


def test_missing_credentials_and_unreachable_endpoint(server, shards, remote_cache, tmp_path, monkeypatch):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("STATEFULSET_STORAGE_RETRIES", "1")
    url = f"s3://{BUCKET}/shards/web"
    with pytest.raises(StatefulsetError, match=r"web\.bin: no usable credentials"):
        IndexedDataset(url, storage_options={"endpoint_url": server.endpoint})
    start = time.monotonic()
    closed = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(StatefulsetError, match=r"web\.bin: the endpoint is unreachable"):
        IndexedDataset(url, storage_options={"endpoint_url": closed, "key": "k", "secret": "s"})
    assert time.monotonic() - start < 120


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_inspect_gives_its_verdict_on_s3(server, shards, remote_cache):
    env = {**os.environ, **server.env(), "STATEFULSET_STORAGE_RETRIES": "1"}
    cli = [sys.executable, "-m", "statefulset", "inspect"]
    good = subprocess.run([*cli, f"s3://{BUCKET}/shards/web"], env=env, capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr
    assert "documents" in good.stdout and "500" in good.stdout
    bad = subprocess.run([*cli, f"s3://{BUCKET}/shards/gone"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "s3://corpus/shards/gone.bin: INVALID" in bad.stdout or "gone.bin: no such object" in bad.stdout


def test_without_s3fs_the_message_names_the_extra(shards, tmp_path):
    code = (
        "import sys; sys.modules['s3fs'] = None\n"
        "from statefulset import open_stream, StatefulsetError\n"
        "try:\n"
        "    open_stream({'data_path': 's3://b/web', 'seq_length': 8, 'split': '1,0,0', 'packing': 'native'})\n"
        "except StatefulsetError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "key 'data_path'" in out.stdout and "s3://b/web.bin" in out.stdout, out.stdout + out.stderr
    assert "pip install 'statefulset[s3]'" in out.stdout


class TestWorkers:
    """A stalled request trips the watchdog; a failing one is one clear error in the trainer."""

    @pytest.fixture
    def behind_proxy(self, server, shards, remote_cache):
        with proxy(server) as p:
            opts = {**server.options(), "endpoint_url": p.endpoint, "config_kwargs": {"read_timeout": 300}}
            spec = {"data_path": f"s3://{BUCKET}/shards/web", "seq_length": 64, "split": "100,0,0", "packing": "native"}
            spec["storage_options"] = opts
            yield p, spec

    def _loader(self, spec, workers=1, **kwargs):
        wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
        return get_savable_loader(
            get_train_dataset(spec, batch_size=4, worker_config=wc), multiprocessing_context="fork", **kwargs
        )

    def test_stalled_request_trips_the_watchdog(self, behind_proxy, monkeypatch):
        p, spec = behind_proxy
        monkeypatch.setenv("STATEFULSET_READ_AHEAD", "1")
        loader = self._loader(spec, watchdog_timeout_seconds=2, fail_on_timeout=True)
        p.set(stall=-1)
        start = time.monotonic()
        with pytest.raises(StatefulsetError) as caught:
            next(iter(loader))
        assert time.monotonic() - start < 60
        text = str(caught.value)
        assert text.startswith("watchdog: no batch for 2 s: DataLoader worker 0 of 1 was building micro-batch 0")
        assert "reading s3://corpus/shards/web.bin" in text

    def test_stalled_request_trips_the_watchdog_with_no_workers(self, behind_proxy, monkeypatch):
        # Before, num_workers=0 built batches on the trainer's thread and the watchdog never ran:
        # a stalled read blocked the trainer for the storage timeouts (minutes). The call runs on
        # a thread here so that the test ends (and fails) within its bound either way.
        p, spec = behind_proxy
        monkeypatch.setenv("STATEFULSET_READ_AHEAD", "1")
        loader = self._loader(spec, workers=0, watchdog_timeout_seconds=2, fail_on_timeout=True)
        p.set(stall=-1)
        outcome: list = []

        def first_batch():
            try:
                outcome.append(next(iter(loader)))
            except Exception as exc:
                outcome.append(exc)

        thread = threading.Thread(target=first_batch, daemon=True)
        thread.start()
        thread.join(timeout=60)
        assert outcome, "no batch and no error within 60 s: the watchdog did not fire with 0 workers"
        assert isinstance(outcome[0], StatefulsetError), outcome[0]
        text = str(outcome[0])
        assert text.startswith("watchdog: no batch for 2 s: the trainer process was building micro-batch 0"), text
        assert "reading s3://corpus/shards/web.bin" in text

    def test_without_fail_on_timeout_it_warns_then_gives_up(self, behind_proxy, caplog):
        p, spec = behind_proxy
        loader = self._loader(spec, watchdog_timeout_seconds=0.5)
        p.set(stall=-1)
        with caplog.at_level(logging.WARNING, logger="statefulset"), pytest.raises(StatefulsetError) as caught:
            next(iter(loader))
        assert "gave up after 10 watchdog periods" in str(caught.value)
        assert "still waiting (fail_on_timeout=True raises instead)" in caplog.text

    def test_a_failing_read_in_a_worker_is_one_clear_error(self, client, behind_proxy):
        p, spec = behind_proxy
        it = iter(self._loader(spec))
        next(it)
        p.set(deny=-1)
        with pytest.raises(StatefulsetError) as caught:
            for _ in range(200):
                next(it)
        text = str(caught.value)
        assert text.startswith("DataLoader worker 0, building micro-batch ")
        assert "s3://corpus/shards/web.bin: access refused" in text and "Traceback" not in text
