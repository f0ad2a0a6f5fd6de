"""GPTDataset's document, sample and shuffle indices, checked against megatron-core over many configurations."""

from __future__ import annotations

import logging

import numpy
import oracle
import pytest

from statefulset import IndexedDataset, IndexedDatasetWriter, StatefulsetError
from statefulset.index.megatron.gpt import build_gpt_indices
from statefulset.spec.splits import parse_split, split_matrix, split_range

builder_module = oracle.module("megatron.core.datasets.blended_megatron_dataset_builder")
gpt_module = oracle.module("megatron.core.datasets.gpt_dataset")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = numpy.random.default_rng(0)
    prefix = tmp_path_factory.mktemp("corpus") / "c"
    with IndexedDatasetWriter(prefix, numpy.uint16) as w:
        for _ in range(1500):
            # Geometric lengths plus some empty sequences: both are in real corpora.
            n = int(rng.geometric(1 / 60)) if rng.random() > 0.02 else 0
            w.add_document(rng.integers(0, 50000, n).astype(numpy.uint16))
    return str(prefix)


def megatron_splits(prefix, seed, seq_length, split, num_samples):
    logging.disable(logging.WARNING)
    config = gpt_module.GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=([prefix], None), split=split,
        tokenizer=oracle.null_tokenizer(50256), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, path_to_cache=None, create_attention_mask=False,
    )  # fmt: skip
    builder = builder_module.BlendedMegatronDatasetBuilder(
        gpt_module.GPTDataset, [num_samples, None, None], lambda: True, config
    )
    return builder.build()


CONFIGS = [
    # seed, seq_length, split, num_samples (None = one epoch)
    (1234, 64, "949,50,1", None),
    (7, 100, "90,5,5", 3000),  # several epochs, the last one separate
    (3, 33, "1", 4000),
    (5, 128, "80,20", 1350),  # final epoch above the 80% threshold: shuffled jointly
    (9, 16, "98/2/0", 20_000),
    (11, 2, "100,0,0", 100),
    (13, 1000, "50 50", None),
]


@pytest.mark.oracle
@pytest.mark.parametrize(("seed", "seq_length", "split", "num_samples"), CONFIGS)
def test_indices_equal_megatron(corpus, seed, seq_length, split, num_samples):
    theirs = megatron_splits(corpus, seed, seq_length, split, num_samples)
    ds = IndexedDataset(corpus)
    matrix = split_matrix(parse_split(split))
    for index, (dataset, bookends) in enumerate(zip(theirs, matrix, strict=True)):
        if dataset is None:
            assert split_range(bookends, len(ds)) is None or index > 0
            continue
        lo, hi = split_range(bookends, len(ds))
        ours = build_gpt_indices(
            ds.sequence_lengths, numpy.arange(lo, hi, dtype=numpy.int32), seq_length, seed,
            num_samples if index == 0 else None,
        )  # fmt: skip
        for name in ("document_index", "sample_index", "shuffle_index"):
            a, b = getattr(ours, name), getattr(dataset, name)
            assert a.dtype == b.dtype, name
            numpy.testing.assert_array_equal(a, b, err_msg=name)
        assert len(ours) == len(dataset)


def test_bad_inputs():
    with pytest.raises(StatefulsetError, match="negative"):
        parse_split("90,-5,15")
    with pytest.raises(StatefulsetError, match="positive total"):
        parse_split("0,0,0")
    with pytest.raises(StatefulsetError, match="one to three ratios"):
        parse_split("1,2,3,4")
    with pytest.raises(StatefulsetError, match="not a list of numbers"):
        parse_split("abc")
    with pytest.raises(StatefulsetError, match="not a list of numbers"):
        parse_split("90,x")
    assert parse_split("949/50/1") == parse_split(" 949, 50, 1 ") == parse_split("949 50 1")
    lengths = numpy.array([3, 4], dtype=numpy.int32)
    with pytest.raises(StatefulsetError, match="too few for even one sample"):
        build_gpt_indices(lengths, numpy.arange(0, 0, dtype=numpy.int32), 8, 1, None)
    with pytest.raises(StatefulsetError, match="seq_length must be at least 2"):
        build_gpt_indices(lengths, numpy.arange(2, dtype=numpy.int32), 1, 1, None)
