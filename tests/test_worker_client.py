"""DataLoader workers forked from a trainer that opened an ``s3://`` dataset read through obstore (issue 26).

obstore's runtime does not survive ``fork``, so a process forked from one that had started it reads
through s3fs (statefulset.shards.obstore_client), at several times the client CPU per request. Opening
a dataset reads a keyed sample of each ``.bin`` (its identity, statefulset.shards.digests) in the
trainer; read through obstore, it left every forked worker on s3fs: on the 2-core benchmark machine
2 and 4 workers drew 24% and 26% of what the store served, slower than one process (3.3-3.7 ms
of worker CPU per ranged GET against 0.6 ms through obstore). The loopback proxy in front of a
real S3 API server (moto) counts the ranged GETs by client (the User-Agent), so the test sees
which client the workers used. The loader runs in a fresh process: a pytest process that read
through obstore in an earlier test would itself put forked workers on s3fs.

A trainer that does read through obstore before forking (``ds[p]`` here) still puts its forked workers
on s3fs: that fallback is no longer silent, each worker logs one WARNING naming the parent that
started obstore's runtime, the cost and the remedy; the batches are the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy
import pytest
from s3_servers import moto_server, proxy, upload

from statefulset import IndexedDatasetWriter

pytest.importorskip("obstore")

BUCKET = "corpus"

_RUN = """
import json, logging, os, sys, urllib.request
import numpy
from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

spec, endpoint, workers, context, first = json.loads(sys.argv[1]), *sys.argv[2:]
workers = int(workers)
logging.basicConfig(level=logging.WARNING, format="pid=%(process)d %(levelname)s %(message)s")

def stats(path):
    with urllib.request.urlopen(endpoint + "/__proxy__/" + path, timeout=30) as answer:
        return json.loads(answer.read())

wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
dataset = get_train_dataset(spec, batch_size=4, worker_config=wc)
if first == "read":
    dataset[0]  # the trainer reads a sample through obstore: its runtime starts here, before the fork
opened = stats("stats")["agents"]  # the trainer's reads so far (at open: the .bin's identity)
loader = get_savable_loader(dataset, multiprocessing_context=context if workers else None)
batches = iter(loader)
got = []
for _ in range(12):
    batch = next(batches)
    got.append((batch["sample_id"].tolist(), batch["text"].numpy().copy()))
read = stats("stats")["agents"]
wrong = [p for ids, text in got for p, row in zip(ids, text) if not numpy.array_equal(row, dataset[p]["text"])]
print(json.dumps({"opened": opened, "read": read, "trainer": os.getpid(), "wrong": wrong,
                  "samples": sum(len(ids) for ids, _ in got)}), flush=True)
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("workers-s3")
    rng = numpy.random.default_rng(11)
    with IndexedDatasetWriter(root / "web", dtype=numpy.uint16) as w:
        for _ in range(600):
            w.add_document(rng.integers(0, 60000, int(rng.geometric(1 / 60))))
    with moto_server() as server:
        upload(server, BUCKET, {f"shards/web.{e}": str(root / f"web.{e}") for e in ("bin", "idx")})
        with proxy(server) as p:
            yield server, p


def run(store, tmp_path, workers, context="fork", first="open"):
    """The batches' ranged GETs by client (those after the trainer's own reads), the run's output and stderr."""
    server, p = store
    p.reset()
    options = {**server.options(), "endpoint_url": p.endpoint}
    spec = {"data_path": f"s3://{BUCKET}/shards/web", "seq_length": 64, "split": "100,0,0", "packing": "megatron",
            "seed": 5, "num_samples": 400, "storage_options": options}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "STATEFULSET_S3_CLIENT"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), STATEFULSET_REMOTE_CACHE=str(tmp_path / "node"))  # a fresh node
    out = subprocess.run(
        [sys.executable, "-c", _RUN, json.dumps(spec), p.endpoint, str(workers), context, first],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert sum(seen["opened"].values()) > 0, seen  # a fresh node reads the .bin's identity at open
    batches = {k: n - seen["opened"].get(k, 0) for k, n in seen["read"].items()}
    batches = {k: n for k, n in batches.items() if n}
    assert seen["wrong"] == [] and seen["samples"] == 48, seen  # every row equals ds[p], read by the trainer
    return batches, seen, out.stderr


@pytest.mark.parametrize("workers", [0, 2])
def test_workers_forked_after_opening_read_through_obstore(store, workers, tmp_path):
    batches, _, stderr = run(store, tmp_path, workers)
    assert set(batches) == {"object_store"}, f"the batches' ranged GETs by client: {batches}"
    assert "through s3fs" not in stderr, stderr[-3000:]


def test_workers_forked_after_the_trainer_read_warn_once_each(store, tmp_path):
    """The trainer reads ds[0] through obstore, then forks 2 workers: they read through s3fs (obstore's
    runtime does not survive fork), and each says so once, naming the trainer, the cost and the remedy.
    Saw it fail on 20c1259-equivalent main: the same s3fs reads, no WARNING."""
    batches, seen, stderr = run(store, tmp_path, 2, "fork", "read")
    assert set(batches) == {"aiobotocore"}, f"the batches' ranged GETs by client: {batches}"
    lines = [line for line in stderr.splitlines() if "obstore's runtime was started in process" in line]
    assert len(lines) == 2, stderr[-3000:]  # one per worker, not one per request
    pids = {line.split()[0] for line in lines}
    assert len(pids) == 2 and f"pid={seen['trainer']}" not in pids, lines
    for line in lines:
        assert line.split()[1] == "WARNING", line
        assert f"started in process {seen['trainer']} before it forked this one" in line, line
        assert "through s3fs instead, slower" in line and "3.4 ms against 0.6 ms" in line, line
        assert "multiprocessing_context='forkserver'" in line and "no ds[p]" in line, line


def test_forkserver_workers_of_a_trainer_that_read_use_obstore(store, tmp_path):
    """The remedy the WARNING names: forkserver workers start from a fresh interpreter, without the
    trainer's obstore runtime, and read through obstore."""
    batches, _, stderr = run(store, tmp_path, 2, "forkserver", "read")
    assert set(batches) == {"object_store"}, f"the batches' ranged GETs by client: {batches}"
    assert "through s3fs" not in stderr, stderr[-3000:]
