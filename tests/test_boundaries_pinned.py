"""Batches with document boundaries, pinned: every value and dtype a user receives, byte for byte.

Changes that only make boundaries cheaper (pieces packed once, cheaper kernel addresses, the
trainer's side of the ring) must not change a single value of CONTRACT section 10. The digests
below were computed with the code before those changes (main at ac45f9a); each packing is read
through 0 and 2 workers and through a loader restored from a 2-worker loader's state, one source
(the pieces packed where they are made) and a blend of two (the pieces merged), and every variant
must give the pinned digest.
"""

from __future__ import annotations

import hashlib

import numpy
import pytest

from statefulset import IndexedDatasetWriter, WorkerConfig, get_savable_loader, get_train_dataset

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

BATCHES, SPLIT_AT = 10, 4
PINNED = {
    ("megatron", "one"): "aa196b6892c4ef31e75d41289d37bac67266f31f6bd19cc55031eedfb31ccfcf",
    ("megatron", "blend"): "03d0b400b41661b23757004d08b1a9bd3c08cfcd255a9a161f273cfe571596bc",
    ("native", "one"): "74ca1f9a210f07319be0c5ff6bdda357475f3e86ed1ad63b0bbaa26b5a3c6fed",
    ("native", "blend"): "74419f5606b11da7c4111c1c2257d05972ecbbcc4e93244cf8b50438a8081141",
    ("bestfit", "one"): "313fb563dfef3e6e0efb805275f6ec523080fce0d3fb47df2c465ea3a283d2ca",
    ("bestfit", "blend"): "5c39c3e6ce74e606bb99d2bcde4462f2ad6af5d30b1ff7755d59918f465df7c6",
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two shards of documents of 1 to ~300 tokens (some empty), tokens numbering their document."""
    root = tmp_path_factory.mktemp("pinned")
    rng = numpy.random.default_rng(26)
    prefixes = []
    for k, (mean, count) in enumerate([(30, 500), (120, 200)]):
        prefix = str(root / f"part_{k}")
        with IndexedDatasetWriter(prefix, numpy.uint16) as w:
            for d in range(count):
                n = min(int(rng.geometric(1 / mean)), 300) if rng.random() > 0.03 else 0
                w.add_document(((d * 7 + numpy.arange(n)) % 60000).astype(numpy.uint16))
        prefixes.append(prefix)
    return prefixes


def _spec(corpus, packing, sources):
    data_path = corpus[0] if sources == "one" else {corpus[0]: 0.6, corpus[1]: 0.4}
    return {"data_path": data_path, "seq_length": 64, "packing": packing, "split": "1", "num_samples": 200}


def _loader(spec, workers):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    return get_savable_loader(get_train_dataset(spec, batch_size=4, worker_config=wc, document_boundaries=True))


def _digest(batches) -> str:
    h = hashlib.sha256()
    for batch in batches:
        for name in sorted(batch):
            value = batch[name].numpy()
            h.update(f"{name} {value.dtype} {value.shape}".encode())
            h.update(numpy.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def _variants(spec) -> dict[str, list]:
    """The same batches: in process, through 2 workers, and split by a save and restore (2 workers)."""
    out = {}
    for workers in (0, 2):
        out[f"{workers} workers"] = [b for _, b in zip(range(BATCHES), _loader(spec, workers), strict=False)]
    first = _loader(spec, 2)
    head = [b for _, b in zip(range(SPLIT_AT), first, strict=False)]
    restored = _loader(spec, 2)
    restored.load_state_dict(first.state_dict())
    out["restored"] = head + [b for _, b in zip(range(BATCHES - SPLIT_AT), restored, strict=False)]
    return out


@pytest.mark.parametrize("sources", ["one", "blend"])
@pytest.mark.parametrize("packing", ["megatron", "native", "bestfit"])
def test_batches_with_boundaries_are_pinned(corpus, packing, sources):
    variants = _variants(_spec(corpus, packing, sources))
    reference = variants["0 workers"]
    assert {"cu_seqlens", "max_seqlen", "position_ids"} <= set(reference[0])
    for name, batches in variants.items():
        assert len(batches) == BATCHES, name
        for i, (ours, theirs) in enumerate(zip(batches, reference, strict=True)):
            assert list(ours) == list(theirs), (name, i)
            for key, value in theirs.items():
                assert ours[key].dtype == value.dtype, (name, i, key)
                numpy.testing.assert_array_equal(ours[key].numpy(), value.numpy(), err_msg=f"{name} batch {i} {key}")
    assert _digest(reference) == PINNED[packing, sources]
