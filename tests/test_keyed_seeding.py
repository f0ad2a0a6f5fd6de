"""The cheaper keyed seeding (``keyed.GlobalSeeder``: the keyed hash's state copied per call, the seeds
unpacked at once, ``random`` seeded by its C method) leaves the three global RNGs in exactly the
states the plain way gives: ``random.seed``, ``numpy.random.seed`` and torch's CPU ``manual_seed`` of
the seeds read from ``BLAKE2b(sample_id, key=key)`` as CONTRACT §15's keyed randomness defines them."""

from __future__ import annotations

import hashlib
import random

import numpy
import torch

from statefulset.transforms.keyed import GlobalSeeder, global_seeds, restore_globals, save_globals, seed_globals

MASK = (1 << 64) - 1


def _plain(key: int, sample_id: int) -> tuple[int, int, int]:
    digest = hashlib.blake2b(
        (sample_id & MASK).to_bytes(8, "little"), key=(key & MASK).to_bytes(8, "little"), digest_size=20
    ).digest()
    return (
        int.from_bytes(digest[:8], "little"),
        int.from_bytes(digest[8:12], "little"),
        int.from_bytes(digest[12:20], "little") >> 1,
    )


def _states() -> tuple:
    r, n, t = save_globals()
    return r, (n[0], n[1].tolist(), *n[2:]), t.tolist()


def test_seeded_states_equal_the_plain_seeding():
    saved = save_globals()
    try:
        rng = numpy.random.default_rng(3)
        keys = [0, 1, MASK, *rng.integers(0, 2**63, 5).tolist()]
        ids = [0, 1, 2**40 + 7, MASK, -1, *rng.integers(0, 2**62, 5).tolist()]
        for key in keys:
            seeder = GlobalSeeder(key)
            for sample_id in ids:
                seeds = _plain(key, sample_id)
                assert seeder.seeds(sample_id) == seeds == global_seeds(key, sample_id)
                random.gauss(0, 1)  # a cached gauss value, which seeding must drop
                numpy.random.standard_normal()
                seeder(sample_id)
                ours = _states()
                random.seed(seeds[0])
                numpy.random.seed(seeds[1])
                torch.default_generator.manual_seed(seeds[2])
                assert ours == _states()
                seed_globals(key, sample_id)
                assert ours == _states()
    finally:
        restore_globals(saved)


def test_a_replaced_random_instance_is_seeded_through_its_own_seed(monkeypatch):
    calls = []

    class Mine(random.Random):
        def seed(self, a=None, version=2):
            calls.append(a)
            super().seed(a, version)

    saved = save_globals()
    try:
        mine = Mine()
        calls.clear()  # its construction seeded it once
        monkeypatch.setattr(random, "seed", mine.seed)
        GlobalSeeder(5)(9)
        assert calls == [_plain(5, 9)[0]]
    finally:
        monkeypatch.undo()
        restore_globals(saved)
