"""``loader.metrics()``'s incremental reads (issue 29's cost) against a computation from scratch.

A read keeps its values between calls and recomputes only what changed: the per-source values from
positions looked up ahead, the storage sums when a row's bytes changed, the workers' queue from the
slots' end stamps sorted when one changed. After random steps (runs of a steady step, reads at the
same place, jumps), with 0 and 2 DataLoader workers, across a stage change and into a restored
loader, every read must equal the same metrics computed from the public pieces (the stream's blend
tree, the weights, the storage rows, the ring's stamps) with nothing kept. Both ways a read runs:
the compiled read (one C call, statefulset.loading.compiled_read) serving all it can, and Python
alone (the fallback without the extension, or with one built from another kernels_module.c).
"""

from __future__ import annotations

import numpy
import pytest
from corpora import write_sources

from statefulset import WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.index import compiled
from statefulset.shards import storage_stats
from statefulset.streams.standing import weights_at

SEQ, BATCH = 16, 4


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    root = tmp_path_factory.mktemp("incremental")
    web, code, math = write_sources(root, {"web": 100, "code": 140, "math": 180}, seed=5)
    stages = [(0, {web: 0.7, code: 0.3}), (96, {web: 0.2, code: 0.3, math: 0.5}), (300, {math: 1.0, web: 1.0})]
    return {
        "seq_length": SEQ, "split": "1", "packing": "native", "seed": 4, "path_to_cache": str(root / "cache"),
        "stages": [{"start": start, "data_path": mix} for start, mix in stages],
    }  # fmt: skip


@pytest.fixture(params=["compiled", "python"])
def read_by(request, monkeypatch, tmp_path):
    """The compiled read (required: the extension is built by pip install -e / setup.py build_ext), or
    Python alone, as with an extension built from another kernels_module.c (a stale build)."""
    compiled._reset()
    if request.param == "python":
        stale = tmp_path / "kernels_module.c"
        stale.write_text("/* another version */\n")
        monkeypatch.setattr(compiled, "_MODULE_SOURCE", stale)
    else:
        assert compiled.module_function("metrics_read") is not None, "build the extension: setup.py build_ext"
    yield request.param
    monkeypatch.undo()
    compiled._reset()


def _from_scratch(loader, start: numpy.ndarray, shared: tuple[bytes, numpy.ndarray] | None) -> dict[str, float]:
    """The metrics at the loader's place computed with nothing kept; ``start``: the trainer's storage
    row when the loader was made; ``shared``: the ring's stamps and its workers' storage rows as the
    read saw them (None: no ring)."""
    meter, ds = loader._options["meter"], loader.dataset
    stream, position = ds.stream, loader.batches_taken * BATCH
    values = {
        "data_wait_seconds": meter.wait, "batches": float(meter.batches),
        "tokens": float(meter.batches * BATCH * SEQ), "worker_restarts": 0.0, "stall_warnings": 0.0,
    }  # fmt: skip
    delivery = meter.delivery() if meter.delivery is not None else None
    if delivery is not None:
        ready = len(delivery.ready)
        if shared is not None:  # a scan of every slot's end stamp
            ends = numpy.frombuffer(shared[0], dtype=numpy.int64).reshape(-1, 2)[:, 1]
            ready += delivery.source.ring.bundle * sum(int(end) >= delivery.next_t for end in ends)
        values["workers/ready_batches"] = float(ready)
    values["position"] = float(position)
    counts = stream.source_counts(position)
    raw = weights_at(stream, position)[1]
    for prefix, count, weight in zip(stream.prefixes, counts, raw, strict=True):
        values[f"source/{prefix}/samples"] = float(count)
        values[f"source/{prefix}/weight"] = weight / (sum(raw) or 1.0)
        values[f"source/{prefix}/epoch"] = count / stream.epoch_sizes[prefix]
    own = storage_stats.row()
    total = own - start
    total[storage_stats.IN_FLIGHT] = own[storage_stats.IN_FLIGHT]  # instantaneous: not counted from the start
    if shared is not None:
        total += shared[1].sum(axis=0)
    values.update(storage_stats.summary(total))
    return values


def _checked_read(loader) -> dict[str, float]:
    """A read, compared with the computation from scratch over the shared memory it saw (read again
    if a worker wrote a stamp or a counter during it)."""
    meter = loader._options["meter"]
    for _ in range(1000):
        delivery = meter.delivery() if meter.delivery is not None else None
        ring = delivery.source.ring if delivery is not None and delivery.workers else None
        before = (ring.stamps.numpy().tobytes(), ring.stats.numpy().copy()) if ring else None
        got = loader.metrics()
        after = (ring.stamps.numpy().tobytes(), ring.stats.numpy().copy()) if ring else None
        if before is None or (before[0] == after[0] and (before[1] == after[1]).all()):
            want = _from_scratch(loader, loader.start_row, before)
            assert list(got) == list(want) and got == want, {k: (got.get(k), want.get(k)) for k in want}
            return got
    raise AssertionError("the workers' shared memory changed during each of 1000 reads")


def _made(spec, workers: int, state=None, read_by: str = "compiled"):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    loader = get_savable_loader(get_train_dataset(spec, batch_size=BATCH, worker_config=wc))
    assert (loader._options["meter"]._compiled is not None) == (read_by == "compiled")
    loader.start_row = storage_stats.row().copy()  # what the loader's meter counts from
    if state is not None:
        loader.restore_state_rank(state)
    return loader


def _walk(loader, rng, reads: int) -> None:
    """``reads`` reads after random steps: runs of one step (0: the same place again), storage counted between."""
    it = iter(loader)
    done = 0
    while done < reads:
        step, run = int(rng.choice([0, 1, 1, 2, 3, 7])), int(rng.integers(1, 6))
        for _ in range(run):
            for _ in range(step):
                next(it)
            kind = rng.integers(0, 4)
            if kind == 1:
                storage_stats.read_ahead_taken(bool(rng.integers(0, 2)))
            elif kind == 2:
                ticket = storage_stats.request_started("s3://bucket/x.bin")
                _checked_read(loader)  # one request in flight
                storage_stats.request_ended(ticket, int(rng.integers(1, 5000)), retried=False)
            _checked_read(loader)
            done += 1


@pytest.mark.parametrize("workers", [0, 2])
def test_every_read_equals_the_metrics_computed_from_scratch(spec, workers, read_by):
    rng = numpy.random.default_rng(11 + workers)
    loader = _made(spec, workers, read_by=read_by)
    _checked_read(loader)  # before the first batch: no workers' queue yet
    _walk(loader, rng, 80)  # past the stage changes at positions 96 and 300
    assert loader.batches_taken * BATCH > 300
    state = loader.save_state_rank()
    again = _made(spec, workers, state, read_by)  # restored: read before iterating, then the queue comes
    _checked_read(again)
    _walk(again, rng, 40)


@pytest.mark.parametrize("workers", [0, 2])
def test_reads_after_every_batch_across_the_stage_changes_equal_the_metrics_computed_from_scratch(
    spec, workers, read_by
):
    """A logger's reads (one step, run long): most are looked up among the positions one walk of the blend
    tree covered ahead, a walk stops at the stage's end (the weights there are the next stage's), and the
    reads after each stage change must show its weights."""
    loader = _made(spec, workers, read_by=read_by)
    meter = loader._options["meter"]
    it = iter(loader)
    weights = set()
    served = 0  # reads the compiled read served: the Python dict was left behind
    for _ in range(100):  # positions 4 .. 400: past the stage changes at 96 and 300
        next(it)
        got = _checked_read(loader)
        served += meter._values["batches"] != got["batches"]
        weights.add(tuple(v for k, v in got.items() if k.endswith("/weight")))
    assert len(weights) == 3
    # Python: every read; compiled: all but those that walk the blend tree (the first two, and at the stage changes).
    assert served > 80 if read_by == "compiled" else served == 0
