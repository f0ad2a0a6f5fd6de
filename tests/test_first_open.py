"""The first open of a shard version: its .idx hashed in a thread while the open goes on (issue 26).

Whatever overlaps, the identities, cache entries and index arrays are those of an open that does
one thing after the other, and nothing is looked up or written under a digest before it is known.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time

import numpy
import pytest

from statefulset import IndexedDataset, IndexedDatasetWriter, StatefulsetError
from statefulset.index import cache as cache_module
from statefulset.index.megatron.gpt import build_gpt_indices
from statefulset.shards import facts
from statefulset.shards.digests import identify
from statefulset.shards.identifying import Identifications
from statefulset.streams.opening import open_stream


def write_shard(prefix: str, seed: int, docs: int = 3000) -> str:
    rng = numpy.random.default_rng(seed)
    lengths = rng.geometric(1 / 60, size=docs)
    with IndexedDatasetWriter(prefix, numpy.uint16) as w:
        w.add_documents(rng.integers(0, 60000, int(lengths.sum())), lengths)
    past = time.time() - 60  # settled: the facts remember what is computed about it
    for ext in (".idx", ".bin"):
        os.utime(prefix + ext, (past, past))
    return prefix


def digest_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "statefulset-digest"]


def test_identities_hashed_in_threads_are_those_hashed_in_turn(tmp_path):
    """More shards than hashing threads: each digest is the one identify() computes alone, in order."""
    prefixes = [write_shard(str(tmp_path / f"s{k}"), k, docs=500 + 100 * k) for k in range(7)]
    datasets = [IndexedDataset(p) for p in prefixes]
    memo = str(tmp_path / "memo")
    with Identifications(memo) as identifying:
        for dataset in datasets:
            identifying.start(dataset)
        assert identifying.hashing
        found = identifying.results()
    assert not digest_threads()
    alone = [identify(d, str(tmp_path / "other-memo")) for d in datasets]
    assert found == alone
    assert len({d.content for d in found}) == len(prefixes)
    # Remembered for these versions: the next open hashes nothing.
    with Identifications(memo) as identifying:
        for dataset in datasets:
            identifying.start(dataset)
        assert not identifying.hashing
        assert identifying.results() == alone


def test_a_failed_hash_is_raised_by_results(tmp_path):
    prefix = write_shard(str(tmp_path / "s"), 1)
    dataset = IndexedDataset(prefix)  # the .idx stays mapped
    os.unlink(prefix + ".idx")
    with Identifications(str(tmp_path / "memo")) as identifying:
        identifying.start(dataset)
        with pytest.raises(StatefulsetError, match=r"s\.idx: cannot read to identify the shard"):
            identifying.results()
    assert not digest_threads()


def test_leaving_while_a_hash_is_under_way_warns_naming_the_idx_and_the_bound(tmp_path, monkeypatch, caplog):
    """Leaving the block waits STATEFULSET_CACHE_WAIT for the hashes under way; one still running
    then is left to its (daemon) thread with a WARNING naming the .idx and the bound. The hash is
    held by a real read: the .idx is a FIFO whose writer sends nothing until the block is left."""
    prefix = write_shard(str(tmp_path / "s"), 1)
    dataset = IndexedDataset(prefix)  # the .idx stays mapped
    os.unlink(prefix + ".idx")
    os.mkfifo(prefix + ".idx")
    monkeypatch.setenv("STATEFULSET_CACHE_WAIT", "0.25")
    writer = None
    try:
        with caplog.at_level(logging.WARNING, logger="statefulset"), Identifications(str(tmp_path / "memo")) as ids:
            ids.start(dataset)
            writer = _writer_once_read(prefix + ".idx")  # the thread now waits in a read
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert warned == [
            f"statefulset: {prefix}.idx: still being hashed after 0.25 s (STATEFULSET_CACHE_WAIT) when its "
            "open ended; left to its thread, which ends when the hash does"
        ]
        assert digest_threads()  # held by the read, as the warning says
    finally:
        if writer is not None:
            os.close(writer)  # end of file: the hash ends
    for thread in digest_threads():
        thread.join(30)
    assert not digest_threads()


def _writer_once_read(fifo: str) -> int:
    """A writer of ``fifo``, opened once a reader has opened it (before: ENXIO), within 30 s."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                raise AssertionError(f"{fifo}: the hashing thread did not open it for reading in 30 s") from exc
            time.sleep(0.01)


def megatron_spec(prefix: str, cache: str, num_samples: int | None = None) -> dict:
    return {"data_path": prefix, "seq_length": 64, "split": "1", "packing": "megatron", "seed": 7,
            "num_samples": num_samples, "path_to_cache": cache}  # fmt: skip


def arrays_of(stream) -> dict[str, numpy.ndarray]:
    source = stream.sources[0]
    return {n: numpy.asarray(getattr(source, n)) for n in ("document_index", "sample_index", "shuffle_index")}


def expected_arrays(prefix: str, num_samples: int | None) -> dict[str, numpy.ndarray]:
    dataset = IndexedDataset(prefix)
    ids = numpy.arange(len(dataset), dtype=numpy.int32)
    built = build_gpt_indices(dataset.sequence_lengths, ids, 64, 7, num_samples)
    return {"document_index": built.document_index, "sample_index": built.sample_index,
            "shuffle_index": built.shuffle_index}  # fmt: skip


@pytest.mark.parametrize("num_samples", [None, 20_000], ids=["one epoch (built ahead)", "several epochs"])
def test_first_open_builds_the_same_indices_and_stores_them(tmp_path, num_samples):
    prefix = write_shard(str(tmp_path / "s"), 3)
    cache = str(tmp_path / "cache")
    before = dict(cache_module.builds)
    first = open_stream(megatron_spec(prefix, cache, num_samples))
    assert cache_module.builds.get("GPTDataset", 0) == before.get("GPTDataset", 0) + 1
    expected = expected_arrays(prefix, num_samples)
    for name, array in arrays_of(first).items():
        numpy.testing.assert_array_equal(array, expected[name])
        assert array.dtype == expected[name].dtype
    assert not digest_threads()
    # The entry it stored, under the shard's full digest, is what the next open loads.
    again = open_stream(megatron_spec(prefix, cache, num_samples))
    assert cache_module.builds.get("GPTDataset", 0) == before.get("GPTDataset", 0) + 1
    assert again.identity == first.identity
    for name, array in arrays_of(again).items():
        numpy.testing.assert_array_equal(array, expected[name])


def test_a_version_new_to_the_facts_still_loads_the_entry_the_cache_holds(tmp_path):
    """The .idx is hashed again (no facts) and the one-epoch indices are built meanwhile; the entry the
    cache already holds for that content is what the stream uses, and nothing new is stored."""
    prefix = write_shard(str(tmp_path / "s"), 4)
    cache = str(tmp_path / "cache")
    first = open_stream(megatron_spec(prefix, cache))
    shutil.rmtree(os.path.join(cache, "facts"))
    facts._in_process.clear()
    entries = sorted(n for n in os.listdir(cache) if n != "facts")
    before = dict(cache_module.builds)
    computed = facts.computed.get("digest", 0)
    again = open_stream(megatron_spec(prefix, cache))
    assert facts.computed.get("digest", 0) == computed + 1  # hashed again
    assert cache_module.builds == before  # loaded, not built
    assert sorted(n for n in os.listdir(cache) if n != "facts") == entries
    assert again.identity == first.identity
    for name, array in arrays_of(again).items():
        numpy.testing.assert_array_equal(array, arrays_of(first)[name])
        assert isinstance(array.base, numpy.memmap) or isinstance(getattr(array.base, "base", None), numpy.memmap)


@pytest.mark.parametrize("num_samples", [None, 4_200, 5_500, 20_000])
@pytest.mark.parametrize("sequences", [(0, 3000), (250, 2900)])
def test_a_split_given_as_a_range_builds_what_its_ids_build(tmp_path, num_samples, sequences):
    """The open hands build_gpt_indices its split as a range (no id array to copy or scan): the same
    three arrays, dtypes included, as the explicit ids, one epoch or several, separate last epoch or not."""
    dataset = IndexedDataset(write_shard(str(tmp_path / "s"), 5))
    lengths = dataset.sequence_lengths
    by_range = build_gpt_indices(lengths, range(*sequences), 64, 7, num_samples)
    by_ids = build_gpt_indices(lengths, numpy.arange(*sequences, dtype=numpy.int32), 64, 7, num_samples)
    for name in ("document_index", "sample_index", "shuffle_index"):
        mine, expected = getattr(by_range, name), getattr(by_ids, name)
        assert mine.dtype == expected.dtype
        numpy.testing.assert_array_equal(mine, expected)


def test_an_index_replaced_after_it_was_mapped_is_refused_not_identified_as_the_new_file(tmp_path):
    """The .idx is hashed by path: a file renamed over it after the dataset mapped the old one would
    give the old tokens the new file's identity. identify() refuses it, naming the file, and a fresh
    open of the new version is identified as the new version."""
    prefix = write_shard(str(tmp_path / "s"), 1)
    other = write_shard(str(tmp_path / "other"), 2, docs=2500)
    dataset = IndexedDataset(prefix)  # the old version mapped
    for ext in (".idx", ".bin"):
        os.replace(other + ext, prefix + ext)
    memo = str(tmp_path / "memo")
    with pytest.raises(StatefulsetError, match=r"s\.idx: changed since it was opened"):
        identify(dataset, memo)
    with pytest.raises(StatefulsetError, match=r"s\.idx: changed since it was opened"), Identifications(memo) as ids:
        ids.start(dataset)
        ids.results()
    fresh = identify(IndexedDataset(prefix), str(tmp_path / "memo2"))
    assert fresh.content != identify(IndexedDataset(write_shard(str(tmp_path / "again"), 1)), memo).content
