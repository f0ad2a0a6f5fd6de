"""A job reads one version of each ``.bin``: a file or object replaced under it is a named error (review C4).

On S3 (moto, on loopback) every ranged GET carries ``If-Match`` with the ETag seen at open, through
both clients; a local ``.bin`` is checked (inode, size, mtime) when a worker starts or restarts, when
a stream is reopened in another process, and at each new pass of the trainer's own iteration
(a running one keeps the file it mapped: the old inode, the original's tokens); a file rewritten in
place (the mapped inode itself) is caught by a ``stat`` after every copy out of it.
Every batch handed out before the error is the original's.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import boto3
import numpy
import pytest
import torch
from s3_servers import moto_server, proxy, upload

from statefulset import (
    IndexedDatasetWriter,
    StatefulsetError,
    WorkerConfig,
    get_savable_loader,
    get_train_dataset,
    open_stream,
)
from statefulset.shards.remote import RemoteFile

BUCKET = "pinned"


@pytest.fixture(scope="module")
def server():
    with moto_server() as s:
        yield s


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    root = tmp_path_factory.mktemp("pinned")
    rng = numpy.random.default_rng(3)
    with IndexedDatasetWriter(root / "web", dtype=numpy.uint16) as w:
        for _ in range(300):
            w.add_document(rng.integers(0, 60000, int(rng.geometric(1 / 50))))
    return root / "web"


def _spec(prefix: str, cache, options=None) -> dict:
    spec = {"data_path": prefix, "seq_length": 32, "split": "100,0,0", "packing": "native", "seed": 1,
            "path_to_cache": str(cache)}  # fmt: skip
    if options:
        spec["storage_options"] = options
    return spec


def _other_version(path: str) -> bytes:
    """The same size, other tokens: only the version tells them apart."""
    with open(path, "rb") as f:
        return bytes(255 - b for b in f.read())


def _local_copy(shard, tmp_path) -> str:
    """A copy of the shard's .bin and .idx that a test may replace or rewrite: its prefix."""
    folder = tmp_path / "data"
    folder.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(f"{shard}{ext}", folder / f"web{ext}")
    return str(folder / "web")


def _loader(spec: dict, workers: int):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    return get_savable_loader(get_train_dataset(spec, batch_size=4, worker_config=wc), watchdog_timeout_seconds=120)


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
def test_an_object_overwritten_mid_run_is_a_named_error_never_other_tokens(client, server, shard, tmp_path,
                                                                           monkeypatch):  # fmt: skip
    """Failed on 5cf6a81: the overwritten object's tokens came back with no error."""
    monkeypatch.setenv("STATEFULSET_S3_CLIENT", client)
    monkeypatch.setenv("STATEFULSET_REMOTE_CACHE", str(tmp_path / "node"))
    key = f"{client}/web"
    upload(server, BUCKET, {f"{key}.bin": f"{shard}.bin", f"{key}.idx": f"{shard}.idx"})
    url = f"s3://{BUCKET}/{key}"
    want = open_stream(_spec(str(shard), tmp_path / "c0"))
    stream = open_stream(_spec(url, tmp_path / "c1", server.options()))
    positions = numpy.arange(0, 60, 3)
    numpy.testing.assert_array_equal(stream.gather(positions), want.gather(positions))
    loader = _loader(_spec(url, tmp_path / "c2", server.options()), workers=1)
    reference = iter(_loader(_spec(str(shard), tmp_path / "c3"), workers=0))
    it = iter(loader)
    for _ in range(3):
        assert torch.equal(next(it)["text"], next(reference)["text"])
    client_s3 = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=server.key,
                             aws_secret_access_key=server.secret, region_name="us-east-1")  # fmt: skip
    client_s3.put_object(Bucket=BUCKET, Key=f"{key}.bin", Body=_other_version(f"{shard}.bin"))
    changed = rf"{url}\.bin: changed since it was opened"
    with pytest.raises(StatefulsetError, match=changed):
        stream.gather(positions)
    with pytest.raises(StatefulsetError, match=changed):  # the worker reads ahead a bounded number of batches
        for _ in range(200):
            assert torch.equal(next(it)["text"], next(reference)["text"])  # the original's, until the error


def test_obstore_ranged_reads_carry_the_opened_etag_and_refuse_another_version(server, tmp_path, monkeypatch):
    """Issue 26: obstore's ranged GETs are one ``get_range_async`` each, ``If-Match`` carried by the
    store opened for the object's version (its default headers) instead of ``get_async``'s options.
    Every ranged GET still carries it, through obstore, and the store refuses another version; a file
    opened after the change reads the new one."""
    monkeypatch.setenv("STATEFULSET_S3_CLIENT", "obstore")
    original = numpy.random.default_rng(5).bytes(1 << 20)
    (tmp_path / "object").write_bytes(original)
    (tmp_path / "other").write_bytes(bytes(255 - b for b in original))
    upload(server, BUCKET, {"one-future/object": str(tmp_path / "object")})
    url = f"s3://{BUCKET}/one-future/object"
    offsets, sizes = [700_000, 0, 300_000, 300_100], [4096, 64, 100, 2]  # 1 to 3 requests (the merge gap)
    with proxy(server) as p:
        options = {**server.options(), "endpoint_url": p.endpoint}
        opened = RemoteFile(url, options)
        p.reset()
        assert opened.read_ranges(offsets, sizes) == [original[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
        stats = p.stats()
        assert stats["ranged"] == stats["pinned"] == stats["agents"]["object_store"] == opened.requests > 0
        upload(server, BUCKET, {"one-future/object": str(tmp_path / "other")})
        with pytest.raises(StatefulsetError, match=rf"{url}: changed since it was opened \(opened as ETag"):
            opened.read_ranges(offsets, sizes)
        reopened = RemoteFile(url, options)
        assert reopened.read(300_000, 100) == bytes(255 - b for b in original[300_000:300_100])
        stats = p.stats()
        assert stats["ranged"] == stats["pinned"] == stats["agents"]["object_store"] > opened.requests  # all pinned


def test_a_local_bin_replaced_under_a_job_is_a_named_error_at_worker_start_and_reopen(shard, tmp_path):
    """Failed on 5cf6a81: a reopened stream (spawn, forkserver) and a worker started after the replacement
    read the new file's tokens."""
    prefix = _local_copy(shard, tmp_path)
    spec = _spec(prefix, tmp_path / "cache")
    stream = open_stream(spec)
    trainer = _loader(spec, workers=0)
    workers = _loader(spec, workers=1)
    reference = iter(_loader(_spec(str(shard), tmp_path / "c3"), workers=0))
    first = iter(trainer)
    assert torch.equal(next(first)["text"], next(reference)["text"])
    replacement = Path(f"{prefix}.bin.new")
    replacement.write_bytes(_other_version(f"{prefix}.bin"))
    os.replace(replacement, f"{prefix}.bin")
    changed = rf"{prefix}\.bin: changed since it was opened"
    reopened = pickle.loads(pickle.dumps(stream))  # how a spawned worker reopens it: refused at first use
    with pytest.raises(StatefulsetError, match=changed):
        reopened.gather(numpy.arange(4))
    with pytest.raises(StatefulsetError, match=changed):
        reopened.check_unchanged()
    with pytest.raises(StatefulsetError, match=changed):
        stream.check_unchanged()
    with pytest.raises(StatefulsetError, match=rf"DataLoader worker 0.*{changed}"):
        next(iter(workers))  # a worker started after the replacement
    # The trainer's running iteration keeps the version it mapped (the old inode): the original's tokens.
    assert torch.equal(next(first)["text"], next(reference)["text"])


@pytest.mark.parametrize("workers", [0, 1])
def test_a_local_bin_rewritten_in_place_mid_run_is_a_named_error_never_other_tokens(shard, tmp_path, workers):
    """Found by the long campaign (seed 101656, replace_inplace, 0 workers): a ``.bin`` rewritten in
    place (same inode, same size) while a loader read it through its memory map gave the new tokens
    with no error, since the version was only checked when a worker started or a pass began. Every
    read is now followed by a ``stat`` of the local files it read, before its rows are handed out."""
    prefix = _local_copy(shard, tmp_path)
    spec = _spec(prefix, tmp_path / "cache")
    stream = open_stream(spec)
    positions = numpy.arange(0, 40, 2)
    want = stream.gather(positions)
    it = iter(_loader(spec, workers))
    reference = iter(_loader(_spec(str(shard), tmp_path / "c3"), workers=0))
    assert torch.equal(next(it)["text"], next(reference)["text"])
    with open(f"{prefix}.bin", "r+b") as f:  # what `cp` over an existing file or `dd conv=notrunc` does
        f.write(_other_version(f"{prefix}.bin"))
    changed = rf"{prefix}\.bin: changed since it was opened"
    with pytest.raises(StatefulsetError, match=changed):
        stream.gather(positions)
    assert not numpy.array_equal(want, open_stream(_spec(prefix, tmp_path / "other")).gather(positions))
    with pytest.raises(StatefulsetError, match=changed):  # a worker reads ahead a bounded number of batches
        for _ in range(200):
            assert torch.equal(next(it)["text"], next(reference)["text"])  # the original's, until the error


def _replaced_before_workers_start(shard, tmp_path, context: str, body: bytes | None = None):
    """A loader with 2 ``context`` workers over a copy of ``shard`` whose ``.bin`` is renamed over
    (by ``body``, else the other version) after the loader opened it, before its workers start."""
    prefix = _local_copy(shard, tmp_path)
    wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
    loader = get_savable_loader(get_train_dataset(_spec(prefix, tmp_path / "cache"), batch_size=4, worker_config=wc),
                                watchdog_timeout_seconds=120, multiprocessing_context=context)  # fmt: skip
    replacement = Path(f"{prefix}.bin.new")
    replacement.write_bytes(_other_version(f"{prefix}.bin") if body is None else body)
    os.replace(replacement, f"{prefix}.bin")
    return loader, prefix


@pytest.mark.parametrize("context", ["forkserver", "spawn"])
def test_a_local_bin_replaced_before_reopening_workers_start_names_the_change(shard, tmp_path, context):
    """Found by the long campaign (seed 101703, issue 24): a worker that reopens the stream (forkserver,
    spawn) refused the replaced ``.bin`` while unpickling its dataset, before torch's worker loop, so
    it died and the trainer said only "DataLoader worker (pid(s) ...) exited unexpectedly". The
    refusal now waits for the worker's first fetch, which reports it through the batch ring."""
    loader, prefix = _replaced_before_workers_start(shard, tmp_path, context)
    with pytest.raises(StatefulsetError, match=rf"DataLoader worker \d.*{prefix}\.bin: changed since it was opened"):
        next(iter(loader))


def test_a_local_bin_replaced_by_one_that_cannot_be_reopened_names_the_change(shard, tmp_path):
    """Issue 24, a replacement of another size: reopening the stream in the worker fails (the ``.bin``
    no longer fits its ``.idx``); the worker reports the change, not "exited unexpectedly"."""
    body = _other_version(f"{shard}.bin")[: os.path.getsize(f"{shard}.bin") // 2]
    loader, prefix = _replaced_before_workers_start(shard, tmp_path, "forkserver", body)
    with pytest.raises(StatefulsetError, match=rf"DataLoader worker \d.*{prefix}\.bin: changed since it was opened"):
        next(iter(loader))


def test_an_object_overwritten_before_reopening_workers_start_names_the_change(server, shard, tmp_path, monkeypatch):
    """Issue 24 as the long campaign found it (seed 101703): the ``.bin`` object overwritten after the
    loader opened it, before its forkserver workers start."""
    monkeypatch.setenv("STATEFULSET_REMOTE_CACHE", str(tmp_path / "node"))
    key = "early/web"
    upload(server, BUCKET, {f"{key}.bin": f"{shard}.bin", f"{key}.idx": f"{shard}.idx"})
    url = f"s3://{BUCKET}/{key}"
    wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
    dataset = get_train_dataset(_spec(url, tmp_path / "cache", server.options()), batch_size=4, worker_config=wc)
    loader = get_savable_loader(dataset, watchdog_timeout_seconds=120, multiprocessing_context="forkserver")
    client_s3 = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=server.key,
                             aws_secret_access_key=server.secret, region_name="us-east-1")  # fmt: skip
    client_s3.put_object(Bucket=BUCKET, Key=f"{key}.bin", Body=_other_version(f"{shard}.bin"))
    with pytest.raises(StatefulsetError, match=rf"DataLoader worker \d.*{url}\.bin: changed since it was opened"):
        next(iter(loader))
