"""Encoded bundles out of the ring's layout travel through each worker's arena of shared-memory slots
(statefulset.loading.encoded.Arena), made once and again when a bundle outgrows it: the batches are
exactly what ``ds[p]`` encodes, across arena growth, several passes and a resume."""

from __future__ import annotations

import numpy
import pytest
import torch

from statefulset import WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.tools.demo import demo_spec

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class Grows:
    """Adds a field whose size grows with the position (each bundle larger: the arena is made again)."""

    def encode_sample(self, sample, rng):
        sample.extra = rng.integers(0, 1 << 40, size=1 + 40 * sample.sample_id)
        sample.coin = bool(rng.random() < 0.5)
        return sample


def _same(batch, ds) -> None:
    for j, p in enumerate(batch["sample_id"].tolist()):
        row = ds[p]
        assert batch["text"][j].tolist() == row.text.tolist()
        assert numpy.array_equal(numpy.asarray(batch["extra"][j]), row.extra)
        assert bool(batch["coin"][j]) == row.coin


def test_bundles_through_growing_arenas_are_exact(tmp_path):
    spec = demo_spec(str(tmp_path), documents=200, seq_length=32)
    wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
    ds = get_train_dataset(spec, batch_size=4, worker_config=wc, task_encoder=Grows())
    loader = get_savable_loader(ds)
    seen = []
    for t, batch in zip(range(40), loader, strict=False):
        assert batch["sample_id"].tolist() == [4 * t + j for j in range(4)]
        assert isinstance(batch["text"], torch.Tensor) and batch["text"].dtype == torch.int64
        _same(batch, ds)
        seen.append(batch["sample_id"][0].item())
        if t == 19:
            state = loader.save_state_rank()
    resumed = get_savable_loader(get_train_dataset(spec, batch_size=4, worker_config=wc, task_encoder=Grows()))
    resumed.restore_state_rank(state)
    for t, batch in zip(range(20, 30), resumed, strict=False):
        assert batch["sample_id"].tolist() == [4 * t + j for j in range(4)]
        _same(batch, ds)
