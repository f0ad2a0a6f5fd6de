"""One source of ``packing: bestfit``: a prefix's split as bins of whole documents, visited each epoch in a keyed order.

- **Windows.** A keyed permutation (from the seed, the same every epoch) deals the split's
  documents into windows of ``window`` documents. Each window is packed on its own
  (:mod:`statefulset.index.bestfit.packing`): first the full pieces of its long documents, then
  its best-fit bins. A window is packed when a sample of it is first read (a bounded memo keeps
  the latest ones), in microseconds.
- **Bins per window** (``bins``, one int64 per window) place sample ``b`` of an epoch in its
  window. They are the only pass over the corpus: computed once per source (about 30 ns a
  document in the compiled kernel), kept in the content-keyed index cache, made by
  ``statefulset prepare``. Opening with them cached is O(1); a restore is a seek.
- **Epochs.** Epoch ``e`` visits the ``n`` bins (``samples_per_epoch``) in the order of a keyed
  permutation of its own, so local sample ``q`` is bin ``perm_e(q mod n)`` with ``e = q // n``.
  Every token of the split appears once per epoch; the packing is the same in every epoch, the
  order is not.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy

from statefulset.errors import StatefulsetError
from statefulset.index.bestfit.packing import count_bins, pack_window, split_documents
from statefulset.index.native.keys import derive_key
from statefulset.index.native.permutation import ROUNDS, KeyedPermutation, half_bits
from statefulset.index.native.windows import _compiled_window_permute
from statefulset.shards.reader import IndexedDataset

# A window holds about this many samples' worth of documents: best-fit leaves ~0.1-0.3% padding
# on geometric lengths of mean 500 with S=2048 there (docs/packing.md), while packing one stays
# well under a millisecond.
WINDOW_SAMPLES = 512
_MIN_WINDOW, _MAX_WINDOW = 64, 1 << 16
_GROUP, _ORDER = 0x6266_6772, 0x6266_6F72  # key domains: dealing documents, ordering bins
_MEMO_WINDOWS = 64
_COUNT_CHUNK = 1 << 20  # documents per step of the bins pass: bounded memory whatever the split


def window_documents(num_documents: int, num_tokens: int, capacity: int) -> int:
    """Documents per window for a split of that size: ~WINDOW_SAMPLES samples' worth."""
    mean = max(1.0, num_tokens / max(1, num_documents))
    return int(min(_MAX_WINDOW, max(_MIN_WINDOW, round(WINDOW_SAMPLES * capacity / mean))))


@dataclass(frozen=True)
class Window:
    """A packed window: bin ``k`` holds items ``first[k]:first[k+1]`` (document, offset, length)."""

    first: numpy.ndarray
    document: numpy.ndarray
    offset: numpy.ndarray
    length: numpy.ndarray
    used: numpy.ndarray  # tokens in each bin


class BestFitSource:
    """Bins of whole documents of one prefix's split, each epoch in a keyed order."""

    def __init__(
        self,
        dataset: IndexedDataset,
        sequence_range: tuple[int, int],
        seq_length: int,
        key: int,
        window: int,
        bins: numpy.ndarray,
    ) -> None:
        lo, hi = sequence_range
        self.dataset = dataset
        self.sequence_range = (lo, hi)
        self.capacity = seq_length + 1
        self.window = window
        self.documents = hi - lo
        self.bins = bins
        self.cumulative = numpy.concatenate([[0], numpy.cumsum(bins, dtype=numpy.int64)])
        self.samples_per_epoch = int(self.cumulative[-1])
        if self.samples_per_epoch == 0:
            raise StatefulsetError(f"{dataset.path_prefix}: the split holds no tokens to pack")
        self.key = key
        self._deal = dealer(self.documents, key)
        self._order_key = derive_key(key, _ORDER)
        self._half = half_bits(self.samples_per_epoch)
        self._memo: OrderedDict[int, Window] = OrderedDict()

    @property
    def windows(self) -> int:
        """Samples in one epoch (the name the native blend uses for a source's epoch)."""
        return self.samples_per_epoch

    def bins_of(self, local: numpy.ndarray) -> numpy.ndarray:
        """The epoch bin (in ``[0, samples_per_epoch)``) each local sample reads."""
        local = numpy.asarray(local, dtype=numpy.int64).reshape(-1)
        n = self.samples_per_epoch
        found = _compiled_window_permute(local, n, self._half, self._order_key, ROUNDS)
        if found is not None:
            return found
        epoch, j = numpy.divmod(local, n)
        out = numpy.empty_like(j)
        for e in sorted(set(epoch.tolist())):
            rows = epoch == e
            out[rows] = KeyedPermutation(n, derive_key(self._order_key, e))(j[rows])
        return out

    def packed_window(self, j: int) -> Window:
        """Window ``j`` packed (memoised: the latest ``_MEMO_WINDOWS`` windows of this process)."""
        found = self._memo.get(j)
        if found is not None:
            self._memo.move_to_end(j)
            return found
        packed = self._pack(j)
        self._memo[j] = packed
        if len(self._memo) > _MEMO_WINDOWS:
            self._memo.popitem(last=False)
        return packed

    def _pack(self, j: int) -> Window:
        lo = self.sequence_range[0]
        ranks = numpy.arange(j * self.window, min((j + 1) * self.window, self.documents), dtype=numpy.int64)
        documents = lo + self._deal(ranks)
        lengths = self.dataset.sequence_lengths[documents].astype(numpy.int64)
        full, rest = split_documents(lengths, self.capacity)
        bin_of, packed = pack_window(rest, self.capacity)
        if int(full.sum()) + packed != int(self.bins[j]):
            raise StatefulsetError(
                f"{self.dataset.path_prefix}: window {j} packs into {int(full.sum()) + packed} samples, the cached "
                f"index says {int(self.bins[j])} (a stale cache entry: remove it from path_to_cache)"
            )
        # Full pieces first, one bin each, in document order; then the best-fit bins, each
        # holding its items in the order they were placed (largest first).
        piece_doc = numpy.repeat(documents, full)
        piece_offset = (numpy.arange(piece_doc.size) - numpy.repeat(numpy.cumsum(full) - full, full)) * self.capacity
        placed = numpy.flatnonzero(bin_of >= 0)
        order = placed[numpy.lexsort((placed, -rest[placed], bin_of[placed]))]
        item_bin = numpy.concatenate([numpy.arange(piece_doc.size), piece_doc.size + bin_of[order]])
        document = numpy.concatenate([piece_doc, documents[order]])
        offset = numpy.concatenate([piece_offset, full[order] * self.capacity])
        length = numpy.concatenate([numpy.full(piece_doc.size, self.capacity), rest[order]])
        bins = int(self.bins[j])
        first = numpy.searchsorted(item_bin, numpy.arange(bins + 1))
        used = numpy.add.reduceat(length, first[:-1]) if bins else numpy.empty(0, dtype=numpy.int64)
        return Window(first, document, offset, length.astype(numpy.int64), used.astype(numpy.int64))

    def plan(self, local: numpy.ndarray) -> tuple[list[int], list[int], list[int], list[int]]:
        """``(starts, lengths, counts, used)``: the token ranges of each local sample, row after row."""
        b = self.bins_of(local)
        j = numpy.searchsorted(self.cumulative, b, side="right") - 1
        k = b - self.cumulative[j]
        pointers, item = self.dataset.sequence_pointers, self.dataset.dtype.itemsize
        starts: list[int] = []
        lengths: list[int] = []
        counts: list[int] = []
        used: list[int] = []
        for w, bin_ in zip(j.tolist(), k.tolist(), strict=True):
            packed = self.packed_window(w)
            a, z = int(packed.first[bin_]), int(packed.first[bin_ + 1])
            docs = packed.document[a:z]
            starts.extend((pointers[docs] // item + packed.offset[a:z]).tolist())
            lengths.extend(packed.length[a:z].tolist())
            counts.append(z - a)
            used.append(int(packed.used[bin_]))
        return starts, lengths, counts, used


def dealer(documents: int, key: int) -> KeyedPermutation:
    """The epoch-independent keyed order that deals a split's documents into windows."""
    return KeyedPermutation(documents, derive_key(key, _GROUP))


def build_bins(dataset: IndexedDataset, sequence_range: tuple[int, int], seq_length: int, key: int, window: int):
    """Bins of every window of the split (the one pass over its document lengths), int64 [windows]."""
    lo, hi = sequence_range
    documents, capacity = hi - lo, seq_length + 1
    deal = dealer(documents, key)
    step = max(window, _COUNT_CHUNK // window * window)
    parts = []
    for first in range(0, documents, step):
        ranks = numpy.arange(first, min(first + step, documents), dtype=numpy.int64)
        lengths = dataset.sequence_lengths[lo + deal(ranks)].astype(numpy.int64)
        full, rest = split_documents(lengths, capacity)
        packed = count_bins(rest, window, capacity)
        fulls = numpy.add.reduceat(full, numpy.arange(0, full.size, window)) if full.size else full
        parts.append(packed + fulls)
    return numpy.concatenate(parts) if parts else numpy.empty(0, dtype=numpy.int64)
