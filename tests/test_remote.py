"""Shards behind fsspec URLs: ranged reads from memory://, mmap for file://."""

from __future__ import annotations

import pickle

import fsspec
import numpy
import pytest
from conftest import random_documents, write_documents

from statefulset import IndexedDataset, StatefulsetError


@pytest.fixture
def memory_shard(tmp_path, rng):
    dtype = numpy.dtype(numpy.int32)
    docs = random_documents(rng, dtype, n=40)
    write_documents(tmp_path / "s", docs, dtype)
    fs = fsspec.filesystem("memory")
    for ext in (".bin", ".idx"):
        fs.pipe(f"/corpus/s{ext}", (tmp_path / f"s{ext}").read_bytes())
    yield tmp_path / "s", "memory://corpus/s"
    fs.rm("/corpus", recursive=True)


def test_memory_filesystem_reads_match_local(memory_shard):
    local, url = memory_shard
    remote = IndexedDataset(url)
    ds = IndexedDataset(local)
    assert len(remote) == len(ds) and remote.dtype == ds.dtype
    numpy.testing.assert_array_equal(remote.document_indices, ds.document_indices)
    for i in range(len(ds)):
        numpy.testing.assert_array_equal(remote[i], ds[i])
    assert [p.tolist() for p in remote[3:9]] == [p.tolist() for p in ds[3:9]]
    numpy.testing.assert_array_equal(remote.get(5, 1, 2), ds.get(5, 1, 2))
    clone = pickle.loads(pickle.dumps(remote))
    numpy.testing.assert_array_equal(clone[7], ds[7])


def test_remote_reads_are_ranged(memory_shard):
    _, url = memory_shard
    remote = IndexedDataset(url)
    fs = fsspec.filesystem("memory")
    calls = []
    original = fs.cat_file

    def spy(path, start=None, end=None, **kw):
        calls.append((start, end))
        return original(path, start=start, end=end, **kw)

    fs.cat_file = spy
    try:
        remote[10]
    finally:
        del fs.cat_file
    start, end = calls[-1]
    assert end - start == int(remote.sequence_lengths[10]) * 4


def test_file_url_is_memory_mapped(tmp_path, rng):
    dtype = numpy.dtype(numpy.uint16)
    write_documents(tmp_path / "s", random_documents(rng, dtype, n=5), dtype)
    ds = IndexedDataset(f"file://{tmp_path}/s")
    assert ds._bin_file.is_local
    numpy.testing.assert_array_equal(ds[0], IndexedDataset(tmp_path / "s")[0])


def test_remote_errors_name_the_url(memory_shard):
    _, url = memory_shard
    fs = fsspec.filesystem("memory")
    fs.pipe("/corpus/s.bin", b"\x00" * 3)
    with pytest.raises(StatefulsetError, match=r"memory://corpus/s\.bin: file is 3 bytes"):
        IndexedDataset(url)
    with pytest.raises(StatefulsetError, match=r"memory://corpus/missing\.bin: no such object"):
        IndexedDataset("memory://corpus/missing")
    with pytest.raises(StatefulsetError, match=r"nosuchproto://x/y\.bin: cannot open this URL.*Protocol not known"):
        IndexedDataset("nosuchproto://x/y")
