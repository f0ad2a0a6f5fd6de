"""A shard's identity covers its .bin as well as its .idx (CONTRACT §14).

Fixed-length, pre-chunked corpora have byte-identical .idx files whatever their tokens: the
shards below all hold the same sequence lengths, so only their .bin files tell them apart.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time

import numpy
import pytest

from statefulset import IndexedDatasetWriter, StatefulsetError, WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.index import cache as cache_module
from statefulset.loading.state import check_state
from statefulset.shards import facts
from statefulset.shards.digests import SAMPLE_BLOCK, SAMPLE_BLOCKS, sample_ranges, shard_checks
from statefulset.streams.opening import open_stream
from statefulset.tools.prepare import prepare

LENGTHS = [64] * 300  # pre-chunked: every sequence the same length


def write(prefix: str, seed: int) -> str:
    rng = numpy.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, numpy.uint16) as w:
        for n in LENGTHS:
            w.add_document(rng.integers(0, 60000, n))
    return prefix


def settle(*prefixes: str) -> None:
    past = time.time() - 60
    for prefix in prefixes:
        for ext in (".idx", ".bin"):
            os.utime(prefix + ext, (past, past))


@pytest.fixture
def twins(tmp_path):
    a, b = write(str(tmp_path / "a"), 1), write(str(tmp_path / "b"), 2)
    with open(a + ".idx", "rb") as fa, open(b + ".idx", "rb") as fb:
        assert fa.read() == fb.read()  # the case the .idx alone cannot tell apart
    return tmp_path, a, b


def spec(prefixes, cache, packing="native", **extra):
    return {
        "data_path": list(prefixes), "seq_length": 32, "split": "1", "packing": packing, "seed": 3,
        "path_to_cache": str(cache), **({"num_samples": 500} if packing == "megatron" else {}), **extra,
    }  # fmt: skip


def test_identical_idx_files_with_other_tokens_are_other_data(twins):
    tmp_path, a, b = twins
    for packing in ("native", "megatron"):  # native: a plain data_path is the one-stage schedule
        first, second = (open_stream(spec([p], tmp_path / "c", packing)) for p in (a, b))
        decides = "stages" if packing == "native" else "data"
        assert first.identity[decides] != second.identity[decides]
        assert first.fingerprint != second.fingerprint


def test_identical_idx_files_with_other_tokens_get_their_own_cache_entries(twins):
    tmp_path, a, b = twins
    cache = tmp_path / "cache"
    rows = open_stream(spec([a], cache, "megatron")).gather(numpy.arange(50))
    before = dict(cache_module.builds)
    other = open_stream(spec([b], cache, "megatron"))
    assert cache_module.builds.get("GPTDataset", 0) == before.get("GPTDataset", 0) + 1  # not a's entry reused
    assert not numpy.array_equal(rows, other.gather(numpy.arange(50)))


def test_identical_idx_files_get_their_own_stage_keys(twins):
    tmp_path, a, b = twins
    stages = [{"start": 0, "data_path": {a: 0.5, b: 0.5}}]
    body = spec([a], tmp_path / "c")
    del body["data_path"]
    stream = open_stream({**body, "stages": stages})
    keys = [source.key for source in stream.sources]
    assert keys[0] != keys[1]  # same keys would deal both sources in the same order


def _loader(body):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    return get_savable_loader(get_train_dataset(body, batch_size=4, worker_config=wc))


@pytest.mark.parametrize("staged", [False, True])
def test_a_state_restored_onto_a_retokenised_bin_names_the_shard(twins, staged):
    tmp_path, a, b = twins
    body = spec([a, b], tmp_path / "c")
    if staged:
        del body["data_path"]
        body["stages"] = [{"start": 0, "data_path": {a: 0.5, b: 0.5}}]
    loader = _loader(body)
    for _, _batch in zip(range(3), loader, strict=False):
        pass
    state = loader.save_state_rank()
    write(b, 7)  # re-tokenised: the same lengths, so the same .idx bytes, other tokens
    with pytest.raises(StatefulsetError, match=rf"{b}\.bin hold\(s\) other tokens") as caught:
        _loader(body).restore_state_rank(state)
    assert f"{a}.bin" not in str(caught.value)


def test_restore_state_global_names_the_shard(twins):
    tmp_path, a, b = twins
    body = spec([a, b], tmp_path / "c")
    loader = _loader(body)
    next(iter(loader))  # a state at position 0 fits any data (nothing was read: a schedule compares the past)
    state = loader.save_state_rank()
    write(a, 9)
    with pytest.raises(StatefulsetError, match=rf"global state, entry 0: .*{a}\.bin hold\(s\) other tokens"):
        _loader(body).restore_state_global([state])


def test_a_state_of_statefulset_0_1_0_restores_when_its_idx_digests_match(twins, caplog):
    tmp_path, a, b = twins
    body = spec([a, b], tmp_path / "c")
    loader = _loader(body)
    for _, _batch in zip(range(2), loader, strict=False):
        pass
    state = loader.save_state_rank()
    old = {**state, "version": 1, "identity": {k: v for k, v in state["identity"].items() if k != "shards"}}
    old["identity"]["data"] = loader.dataset.stream.legacy_data  # what 0.1.0 wrote: .idx digests only
    fresh = _loader(body)
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        fresh.restore_state_rank(old)
    assert fresh.batches_taken == 2 and "statefulset 0.1.0" in caplog.text
    old["identity"]["data"] = "0" * 24
    with pytest.raises(StatefulsetError, match=r"data: the shards, their split ranges or weights differ\)"):
        _loader(body).restore_state_rank(old)


def test_prepare_records_the_full_bin_digest_and_an_open_checks_it(twins):
    tmp_path, a, b = twins
    settle(a, b)
    body = spec([a, b], tmp_path / "c")
    path = tmp_path / "spec.yaml"
    import yaml

    path.write_text(yaml.safe_dump(body))
    report = prepare(str(path), show_progress=False)
    assert report.bins_hashed == 2 and ".bin hashed in full" in report.text()
    memo = str(tmp_path / "c" / "facts")
    with open(b + ".bin", "rb") as f:
        full = hashlib.blake2b(f.read(), digest_size=16).hexdigest()
    assert facts.recall("bin-digest", b + ".bin", directory=memo)["blake2b"] == full
    assert prepare(str(path), show_progress=False).bins_hashed == 0  # once per file version
    open_stream(body)
    # Rewritten in place under the same size, inode and mtime (rsync --inplace --times): the
    # version token is unchanged, the sample read at the open is not.
    st = os.stat(b + ".bin")
    with open(b + ".bin", "r+b") as f:
        f.write(os.urandom(st.st_size))
    os.utime(b + ".bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert facts.file_token(b + ".bin")[1] == f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
    facts._in_process.clear()
    with pytest.raises(StatefulsetError, match=rf"{b}\.bin: its content differs from what `statefulset prepare`"):
        open_stream(body)


def test_the_sample_is_keyed_by_size_and_bounded():
    offsets, sizes = sample_ranges(100 * 2**30)
    assert len(offsets) <= SAMPLE_BLOCKS + 2 and sum(sizes) <= (SAMPLE_BLOCKS + 2) * SAMPLE_BLOCK
    assert offsets[0] == 0 and offsets[-1] + sizes[-1] == 100 * 2**30
    assert sample_ranges(100 * 2**30) == (offsets, sizes)  # a pure function of the size
    assert sample_ranges(100 * 2**30 + 2)[0] != offsets
    small = sample_ranges(10 * SAMPLE_BLOCK + 5)
    assert sum(small[1]) == 10 * SAMPLE_BLOCK + 5  # a small .bin is read whole


def test_state_checks_stay_small_and_are_validated(twins):
    assert shard_checks(["ab" * 8] * 300, ["cd" * 8] * 300) == ""  # too many sources to name: left out
    assert len(shard_checks(["ab" * 8] * 256, ["cd" * 8] * 256)) == 512
    tmp_path, a, b = twins
    state = _loader(spec([a, b], tmp_path / "c")).save_state_rank()
    assert len(state["identity"]["shards"]) == 16
    state["identity"]["shards"] = "0" * 1025
    with pytest.raises(StatefulsetError, match=r"identity.shards' holds over 1024"):
        check_state(state)
    with pytest.raises(StatefulsetError, match=r"identity.shards' is unknown in a state of version 1"):
        check_state({**state, "version": 1})
    del state["identity"]["shards"]
    with pytest.raises(StatefulsetError, match=r"identity.shards' is missing in a state of version 2"):
        check_state(state)
