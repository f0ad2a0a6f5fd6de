"""``packing: native``: samples computed in O(1) time and memory, no index build, unlimited epochs.

One source (a prefix's split) is the contiguous token range of its sequences. Epoch ``e``
visits its ``W = (T - 1) // S`` windows (``S + 1`` tokens each, consecutive windows sharing one
token, as in Megatron) in the order of a keyed permutation that differs per epoch, so local
sample ``q`` is window ``perm_{e}(j)`` with ``e, j = divmod(q, W)``.
Blends of several sources are :mod:`statefulset.index.native.blend_tree`.
"""

from __future__ import annotations

import numpy

from statefulset.errors import StatefulsetError
from statefulset.index import compiled
from statefulset.index.native.keys import derive_key
from statefulset.index.native.permutation import ROUNDS, KeyedPermutation, half_bits
from statefulset.shards.reader import IndexedDataset


class WindowSource:
    """Fixed windows of one prefix's split, visited each epoch in a keyed order."""

    def __init__(self, dataset: IndexedDataset, sequence_range: tuple[int, int], seq_length: int, key: int) -> None:
        lo, hi = sequence_range
        self.dataset = dataset
        self.sequence_range = (lo, hi)
        self.seq_length = seq_length
        self.first_token, last = dataset.token_span(lo, hi)
        self.num_tokens = last - self.first_token
        self.windows = max(0, (self.num_tokens - 1) // seq_length)
        if self.windows == 0:
            raise StatefulsetError(
                f"{dataset.path_prefix}: the split holds {self.num_tokens} tokens, "
                f"too few for one sample of {seq_length}+1"
            )
        self.key = key
        self._half = half_bits(self.windows)
        self._permutations: dict[int, KeyedPermutation] = {}

    def _permutation(self, epoch: int) -> KeyedPermutation:
        perm = self._permutations.get(epoch)
        if perm is None:
            if len(self._permutations) > 64:  # a bounded cache: memory stays O(1) over any run
                self._permutations.clear()
            perm = self._permutations[epoch] = KeyedPermutation(self.windows, derive_key(self.key, epoch))
        return perm

    def window_starts(self, local: numpy.ndarray) -> numpy.ndarray:
        """First token (in the ``.bin``) of each local sample."""
        local = numpy.asarray(local, dtype=numpy.int64)
        if local.size and local.min() >= 0:
            compiled = compiled_window_permute(local, self.windows, self._half, self.key, ROUNDS)
            if compiled is not None:
                return self.first_token + compiled.reshape(local.shape) * self.seq_length
        return self._window_starts_numpy(local)

    def _window_starts_numpy(self, local: numpy.ndarray) -> numpy.ndarray:
        epoch, j = numpy.divmod(local, self.windows)
        # A set, not numpy.unique: that imports numpy.ma on first use (~7 ms) inside the batch hot path.
        epochs = set(epoch.tolist())
        if len(epochs) == 1:
            return self.first_token + self._permutation(epochs.pop())(j) * self.seq_length
        windows = numpy.empty_like(j)
        for e in sorted(epochs):
            mask = epoch == e
            windows[mask] = self._permutation(e)(j[mask])
        return self.first_token + windows * self.seq_length


def compiled_window_permute(
    local: numpy.ndarray, windows: int, half: int, key: int, rounds: int
) -> numpy.ndarray | None:
    """Permuted window of each non-negative ``local`` sample (see WindowSource), or None without kernels."""
    lib = compiled.library()
    if lib is None:
        return None
    # One block, the samples then the windows: one raw address (reading one costs ~1.7 µs, an
    # ndpointer argument's checks more), for a call made per batch.
    n = numpy.asarray(local).size
    block = numpy.empty(2 * n, dtype=numpy.int64)
    block[:n] = numpy.asarray(local).reshape(-1)
    address = block.ctypes.data
    out = block[n:]
    if lib.sf_window_permute(address, n, windows, half, key, rounds, address + 8 * n) != 0:
        raise StatefulsetError(
            f"internal: the window order kernel refused windows={windows}, half={half}, rounds={rounds} "
            "or a negative sample"
        )
    return out
