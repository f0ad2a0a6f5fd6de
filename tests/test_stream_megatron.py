"""packing: megatron against megatron-core (0.19.2 in CI) as the oracle: whole streams, token for token.

Random configurations: seeds, sequence lengths, splits, one to many epochs (with and without a
separate final epoch), blends of 1 to 5 prefixes weighted or by size, per-split blends, and
num_samples left unset.
"""

from __future__ import annotations

import logging
import random

import numpy
import oracle
import pytest

from statefulset import IndexedDatasetWriter, StatefulsetError
from statefulset.spec.splits import SPLITS
from statefulset.streams.opening import open_stream

builder_module = oracle.module("megatron.core.datasets.blended_megatron_dataset_builder")
gpt_module = oracle.module("megatron.core.datasets.gpt_dataset")
blended_module = oracle.module("megatron.core.datasets.blended_dataset")

PREFIXES = 5
pytestmark = pytest.mark.usefixtures("single_process_group")  # conftest: megatron-core's BlendedDataset needs it


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Five shards with different length profiles, empty sequences and multi-sequence documents."""
    root = tmp_path_factory.mktemp("corpus")
    rng = numpy.random.default_rng(0)
    prefixes = []
    for k in range(PREFIXES):
        prefix = str(root / f"part_{k}")
        mean = [20, 60, 150, 400, 35][k]
        with IndexedDatasetWriter(prefix, numpy.uint16 if k % 2 == 0 else numpy.int32) as w:
            for _ in range(900 - 100 * k):
                lengths = [int(rng.geometric(1 / mean)) if rng.random() > 0.03 else 0 for _ in range(1 + (k == 4))]
                w.add_document(rng.integers(0, 50000, sum(lengths)), lengths=lengths)
        prefixes.append(prefix)
    return prefixes


def megatron_build(prefixes, weights, seed, seq_length, split, sizes, per_split=None):
    logging.disable(logging.WARNING)
    common = dict(
        random_seed=seed, sequence_length=seq_length, tokenizer=oracle.null_tokenizer(50256), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, path_to_cache=None, create_attention_mask=False,
    )  # fmt: skip
    if per_split is not None:
        config = gpt_module.GPTDatasetConfig(blend_per_split=per_split, split=None, **common)
    else:
        config = gpt_module.GPTDatasetConfig(blend=(prefixes, weights), split=split, **common)
    return builder_module.BlendedMegatronDatasetBuilder(gpt_module.GPTDataset, sizes, lambda: True, config).build()


def megatron_stream(dataset) -> numpy.ndarray:
    if isinstance(dataset, blended_module.BlendedDataset):
        rows = [
            dataset.datasets[d]._query_document_sample_shuffle_indices(int(s))[0]
            for d, s in zip(dataset.dataset_index, dataset.dataset_sample_index, strict=True)
        ]
    else:
        rows = [dataset._query_document_sample_shuffle_indices(i)[0] for i in range(len(dataset))]
    return numpy.stack(rows).astype(numpy.int64)


def assert_same_stream(spec, split, theirs):
    ours = open_stream(spec, split)
    assert len(ours) == len(theirs)
    expected = megatron_stream(theirs)
    got = ours.gather(numpy.arange(len(ours)))
    numpy.testing.assert_array_equal(got, expected)
    # Random access gives the same rows as the whole-stream gather, one at a time or shuffled.
    picks = numpy.random.default_rng(1).integers(0, len(ours), 17)
    numpy.testing.assert_array_equal(ours.gather(picks), expected[picks])
    numpy.testing.assert_array_equal(ours[int(picks[0])]["text"], expected[picks[0]])


def random_config(case: int, corpus):
    r = random.Random(case)
    count = r.choice([1, 1, 2, 3, 4, 5])
    prefixes = r.sample(corpus, count)
    weighted = count > 1 and r.random() < 0.7
    weights = [round(r.uniform(0.05, 3), 3) for _ in prefixes] if weighted else None
    seq_length = r.choice([8, 31, 64, 100, 257])
    ratios = [r.randint(50, 100), r.choice([0, r.randint(5, 20)]), r.choice([0, r.randint(4, 10)])]
    split = ",".join(map(str, ratios))
    seed = r.randint(0, 2**31 - 1)
    epochs = r.choice([None, 0.5, 1.3, 1.95, 3.5, 7.2])
    num_samples = None
    if epochs is not None or weighted:
        approx_tokens = 60_000 * count * 0.8
        num_samples = max(1, int((epochs or 1) * approx_tokens / seq_length))
    return prefixes, weights, seq_length, split, seed, num_samples


@pytest.mark.oracle
@pytest.mark.parametrize("case", range(40))
def test_random_configs_match_megatron(corpus, case):
    prefixes, weights, seq_length, split, seed, num_samples = random_config(case, corpus)
    if weights is None:
        data_path = prefixes[0] if len(prefixes) == 1 else list(prefixes)
    else:
        data_path = [x for pair in zip(weights, prefixes, strict=True) for x in pair]
    spec = {"data_path": data_path, "seq_length": seq_length, "split": split, "seed": seed, "num_samples": num_samples}
    blend_weights = None if weights is None else weights
    # Megatron needs a size for weighted valid/test blends: compare train from one build ...
    theirs = megatron_build(prefixes, blend_weights, seed, seq_length, split, [num_samples, 1, 1])
    assert_same_stream(spec, "train", theirs[0])
    # ... and valid/test (one epoch of each part, blended by size) from an unweighted build.
    if weights is not None or len(prefixes) > 1:
        theirs = megatron_build(prefixes, None, seed, seq_length, split, [num_samples, None, None])
    for index, name in enumerate(SPLITS[1:], start=1):
        if theirs[index] is None:
            with pytest.raises(StatefulsetError, match=f"the {name} split"):
                open_stream(spec, name)
        else:
            assert_same_stream(spec, name, theirs[index])


@pytest.mark.oracle
@pytest.mark.parametrize("case", range(6))
def test_per_split_blends_match_megatron(corpus, case):
    r = random.Random(1000 + case)
    seq_length, seed = r.choice([16, 50, 128]), r.randint(0, 10_000)
    train = r.sample(corpus, r.randint(1, 4))
    valid = r.sample(corpus, r.randint(1, 3))
    train_weights = [round(r.uniform(0.1, 2), 2) for _ in train]
    num_samples = r.choice([500, 3000, 9000])
    valid_samples = r.choice([None, 200]) if len(valid) > 1 else None
    valid_weights = [1.0] * len(valid) if valid_samples else None
    spec = {
        "seq_length": seq_length,
        "seed": seed,
        "num_samples": num_samples,
        "train": {"data_path": dict(zip(train, train_weights, strict=True))},
        "valid": {
            "data_path": dict(zip(valid, valid_weights, strict=True)) if valid_weights else list(valid),
            "num_samples": valid_samples,
        },
    }
    per_split = [(train, train_weights), (valid, valid_weights), None]
    theirs = megatron_build(None, None, seed, seq_length, None, [num_samples, valid_samples, None], per_split)
    assert_same_stream(spec, "train", theirs[0])
    assert_same_stream(spec, "valid", theirs[1])
    with pytest.raises(StatefulsetError, match="test split is empty"):
        open_stream(spec, "test")


def test_weighted_train_blend_needs_num_samples(corpus):
    spec = {"data_path": {corpus[0]: 1, corpus[1]: 2}, "seq_length": 16}
    with pytest.raises(StatefulsetError, match="key 'num_samples'"):
        open_stream(spec)
    assert len(open_stream({**spec, "packing": "native"})) > 0


def test_positions_outside_the_stream(corpus):
    stream = open_stream({"data_path": corpus[0], "seq_length": 16})
    with pytest.raises(StatefulsetError, match="outside"):
        stream.gather([0, len(stream)])
    with pytest.raises(IndexError):
        stream[-1]


@pytest.mark.oracle
def test_leading_empty_sequences_match_megatron(tmp_path):
    """Sample 0's row is (0, 0) in megatron-core even when the shuffled index opens with empty sequences."""
    prefix = str(tmp_path / "empties")
    with IndexedDatasetWriter(prefix, numpy.uint16) as w:
        for i in range(200):
            w.add_document(numpy.arange(i % 3 * 40, dtype=numpy.uint16))  # a third of them empty
    for seed in range(40):
        theirs = megatron_build([prefix], None, seed, 16, "1", [None, None, None])[0]
        if len(prefix) and theirs.sample_index[0, 0] == 0 and theirs.document_index[0] in range(0, 200, 3):
            ours = open_stream({"data_path": prefix, "seq_length": 16, "split": "1", "seed": seed})
            numpy.testing.assert_array_equal(ours.sources[0].sample_index, theirs.sample_index)
            assert_same_stream({"data_path": prefix, "seq_length": 16, "split": "1", "seed": seed}, "train", theirs)
            return
    pytest.fail("no seed put an empty sequence first")


@pytest.mark.oracle
def test_a_sample_longer_than_its_split_matches_megatron_and_warns(tmp_path, caplog):
    """megatron-core lets a sample span more tokens than the whole split (it wraps into the next
    epoch's shuffled documents); the stream stays identical to megatron-core's, with a warning."""
    prefix = str(tmp_path / "short")
    with IndexedDatasetWriter(prefix, numpy.uint16) as w:
        for d in range(12):
            w.add_document(numpy.arange(3 + d % 4, dtype=numpy.uint16) + 100 * d)
    tokens = int(sum(3 + d % 4 for d in range(12)))
    spec = {"data_path": prefix, "seq_length": 64, "split": "1", "seed": 11, "num_samples": 9}
    assert spec["seq_length"] + 1 > tokens
    logging.disable(logging.NOTSET)  # megatron_build turns warnings off for the session
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        open_stream(spec)
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{prefix}: the train split holds {tokens} tokens, fewer than one sample of seq_length 64 + 1" in warning
    theirs = megatron_build([prefix], None, 11, 64, "1", [9, None, None])[0]
    assert_same_stream(spec, "train", theirs)
