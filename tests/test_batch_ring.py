"""The batch ring's sequence stamps, and the one module that touches DataLoader's private parts.

The ring's slot count rests on torch's prefetch policy. Here a real worker is given a ring of one
slot under a DataLoader that prefetches two, as a torch that prefetched more than its policy
today would: the worker refills the slot the trainer is about to copy. The trainer must refuse it
by name, never hand over batch 2's rows as batch 0.
"""

from __future__ import annotations

import itertools
import time

import numpy
import pytest
import torch
from torch.utils.data import DataLoader

from statefulset import IndexedDatasetWriter, StatefulsetError, WorkerConfig, get_train_dataset
from statefulset.loading import torch_internals
from statefulset.loading.batches import BatchSource
from statefulset.loading.receive import receive
from statefulset.loading.ring import BatchRing

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("ring")
    rng = numpy.random.default_rng(3)
    with IndexedDatasetWriter(root / "a") as w:
        for _ in range(200):
            w.add_document(rng.integers(0, 60000, int(rng.geometric(1 / 50))))
    spec = {"data_path": str(root / "a"), "seq_length": 32, "packing": "native", "path_to_cache": str(root / "c")}
    return get_train_dataset(spec, batch_size=2, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=1))


def _source(dataset, ring):
    cursor = dataset.layout()
    return BatchSource(dataset.stream, cursor, dataset.stop_batch(cursor), None, ring, dataset.document_boundaries)


def _identity(item):
    return item


def test_a_slot_refilled_during_the_copy_is_refused_by_name(dataset):
    expected = {t: rows["text"] for t, rows in itertools.islice(iter(_source(dataset, None)), 3)}
    assert not numpy.array_equal(expected[0], expected[2])
    ring = BatchRing(1, 1, dataset.batch_size, dataset.fields(), bundle=1)  # one slot, prefetch 2
    source = _source(dataset, ring)
    loader = DataLoader(
        source, batch_size=None, collate_fn=_identity, num_workers=1, prefetch_factor=2, multiprocessing_context="fork"
    )
    iterator = iter(loader)
    item = next(iterator)
    assert item[:4] == ("bundle", 0, 0, 0)
    # Gate: the worker, asked for two batches ahead, writes 1 then 2 into the only slot (bounded wait).
    deadline = time.monotonic() + 60
    while not numpy.array_equal(ring.view(0, 0)["text"][0], expected[2]):
        assert time.monotonic() < deadline, "the worker never refilled the slot"
        time.sleep(0.01)
    with pytest.raises(StatefulsetError) as caught:
        receive(source, item, 0)
    text = str(caught.value)
    assert text.startswith("batch ring: slot 0 of DataLoader worker 0 holds stamps begin=2, end=2 after the trainer")
    assert "micro-batch 0" in text and "prefetches more than the ring was sized for" in text
    del iterator


def test_an_intact_slot_passes_the_stamp_check(dataset):
    ring = BatchRing(1, 3, dataset.batch_size, dataset.fields(), bundle=1)
    source = _source(dataset, ring)
    loader = DataLoader(
        source, batch_size=None, collate_fn=_identity, num_workers=1, prefetch_factor=2, multiprocessing_context="fork"
    )
    expected = [rows["text"] for _, rows in itertools.islice(iter(_source(dataset, None)), 6)]
    for t, item in zip(range(6), loader, strict=False):
        (batch,) = receive(source, item, t)
        assert torch.equal(batch["text"], torch.from_numpy(expected[t]))


def test_changed_torch_internals_are_named():
    # A single-process iterator is a real DataLoader iterator without the worker attributes we use.
    iterator = iter(DataLoader(list(range(4)), batch_size=None, num_workers=0))
    with pytest.raises(StatefulsetError) as caught:
        torch_internals.check_iterator(iterator)
    text = str(caught.value)
    assert "changed DataLoader internals that statefulset relies on (missing: _workers" in text
    assert f"torch {torch.__version__}" in text and torch_internals.TESTED in text
