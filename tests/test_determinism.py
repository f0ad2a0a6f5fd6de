"""The determinism contract for user datasets: resampling epochs in O(1) memory, and the checker."""

from __future__ import annotations

import numpy
import pytest
import torch

from statefulset import StatefulsetError
from statefulset.integrations.megatron.determinism import (
    EpochIndex,
    IdentityMultiEpochDatasetWrapper,
    MultiEpochDatasetResampler,
    assert_dataset_compatible_with_megatron,
)


class Squares:
    def __len__(self):
        return 97

    def __getitem__(self, i: int):
        return {"x": torch.tensor([i * i])}


class EpochMasked:
    """Random masking seeded by (epoch, idx): different per epoch, pure per index."""

    def __len__(self):
        return 50

    def __getitem__(self, index: EpochIndex):
        gen = torch.Generator().manual_seed(index.epoch * 1_000_003 + index.idx)
        return torch.rand(4, generator=gen)


def test_every_epoch_visits_every_item_once_in_its_own_order():
    resampler = MultiEpochDatasetResampler(IdentityMultiEpochDatasetWrapper(Squares()), num_epochs=3, seed=7)
    assert len(resampler) == 3 * 97
    epochs = [[resampler.epoch_index(e * 97 + j).idx for j in range(97)] for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(97))
    assert epochs[0] != epochs[1] != epochs[2]
    assert int(resampler[5]["x"]) == epochs[0][5] ** 2
    again = MultiEpochDatasetResampler(IdentityMultiEpochDatasetWrapper(Squares()), num_epochs=3, seed=7)
    assert [again.epoch_index(i) for i in range(291)] == [resampler.epoch_index(i) for i in range(291)]


def test_num_samples_and_no_shuffle():
    resampler = MultiEpochDatasetResampler(EpochMasked(), num_samples=120, shuffle=False)
    assert len(resampler) == 120
    assert resampler.epoch_index(119) == EpochIndex(2, 19)
    assert not torch.equal(resampler[0], resampler[50])  # same item, new epoch, new mask
    with pytest.raises(IndexError):
        resampler[120]
    with pytest.raises(StatefulsetError, match="not both"):
        MultiEpochDatasetResampler(EpochMasked(), num_epochs=1, num_samples=3)


def test_checker_accepts_pure_datasets():
    assert_dataset_compatible_with_megatron(Squares(), 3)
    assert_dataset_compatible_with_megatron(EpochMasked(), EpochIndex(2, 3))
    assert_dataset_compatible_with_megatron(MultiEpochDatasetResampler(EpochMasked(), num_epochs=2), 77)


class GlobalSeeded:
    def __len__(self):
        return 10

    def __getitem__(self, i):
        torch.manual_seed(i)
        return torch.rand(2)


class Unseeded:
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return numpy.random.rand(2)


def test_checker_catches_global_seeding_and_impurity():
    with pytest.raises(StatefulsetError, match="touched the global torch RNG"):
        assert_dataset_compatible_with_megatron(GlobalSeeded(), 1)
    with pytest.raises(StatefulsetError, match="pure function"):
        assert_dataset_compatible_with_megatron(Unseeded(), 1)
