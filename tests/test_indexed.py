"""Round trips through IndexedDatasetWriter and IndexedDataset, over every dtype code."""

from __future__ import annotations

import gc
import pickle

import numpy
import pytest
from conftest import ALL_DTYPES, random_documents, write_documents

from statefulset import IndexedDataset, IndexedDatasetWriter, StatefulsetError
from statefulset.errors import SequenceIndexError


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_round_trip_every_dtype(tmp_path, rng, dtype):
    docs = random_documents(rng, dtype)
    write_documents(tmp_path / "shard", docs, dtype)
    ds = IndexedDataset(tmp_path / "shard")
    sequences = [s for seqs in docs for s in seqs]
    assert ds.dtype == dtype
    assert len(ds) == len(sequences)
    assert ds.num_documents == len(docs)
    assert ds.num_tokens == sum(len(s) for s in sequences)
    for i, expected in enumerate(sequences):
        assert ds[i].dtype == dtype
        numpy.testing.assert_array_equal(ds[i], expected)
    for d, seqs in enumerate(docs):
        got = ds.document(d)
        assert len(got) == len(seqs)
        for a, b in zip(got, seqs, strict=True):
            numpy.testing.assert_array_equal(a, b)
    boundaries = numpy.cumsum([0] + [len(seqs) for seqs in docs])
    numpy.testing.assert_array_equal(ds.document_indices, boundaries)


def test_slices_get_and_negative_indices(tmp_path):
    with IndexedDatasetWriter(tmp_path / "s", numpy.int32) as w:
        for n in range(1, 8):
            w.add_document(numpy.arange(n) + 100 * n)
    ds = IndexedDataset(tmp_path / "s")
    parts = ds[2:5]
    assert [p.tolist() for p in parts] == [ds[i].tolist() for i in range(2, 5)]
    assert ds[-1].tolist() == (numpy.arange(7) + 700).tolist()
    assert ds.get(6, offset=2, length=3).tolist() == [702, 703, 704]
    assert ds.get(6, offset=5).tolist() == [705, 706]
    assert ds[5:5] == []
    with pytest.raises(SequenceIndexError, match="sequence 7 out of range"):
        ds[7]
    with pytest.raises(IndexError):  # the sequence protocol still works
        ds[-8]
    with pytest.raises(StatefulsetError, match="outside sequence 6"):
        ds.get(6, offset=5, length=3)
    with pytest.raises(StatefulsetError, match="step 1"):
        ds[::2]
    assert sum(1 for _ in ds) == 7


def test_arrays_stay_valid_after_dataset_is_gone(tmp_path):
    with IndexedDatasetWriter(tmp_path / "s") as w:
        w.add_document(numpy.arange(1000) % 50000)
        w.add_document(numpy.arange(10))
    ds = IndexedDataset(tmp_path / "s")
    tokens, lengths, documents = ds[0], ds.sequence_lengths, ds.document_indices
    del ds
    gc.collect()
    # megatron-core segfaults here: it closes the mmap under live views.
    assert int(tokens.sum()) == sum(range(1000))
    assert lengths.tolist() == [1000, 10]
    assert documents.tolist() == [0, 1, 2]
    assert not tokens.flags.writeable


def test_pickle_reopens_instead_of_copying(tmp_path):
    with IndexedDatasetWriter(tmp_path / "s") as w:
        w.add_document(numpy.arange(100_000) % 1000)
    ds = IndexedDataset(tmp_path / "s")
    blob = pickle.dumps(ds)
    assert len(blob) < 500
    clone = pickle.loads(blob)
    numpy.testing.assert_array_equal(clone[0], ds[0])


def test_multimodal_modes(tmp_path):
    with IndexedDatasetWriter(tmp_path / "mm", numpy.int32, multimodal=True) as w:
        w.add_document([1, 2, 3, 4], lengths=[1, 3], modes=[0, 1])
        w.add_item([5, 6], mode=2)
        w.add_item([7], mode=3)
        w.end_document()
        w.add_document([8])  # mode defaults to 0
    ds = IndexedDataset(tmp_path / "mm", multimodal=True)
    assert ds.sequence_modes.tolist() == [0, 1, 2, 3, 0]
    tokens, mode = ds[2]
    assert tokens.tolist() == [5, 6] and mode == 2
    assert [(t.tolist(), m) for t, m in ds[0:2]] == [([1], 0), ([2, 3, 4], 1)]
    assert ds.document_indices.tolist() == [0, 2, 4, 5]
    with pytest.raises(StatefulsetError, match="multimodal=True"):
        IndexedDataset(tmp_path / "mm")


def test_empty_dataset(tmp_path):
    with IndexedDatasetWriter(tmp_path / "empty"):
        pass
    ds = IndexedDataset(tmp_path / "empty")
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0


def test_prefix_with_extension_is_refused(tmp_path):
    with pytest.raises(StatefulsetError, match="without extension"):
        IndexedDataset(tmp_path / "x.bin")


def test_missing_files_name_the_file(tmp_path):
    with pytest.raises(StatefulsetError, match=r"nope\.idx: no such file"):
        IndexedDataset(tmp_path / "nope")
    with IndexedDatasetWriter(tmp_path / "half") as w:
        w.add_document([1])
    (tmp_path / "half.bin").unlink()
    with pytest.raises(StatefulsetError, match=r"half\.bin: no such file"):
        IndexedDataset(tmp_path / "half")
