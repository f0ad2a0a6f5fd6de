"""Errors raised while a stream opens name the spec's YAML file and the key at fault.

A spec is validated when it is read; much can still go wrong later, when ``open_stream`` or
``get_train_dataset`` opens the shards and builds indices. Each case here writes a real corpus and
a real YAML file, and checks the error starts with that file's path and names the key.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import numpy
import pytest
import yaml

from statefulset import IndexedDatasetWriter, StatefulsetError, WorkerConfig, get_train_dataset
from statefulset.spec.model import load_spec
from statefulset.streams.opening import open_stream


@pytest.fixture
def corpus(tmp_path) -> Path:
    """``big``: 40 documents of 30 tokens; ``tiny``: 10 documents of 5 tokens."""
    for name, docs, length in (("big", 40, 30), ("tiny", 10, 5)):
        with IndexedDatasetWriter(tmp_path / "data" / name, numpy.uint16) as writer:
            for d in range(docs):
                writer.add_document(numpy.arange(length, dtype=numpy.uint16) + d)
    return tmp_path


def write_spec(folder: Path, content: dict) -> str:
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(content))
    return str(path)


def damage_index(prefix: Path) -> None:
    idx = Path(f"{prefix}.idx")
    idx.write_bytes(idx.read_bytes()[:20])


def damage_cache(folder: Path) -> None:
    entry = next(p for p in folder.iterdir() if p.name.startswith("GPTDataset-"))
    (entry / "description.json").write_text("{not json")


def get_train(path: str) -> None:
    get_train_dataset(path, batch_size=2, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))


BIG = {"data_path": "data/big", "seq_length": 16}
# (spec, what to do to the files after load_spec, split, key named, words of the message)
CASES = {
    "damaged-idx": (BIG, lambda root: damage_index(root / "data/big"), "train", "data_path", "big.idx"),
    "damaged-idx-per-split": (
        {"seq_length": 16, "train": {"data_path": "data/big"}},
        lambda root: damage_index(root / "data/big"),
        "train",
        "train.data_path",
        "big.idx",
    ),
    "shard-removed-after-load": (
        BIG,
        lambda root: os.remove(root / "data/big.bin"),
        "train",
        "data_path",
        "big.bin",
    ),
    "split-without-share": ({**BIG, "split": "100,0,0"}, None, "valid", "split", "valid split is empty"),
    "no-section": ({"seq_length": 16, "train": {"data_path": "data/big"}}, None, "valid", "valid", "no valid:"),
    "prefix-split-empty": (
        {**BIG, "data_path": "data/tiny", "split": "95,5,0"},
        None,
        "valid",
        "split",
        "tiny: the valid split of split '95,5,0' holds no sequences of its 10",
    ),
    "weighted-without-num-samples": (
        {**BIG, "data_path": {"data/big": 1, "data/tiny": 1}},
        None,
        "train",
        "num_samples",
        "needs num_samples",
    ),
    "native-too-short": (
        {**BIG, "data_path": "data/tiny", "seq_length": 64, "packing": "native"},
        None,
        "train",
        "seq_length",
        "holds 50 tokens, too few",
    ),
    "megatron-no-sample": (
        {**BIG, "data_path": "data/tiny", "seq_length": 64},
        None,
        "train",
        "num_samples",
        "no sample",
    ),
    "megatron-per-split-no-sample": (
        {"seq_length": 64, "train": {"data_path": "data/tiny", "num_samples": None}},
        None,
        "train",
        "num_samples",
        "no sample",
    ),
    "num-samples-beyond-memory": ({**BIG, "num_samples": 2**62}, None, "train", "num_samples", "cannot build"),
    "damaged-cache": (
        {**BIG, "path_to_cache": "cache"},
        lambda root: damage_cache(root / "cache"),
        "train",
        "path_to_cache",
        "cache entry is damaged",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_open_errors_name_the_yaml_file_and_the_key(corpus, case):
    content, damage, split, key, words = CASES[case]
    path = write_spec(corpus, content)
    if case == "damaged-cache":
        open_stream(path)  # build the entry first
    spec = load_spec(path)
    if damage is not None:
        damage(corpus)
    opens = [lambda: open_stream(path, split), lambda: open_stream(spec, split)]
    if split == "train":
        opens.append(lambda: get_train(path))
    for open_it in opens:
        with pytest.raises(StatefulsetError) as caught:
            open_it()
        message = str(caught.value)
        assert message.startswith(f"{path}: key '{key}': "), message
        assert words in message, message
        assert message.count(path) == 1, message  # named once, not once per layer


def test_a_mapping_is_named_as_such(corpus):
    spec = {"data_path": str(corpus / "data/big"), "seq_length": 16, "split": "100,0,0"}
    with pytest.raises(StatefulsetError, match=r"^spec \(dict\): key 'split': the valid split is empty"):
        open_stream(spec, "valid")
    assert load_spec(spec).source == "spec (dict)"


def test_the_source_survives_copies_and_pickles_and_is_no_part_of_the_value(corpus):
    import pickle

    path = write_spec(corpus, BIG)
    spec = load_spec(path)
    assert spec.source == path
    assert spec.model_copy(update={"seed": 5}).source == path
    assert pickle.loads(pickle.dumps(spec)).source == path
    same = load_spec({**BIG, "data_path": str(corpus / "data/big")})
    assert same == spec and same.source != spec.source
    # The stream's identity (what a checkpoint is matched against) does not depend on where the spec lives.
    assert open_stream(spec).identity == open_stream(same).identity


def test_strict_types_in_a_file(corpus):
    """What pydantic would coerce is refused like a string weight is, naming file, key and value."""
    for key, value, expected in [
        ("seq_length", "512", "must be an integer, got '512' (str)"),
        ("seq_length", 512.0, "must be an integer, got 512.0 (float)"),
        ("seq_length", True, "must be an integer, got True (bool)"),
        ("seed", "1234", "must be an integer, got '1234' (str)"),
        ("seed", False, "must be an integer, got False (bool)"),
        ("num_samples", "100", "must be an integer, got '100' (str)"),
        ("path_to_cache", 7, "must be a string, got 7 (int)"),
    ]:
        path = write_spec(corpus, {**BIG, key: value})
        with pytest.raises(StatefulsetError, match="^" + re.escape(f"{path}: key '{key}': {expected}")):
            load_spec(path)
    section = write_spec(corpus, {"seq_length": 16, "train": {"data_path": "data/big", "num_samples": "9"}})
    expected = f"{section}: key 'train.num_samples': must be an integer, got '9'"
    with pytest.raises(StatefulsetError, match="^" + re.escape(expected)):
        load_spec(section)
    # What must be accepted still is: split as a string, a list or a YAML number; a YAML int seed.
    for split in ("90,10,0", [90, 10, 0], 100):
        assert load_spec(write_spec(corpus, {**BIG, "split": split, "seed": 7})).seed == 7


def test_seed_range_of_megatron_packing(corpus):
    for seed in (-1, 2**32):
        path = write_spec(corpus, {**BIG, "seed": seed})
        with pytest.raises(StatefulsetError) as caught:
            load_spec(path)
        message = str(caught.value)
        assert message.startswith(f"{path}: key 'seed': ") and f"0 to 2**32-1; got {seed}" in message
    assert load_spec(write_spec(corpus, {**BIG, "seed": 2**32 - 1})).seed == 2**32 - 1


def test_seq_length_beyond_int32_is_refused_at_load(corpus):
    path = write_spec(corpus, {**BIG, "seq_length": 2**40})
    with pytest.raises(StatefulsetError, match="^" + re.escape(f"{path}: key 'seq_length': must be at least 2 and at")):
        load_spec(path)


def test_a_sample_longer_than_the_split_warns_once(corpus, caplog):
    """megatron-core allows it (the sample wraps into the next epoch's documents); we keep it and warn."""
    logging.disable(logging.NOTSET)  # megatron-core oracles elsewhere in the session turn warnings off
    path = write_spec(corpus, {**BIG, "data_path": "data/tiny", "seq_length": 64, "num_samples": 6})
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        stream = open_stream(path)
        open_stream(path)  # a second open in the same process says nothing new
    warnings = [r.getMessage() for r in caplog.records if r.name == "statefulset" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    prefix = str(corpus / "data" / "tiny")
    assert f"{prefix}: the train split holds 50 tokens, fewer than one sample of seq_length 64 + 1" in warnings[0]
    # Each sample holds 65 tokens of a 50-token split: some document appears twice in one sample.
    row = stream[0]["text"]
    assert row.shape == (65,) and len(numpy.unique(row)) < row.size
