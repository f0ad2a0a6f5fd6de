"""The Megatron determinism contract for user datasets (BioNeMo's multi-epoch utilities).

Megatron-LM builds the same batch on every tensor-parallel rank by asking each for
``dataset[i]``: the answer must be a pure function of ``i``. Random effects (masking,
augmentation) must therefore be seeded by the index, never by global RNG state, and a new
epoch must reshuffle without breaking that purity. These classes do that in O(1) memory.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy
import torch

from statefulset.errors import StatefulsetError
from statefulset.index.native.keys import derive_key
from statefulset.index.native.permutation import KeyedPermutation


class EpochIndex(NamedTuple):
    """What a multi-epoch dataset is asked for: which epoch, which item."""

    epoch: int
    idx: int


class EpochAwareDataset(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: EpochIndex) -> Any: ...


class IdentityMultiEpochDatasetWrapper:
    """Lets a dataset indexed by plain ints stand where an ``EpochIndex`` is expected."""

    def __init__(self, dataset: Sequence[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: EpochIndex) -> Any:
        return self.dataset[index.idx]


class MultiEpochDatasetResampler:
    """``num_samples`` items drawn epoch after epoch from ``dataset``, each epoch in its own order.

    Item ``i`` is ``dataset[EpochIndex(e, perm_e(j))]`` with ``e, j = divmod(i, len(dataset))``
    and ``perm_e`` a keyed permutation of the epoch (identity when ``shuffle`` is False): a pure
    function of ``i``, computed in O(1) time and memory, for any number of epochs.
    """

    def __init__(
        self,
        dataset: EpochAwareDataset,
        num_epochs: int | None = None,
        num_samples: int | None = None,
        shuffle: bool = True,
        seed: int = 42,
    ) -> None:
        size = len(dataset)
        if size < 1:
            raise StatefulsetError("MultiEpochDatasetResampler: the dataset is empty")
        if num_epochs is not None and num_samples is not None:
            raise StatefulsetError("MultiEpochDatasetResampler: give num_epochs or num_samples, not both")
        if num_epochs is not None and num_epochs < 1:
            raise StatefulsetError(f"MultiEpochDatasetResampler: num_epochs must be positive, got {num_epochs}")
        if num_samples is not None and num_samples < 1:
            raise StatefulsetError(f"MultiEpochDatasetResampler: num_samples must be positive, got {num_samples}")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self._size = size
        self.num_samples = num_samples if num_samples is not None else size * (num_epochs or 1)

    def __len__(self) -> int:
        return self.num_samples

    def epoch_index(self, index: int) -> EpochIndex:
        i = int(index)
        if i < 0:
            i += self.num_samples
        if not 0 <= i < self.num_samples:
            raise IndexError(f"index {index} outside [0, {self.num_samples})")
        epoch, j = divmod(i, self._size)
        if self.shuffle:
            j = KeyedPermutation(self._size, derive_key(self.seed, epoch))[j]
        return EpochIndex(epoch, j)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[self.epoch_index(index)]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, numpy.ndarray) and isinstance(b, numpy.ndarray):
        return a.dtype == b.dtype and numpy.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def assert_dataset_compatible_with_megatron(dataset: Any, index: Any = 0, *, trials: int = 3) -> None:
    """Raise ``StatefulsetError`` unless ``dataset[index]`` is a pure function of ``index``.

    It asks for the same item several times, with the global RNGs (torch, numpy, random)
    scrambled in between, and checks that the answers are identical and that the dataset did
    not reseed the global torch RNG (Megatron seeds it per model-parallel rank).
    """
    saved = (torch.get_rng_state(), numpy.random.get_state(), random.getstate())
    try:
        _check_pure(dataset, index, trials)
    finally:  # leave the caller's global RNGs as they were
        torch.set_rng_state(saved[0])
        numpy.random.set_state(saved[1])
        random.setstate(saved[2])


def _check_pure(dataset: Any, index: Any, trials: int) -> None:
    first = None
    for trial in range(trials):
        torch.manual_seed(1000 + trial)
        numpy.random.seed(2000 + trial)
        random.seed(3000 + trial)
        before = torch.get_rng_state()
        after_draw = torch.rand(1)
        torch.set_rng_state(before)
        item = copy.deepcopy(dataset[index])
        if not torch.equal(torch.rand(1), after_draw):
            raise StatefulsetError(
                f"{type(dataset).__name__}[{index!r}] touched the global torch RNG (torch.manual_seed or a "
                "draw from it); seed a torch.Generator from the index instead"
            )
        if first is None:
            first = item
        elif not _equal(first, item):
            raise StatefulsetError(
                f"{type(dataset).__name__}[{index!r}] returned different values on repeated calls: "
                "dataset[i] must be a pure function of i"
            )
