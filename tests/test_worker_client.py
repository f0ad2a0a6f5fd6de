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
import json, sys, urllib.request
from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

spec, endpoint, workers = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])

def stats(path):
    with urllib.request.urlopen(endpoint + "/__proxy__/" + path, timeout=30) as answer:
        return json.loads(answer.read())

wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
dataset = get_train_dataset(spec, batch_size=4, worker_config=wc)
opened = stats("stats")["agents"]  # the trainer's reads while opening (the .bin's identity)
loader = get_savable_loader(dataset, multiprocessing_context="fork" if workers else None)
batches = iter(loader)
for _ in range(12):
    next(batches)
print(json.dumps({"opened": opened, "read": stats("stats")["agents"]}), flush=True)
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


@pytest.mark.parametrize("workers", [0, 2])
def test_workers_forked_after_opening_read_through_obstore(store, workers, tmp_path):
    server, p = store
    p.reset()
    options = {**server.options(), "endpoint_url": p.endpoint}
    spec = {"data_path": f"s3://{BUCKET}/shards/web", "seq_length": 64, "split": "100,0,0", "packing": "megatron",
            "seed": 5, "num_samples": 400, "storage_options": options}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "STATEFULSET_S3_CLIENT"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), STATEFULSET_REMOTE_CACHE=str(tmp_path / "node"))  # a fresh node
    out = subprocess.run(
        [sys.executable, "-c", _RUN, json.dumps(spec), p.endpoint, str(workers)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert sum(seen["opened"].values()) > 0, seen  # a fresh node reads the .bin's identity at open
    batches = {k: n - seen["opened"].get(k, 0) for k, n in seen["read"].items()}
    batches = {k: n for k, n in batches.items() if n}
    assert set(batches) == {"object_store"}, f"the batches' ranged GETs by client: {batches}"
