"""Byte compatibility with megatron-core (0.19.2 in CI; its sample order equals 0.16.1's), used only as an oracle."""

from __future__ import annotations

import filecmp

import numpy
import oracle
import pytest
from conftest import ALL_DTYPES, random_documents, write_documents

from statefulset import IndexedDataset, IndexedDatasetWriter, merge_datasets

mcore = oracle.module("megatron.core.datasets.indexed_dataset")


def megatron_write(prefix, docs, dtype, multimodal=False, modes=None):
    builder = mcore.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype.type, multimodal=multimodal)
    for d, seqs in enumerate(docs):
        tokens = numpy.concatenate(seqs) if seqs else numpy.array([], dtype)
        kwargs = {"modes": modes[d]} if multimodal else {}
        builder.add_document(tokens, [len(s) for s in seqs], **kwargs)
    builder.finalize(f"{prefix}.idx")


def same_files(a, b):
    return filecmp.cmp(f"{a}.bin", f"{b}.bin", shallow=False) and filecmp.cmp(f"{a}.idx", f"{b}.idx", shallow=False)


@pytest.mark.oracle
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_writer_is_byte_identical_to_megatron_builder(tmp_path, rng, dtype):
    docs = random_documents(rng, dtype, n=80)
    docs.insert(3, [])  # a document with no sequences, as preprocess_data.py writes for empty text
    megatron_write(tmp_path / "theirs", docs, dtype)
    write_documents(tmp_path / "ours", docs, dtype)
    assert same_files(tmp_path / "ours", tmp_path / "theirs")


@pytest.mark.oracle
def test_batched_and_item_apis_are_byte_identical(tmp_path, rng):
    dtype = numpy.dtype(numpy.uint16)
    docs = random_documents(rng, dtype, n=200)
    megatron_write(tmp_path / "theirs", docs, dtype)
    seqs = [s for d in docs for s in d]
    with IndexedDatasetWriter(tmp_path / "batched", dtype) as w:
        half = len(docs) // 2
        for part in (docs[:half], docs[half:]):
            flat = [s for d in part for s in d]
            w.add_documents(
                numpy.concatenate(flat),
                [len(s) for s in flat],
                sequences_per_document=[len(d) for d in part],
            )
    assert same_files(tmp_path / "batched", tmp_path / "theirs")
    with IndexedDatasetWriter(tmp_path / "items", dtype) as w:
        for d in docs:
            for s in d:
                w.add_item(s)
            w.end_document()
    assert same_files(tmp_path / "items", tmp_path / "theirs")
    assert len(seqs) == len(IndexedDataset(tmp_path / "items"))


@pytest.mark.oracle
def test_multimodal_byte_identical(tmp_path, rng):
    dtype = numpy.dtype(numpy.int32)
    docs = random_documents(rng, dtype, n=30)
    modes = [[int(rng.integers(0, 5)) for _ in d] for d in docs]
    megatron_write(tmp_path / "theirs", docs, dtype, multimodal=True, modes=modes)
    with IndexedDatasetWriter(tmp_path / "ours", dtype, multimodal=True) as w:
        for d, m in zip(docs, modes, strict=True):
            w.add_document(numpy.concatenate(d), [len(s) for s in d], modes=m)
    assert same_files(tmp_path / "ours", tmp_path / "theirs")


@pytest.mark.oracle
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_we_read_megatron_files_and_megatron_reads_ours(tmp_path, rng, dtype):
    docs = random_documents(rng, dtype)
    megatron_write(tmp_path / "theirs", docs, dtype)
    write_documents(tmp_path / "ours", docs, dtype)
    ours_on_theirs = IndexedDataset(tmp_path / "theirs")
    theirs_on_ours = mcore.IndexedDataset(str(tmp_path / "ours"))
    assert len(ours_on_theirs) == len(theirs_on_ours)
    numpy.testing.assert_array_equal(ours_on_theirs.sequence_lengths, theirs_on_ours.sequence_lengths)
    numpy.testing.assert_array_equal(ours_on_theirs.document_indices, theirs_on_ours.document_indices)
    for i in range(len(ours_on_theirs)):
        numpy.testing.assert_array_equal(ours_on_theirs[i], theirs_on_ours[i])
        assert ours_on_theirs[i].dtype == theirs_on_ours[i].dtype


@pytest.mark.oracle
def test_merge_is_byte_identical_to_add_index(tmp_path, rng):
    dtype = numpy.dtype(numpy.uint16)
    prefixes = []
    for part in range(4):
        prefix = tmp_path / f"part_{part}"
        write_documents(prefix, random_documents(rng, dtype, n=20 + part), dtype)
        prefixes.append(str(prefix))
    builder = mcore.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=numpy.uint16)
    for prefix in prefixes:
        builder.add_index(prefix)
    builder.finalize(str(tmp_path / "theirs.idx"))
    merge_datasets(prefixes, tmp_path / "ours")
    assert same_files(tmp_path / "ours", tmp_path / "theirs")
