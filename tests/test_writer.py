"""Writer: atomicity, input checks, natural-order streaming merge in flat memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc

import numpy
import pytest

from statefulset import IndexedDataset, IndexedDatasetWriter, StatefulsetError, merge_datasets
from statefulset.shards import idx_format, index_spill
from statefulset.shards.names import find_prefixes, natural_key


def test_exception_inside_with_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetWriter(tmp_path / "s") as w:
        w.add_document([1, 2, 3])
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_rewrite_killed_midway_keeps_the_old_shard(tmp_path):
    prefix = tmp_path / "s"
    with IndexedDatasetWriter(prefix) as w:
        w.add_document([7, 7, 7])
    script = textwrap.dedent(
        f"""
        import sys, numpy
        from statefulset import IndexedDatasetWriter
        w = IndexedDatasetWriter({str(prefix)!r})
        chunk = numpy.arange(4096, dtype=numpy.uint16)
        for i in range(10**9):
            w.add_document(chunk)
            if i == 2000:
                print("writing", flush=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ds = IndexedDataset(prefix)  # the old pair, untouched and consistent
    assert len(ds) == 1 and ds[0].tolist() == [7, 7, 7]
    leftovers = [f for f in os.listdir(tmp_path) if f.endswith(".idx") and f != "s.idx"]
    assert leftovers == []


def test_new_shard_killed_midway_never_opens(tmp_path):
    prefix = tmp_path / "fresh"
    script = textwrap.dedent(
        f"""
        import numpy
        from statefulset import IndexedDatasetWriter
        w = IndexedDatasetWriter({str(prefix)!r})
        w.add_document(numpy.arange(10, dtype=numpy.uint16))
        print("writing", flush=True)
        import time; time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "fresh.idx").exists()
    with pytest.raises(StatefulsetError, match=r"fresh\.idx: no such file"):
        IndexedDataset(prefix)


@pytest.mark.parametrize(
    ("tokens", "kwargs", "message"),
    [
        ([1, 70000], {}, r"s: document 1: token 70000 at position 1 does not fit uint16"),
        ([-1], {}, r"token -1 at position 0 does not fit uint16"),
        ([1.5, 2.0], {}, r"tokens have dtype float64; uint16 needs integers"),
        ([[1, 2]], {}, r"tokens must be 1-D"),
        ([1, 2, 3], {"lengths": [1, 1]}, r"lengths sum to 2 but there are 3 tokens"),
        ([1, 2, 3], {"lengths": [4, -1]}, r"lengths\[1\] = -1 is not in"),
        ([1, 2], {"modes": [1]}, r"modes given, but the writer is not multimodal"),
    ],
)
def test_bad_documents_are_refused(tmp_path, tokens, kwargs, message):
    with IndexedDatasetWriter(tmp_path / "s") as w:
        w.add_document([5])
        with pytest.raises(StatefulsetError, match=message):
            w.add_document(tokens, **kwargs)
    assert [t.tolist() for t in IndexedDataset(tmp_path / "s")] == [[5]]  # the refusal left no trace


def test_bad_batches_and_dtypes(tmp_path):
    with pytest.raises(StatefulsetError, match=r"cannot be stored in a \.bin"):
        IndexedDatasetWriter(tmp_path / "x", numpy.complex64)
    with pytest.raises(StatefulsetError, match="local files only"):
        IndexedDatasetWriter("s3://bucket/x")
    with IndexedDatasetWriter(tmp_path / "s") as w:
        with pytest.raises(StatefulsetError, match="sequences_per_document: lengths sum to 3 but there are 2"):
            w.add_documents([1, 2, 3], [1, 2], sequences_per_document=[1, 2])
        w.add_documents(numpy.array([1, 2, 3], numpy.int64), [1, 2])
    assert [s.tolist() for s in IndexedDataset(tmp_path / "s")] == [[1], [2, 3]]
    with pytest.raises(StatefulsetError, match="already closed"):
        w.add_document([1])


def test_natural_order():
    names = ["part_10", "part_2", "part_1", "part_1b", "a"]
    assert sorted(names, key=natural_key) == ["a", "part_1", "part_1b", "part_2", "part_10"]


def test_merge_in_natural_order_and_dtype_mismatch(tmp_path):
    for i in (10, 2, 1):
        with IndexedDatasetWriter(tmp_path / "parts" / f"part_{i}") as w:
            w.add_document([i, i])
    prefixes = find_prefixes(str(tmp_path / "parts"))
    assert [os.path.basename(p) for p in prefixes] == ["part_1", "part_2", "part_10"]
    merged = merge_datasets(prefixes, tmp_path / "merged")
    assert [s.tolist() for s in merged] == [[1, 1], [2, 2], [10, 10]]
    assert merged.document_indices.tolist() == [0, 1, 2, 3]
    with IndexedDatasetWriter(tmp_path / "wide", numpy.int32) as w:
        w.add_document([1])
    with pytest.raises(StatefulsetError, match=r"wide: dtype int32 differs from uint16"):
        merge_datasets([*prefixes, tmp_path / "wide"], tmp_path / "bad")
    assert not (tmp_path / "bad.idx").exists()
    with pytest.raises(StatefulsetError, match="nothing to merge"):
        merge_datasets([], tmp_path / "none")


def _merge_peak(tmp_path, parts: int, sequences: int) -> int:
    prefixes = []
    for p in range(parts):
        prefix = tmp_path / f"in{parts}_{p}"
        if not IndexedDataset.exists(prefix):
            with IndexedDatasetWriter(prefix, numpy.uint8) as w:
                w.add_documents(numpy.ones(sequences, numpy.uint8), numpy.ones(sequences, numpy.int64))
        prefixes.append(prefix)
    tracemalloc.start()
    merge_datasets(prefixes, tmp_path / f"out{parts}")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(IndexedDataset(tmp_path / f"out{parts}")) == parts * sequences
    return peak


def test_merge_memory_does_not_grow_with_sequences(tmp_path, monkeypatch):
    # Small chunks so that the test corpus spans many of them.
    monkeypatch.setattr(idx_format, "CHUNK", 1 << 14)
    monkeypatch.setattr(index_spill, "COPY_BYTES", 1 << 16)
    small = _merge_peak(tmp_path, parts=2, sequences=100_000)
    large = _merge_peak(tmp_path, parts=8, sequences=100_000)
    # 800k sequences would cost ~20 MB of index arrays if they were held; we stay flat.
    assert large < 1.25 * small + (256 << 10), (small, large)
    assert large < 4 << 20, large


def test_shards_get_ordinary_file_permissions(tmp_path):
    previous = os.umask(0o022)
    try:
        with IndexedDatasetWriter(tmp_path / "s") as w:
            w.add_document([1])
    finally:
        os.umask(previous)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"s.{ext}").stat().st_mode & 0o777 == 0o644


def test_unwritable_places_are_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StatefulsetError, match=r"file/s: cannot write here"):
        IndexedDatasetWriter(tmp_path / "file" / "s")
    (tmp_path / "d.bin").mkdir()
    with pytest.raises(StatefulsetError, match=r"d\.bin: is a folder"):
        IndexedDatasetWriter(tmp_path / "d")
    (tmp_path / "e.idx").mkdir()
    (tmp_path / "e.bin").write_bytes(b"")
    with pytest.raises(StatefulsetError, match=r"e\.idx: not a regular file"):
        IndexedDataset(tmp_path / "e")


@pytest.mark.parametrize("multimodal", [False, True])
def test_index_only_merge_equals_a_full_merge_with_the_bins_concatenated(tmp_path, multimodal):
    """add_index_only (a store concatenates the .bin parts) writes the index add_index writes."""
    rng = numpy.random.default_rng(3)
    parts = []
    for p in range(3):
        prefix = str(tmp_path / f"part{p}")
        with IndexedDatasetWriter(prefix, numpy.uint16, multimodal=multimodal) as w:
            for _ in range(int(rng.integers(0, 6))):
                lengths = rng.integers(0, 9, size=int(rng.integers(1, 4)))
                tokens = rng.integers(0, 65535, size=int(lengths.sum()))
                w.add_document(tokens, lengths=lengths.tolist(), modes=[1] * lengths.size if multimodal else None)
        parts.append(prefix)
    with IndexedDatasetWriter(tmp_path / "full", numpy.uint16, multimodal=multimodal) as full:
        for prefix in parts:
            full.add_index(prefix)
    with IndexedDatasetWriter(tmp_path / "only", numpy.uint16, multimodal=multimodal) as only:
        for prefix in parts:
            only.add_index_only(prefix + ".idx", os.path.getsize(prefix + ".bin"))
    read = lambda path: (tmp_path / path).read_bytes()  # noqa: E731
    assert read("only.idx") == read("full.idx")
    assert read("only.bin") == b""  # the tokens are the caller's to place
    assert read("full.bin") == b"".join(read(p + ".bin") for p in parts)
    with IndexedDatasetWriter(tmp_path / "bad", numpy.uint16, multimodal=multimodal) as bad:
        with pytest.raises(StatefulsetError, match=r"part1\.idx"):
            bad.add_index_only(parts[1] + ".idx", os.path.getsize(parts[1] + ".bin") + 2)
        with pytest.raises(StatefulsetError, match="dtype"):
            with IndexedDatasetWriter(tmp_path / "wide", numpy.int32, multimodal=multimodal) as wide:
                wide.add_document([1], modes=[0] if multimodal else None)
            bad.add_index_only(str(tmp_path / "wide.idx"), 4)
