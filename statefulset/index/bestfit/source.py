"""One source of ``packing: bestfit``: a prefix's split as bins of whole documents, visited each epoch in a keyed order.

- **Windows.** A keyed permutation (from the seed, the same every epoch) deals the split's
  documents into windows of ``window`` documents (about ``WINDOW_SAMPLES`` samples' worth: the
  larger the window, the closer best-fit decreasing comes to packing the whole source at once).
  Each window is packed on its own (:mod:`statefulset.index.bestfit.packing`): first one bin per
  full piece of its long documents, then its best-fit bins.
- **The stored index** (:func:`build_index`: the one pass over the split's document lengths,
  kept in the content-keyed index cache, made ahead by ``statefulset prepare``) records, per
  window, its bins and full pieces, its long documents, and its packed items bin after bin
  (4 bytes per document, 4 per bin). Reading a sample is then a few array lookups: no window is
  packed again, whatever the access pattern.
- **Epochs.** Epoch ``e`` visits the ``n`` bins (``samples_per_epoch``) in the order of a keyed
  permutation of its own, so local sample ``q`` is bin ``perm_e(q mod n)`` with ``e = q // n``.
  Every token of the split appears once per epoch; the packing is the same in every epoch, the
  order is not.
"""

from __future__ import annotations

import numpy

from statefulset.errors import StatefulsetError
from statefulset.index.bestfit.packing import split_documents, window_entries
from statefulset.index.native.keys import derive_key
from statefulset.index.native.permutation import ROUNDS, KeyedPermutation, half_bits
from statefulset.index.native.windows import compiled_window_permute
from statefulset.shards.reader import IndexedDataset

# A window holds about this many samples' worth of documents: best-fit decreasing then leaves
# about as little padding as packing the whole source at once (docs/packing.md), while the build
# needs O(window) scratch memory.
WINDOW_SAMPLES = 65_536
_MIN_WINDOW, _MAX_WINDOW = 1024, 1 << 22
_GROUP, _ORDER = 0x6266_6772, 0x6266_6F72  # key domains: dealing documents, ordering bins
INDEX_ARRAYS = ("bins", "full", "long_first", "long_rank", "long_pieces", "packed_first", "bin_end", "entry_first",
                "entries")  # fmt: skip


def window_documents(num_documents: int, num_tokens: int, capacity: int) -> int:
    """Documents per window for a split of that size: ~WINDOW_SAMPLES samples' worth."""
    mean = max(1.0, num_tokens / max(1, num_documents))
    return int(min(_MAX_WINDOW, max(_MIN_WINDOW, round(WINDOW_SAMPLES * capacity / mean))))


def dealer(documents: int, key: int) -> KeyedPermutation:
    """The epoch-independent keyed order that deals a split's documents into windows."""
    return KeyedPermutation(documents, derive_key(key, _GROUP))


def build_index(
    dataset: IndexedDataset, sequence_range: tuple[int, int], seq_length: int, key: int, window: int
) -> dict[str, numpy.ndarray]:
    """Every window packed: the arrays :class:`BestFitSource` reads samples from (see the module docstring)."""
    lo, hi = sequence_range
    documents, capacity = hi - lo, seq_length + 1
    deal = dealer(documents, key)
    parts: dict[str, list[numpy.ndarray]] = {name: [] for name in INDEX_ARRAYS}
    for first in range(0, documents, window):
        ranks = numpy.arange(first, min(first + window, documents), dtype=numpy.int64)
        lengths = dataset.sequence_lengths[lo + deal(ranks)].astype(numpy.int64)
        full, rest = split_documents(lengths, capacity)
        entries, bin_end = window_entries(rest, capacity)
        long = numpy.flatnonzero(full)
        parts["bins"].append(numpy.array([int(full.sum()) + bin_end.size], dtype=numpy.int64))
        parts["full"].append(numpy.array([int(full.sum())], dtype=numpy.int64))
        parts["long_first"].append(numpy.array([long.size], dtype=numpy.int64))
        parts["long_rank"].append(long.astype(numpy.uint32))
        parts["long_pieces"].append((numpy.cumsum(full[long]) - full[long]).astype(numpy.int64))
        parts["packed_first"].append(numpy.array([bin_end.size], dtype=numpy.int64))
        parts["bin_end"].append(bin_end)
        parts["entry_first"].append(numpy.array([entries.size], dtype=numpy.int64))
        parts["entries"].append(entries)
    dtypes = {"long_rank": numpy.uint32, "bin_end": numpy.uint32, "entries": numpy.uint32}
    out = {
        name: numpy.concatenate(arrays) if arrays else numpy.empty(0, dtype=dtypes.get(name, numpy.int64))
        for name, arrays in parts.items()
    }
    for name in ("long_first", "packed_first", "entry_first"):  # counts -> offsets [windows + 1]
        out[name] = numpy.concatenate([[0], numpy.cumsum(out[name])]).astype(numpy.int64)
    return out


class BestFitSource:
    """Bins of whole documents of one prefix's split, each epoch in a keyed order."""

    def __init__(
        self,
        dataset: IndexedDataset,
        sequence_range: tuple[int, int],
        seq_length: int,
        key: int,
        window: int,
        index: dict[str, numpy.ndarray],
    ) -> None:
        lo, hi = sequence_range
        self.dataset = dataset
        self.sequence_range = (lo, hi)
        self.capacity = seq_length + 1
        self.window = window
        self.documents = hi - lo
        self.index = index
        self.bins = index["bins"]
        self.cumulative = numpy.concatenate([[0], numpy.cumsum(self.bins, dtype=numpy.int64)])
        self.samples_per_epoch = int(self.cumulative[-1])
        if self.samples_per_epoch == 0:
            raise StatefulsetError(f"{dataset.path_prefix}: the split holds no tokens to pack")
        self.key = key
        self._deal = dealer(self.documents, key)
        self._order_key = derive_key(key, _ORDER)
        self._half = half_bits(self.samples_per_epoch)

    @property
    def windows(self) -> int:
        """Samples in one epoch (the name the native blend uses for a source's epoch)."""
        return self.samples_per_epoch

    def bins_of(self, local: numpy.ndarray) -> numpy.ndarray:
        """The epoch bin (in ``[0, samples_per_epoch)``) each local sample reads."""
        local = numpy.asarray(local, dtype=numpy.int64).reshape(-1)
        n = self.samples_per_epoch
        found = compiled_window_permute(local, n, self._half, self._order_key, ROUNDS)
        if found is not None:
            return found
        epoch, j = numpy.divmod(local, n)
        out = numpy.empty_like(j)
        for e in sorted(set(epoch.tolist())):
            rows = epoch == e
            out[rows] = KeyedPermutation(n, derive_key(self._order_key, e))(j[rows])
        return out

    def bin_items(self, b: int) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        """``(sequences, offsets, lengths)``: the token runs epoch bin ``b`` holds, in order."""
        index, lo = self.index, self.sequence_range[0]
        j = int(numpy.searchsorted(self.cumulative, b, side="right")) - 1
        k = b - int(self.cumulative[j])
        full = int(index["full"][j])
        if k < full:  # a full piece of a long document
            a, z = int(index["long_first"][j]), int(index["long_first"][j + 1])
            i = a + int(numpy.searchsorted(index["long_pieces"][a:z], k, side="right")) - 1
            rank = j * self.window + int(index["long_rank"][i])
            piece = k - int(index["long_pieces"][i])
            sequence = lo + int(self._deal(numpy.array([rank], dtype=numpy.int64))[0])
            return (numpy.array([sequence]), numpy.array([piece * self.capacity]), numpy.array([self.capacity]))
        m = int(index["packed_first"][j]) + k - full
        first = int(index["bin_end"][m - 1]) if k > full else 0
        a = int(index["entry_first"][j])
        ranks = j * self.window + index["entries"][a + first : a + int(index["bin_end"][m])].astype(numpy.int64)
        sequences = lo + self._deal(ranks)
        lengths = self.dataset.sequence_lengths[sequences].astype(numpy.int64)
        full_pieces, rest = split_documents(lengths, self.capacity)
        return sequences, full_pieces * self.capacity, rest

    def plan(self, local: numpy.ndarray) -> tuple[list[int], list[int], list[int], list[int]]:
        """``(starts, lengths, counts, used)``: the token ranges of each local sample, row after row.

        Vectorised over the batch (one dealing call, one gather of lengths): the per-sample path
        is :meth:`bin_items`, which :mod:`statefulset.streams.provenance` uses.
        """
        index, lo, cap = self.index, self.sequence_range[0], self.capacity
        b = self.bins_of(local)
        j = numpy.searchsorted(self.cumulative, b, side="right") - 1
        k = b - self.cumulative[j]
        full = index["full"][j]
        is_full = k < full
        # Packed bins: their entries, all rows at once.
        m = index["packed_first"][j] + k - full
        bin_end = index["bin_end"]
        end = numpy.where(is_full, 0, bin_end[numpy.where(is_full, 0, m)].astype(numpy.int64))
        begin = numpy.where(is_full | (k == full), 0, bin_end[numpy.maximum(m - 1, 0)].astype(numpy.int64))
        counts = numpy.where(is_full, 1, end - begin)
        rows = numpy.repeat(numpy.arange(b.size), counts)
        within = numpy.arange(rows.size) - numpy.repeat(numpy.cumsum(counts) - counts, counts)
        ranks = numpy.empty(rows.size, dtype=numpy.int64)
        packed_rows = ~is_full[rows]
        at = (index["entry_first"][j] + begin)[rows[packed_rows]] + within[packed_rows]
        ranks[packed_rows] = index["entries"][at]
        piece = numpy.zeros(rows.size, dtype=numpy.int64)
        if is_full.any():  # full pieces of long documents: the window's long-document table
            for r in numpy.flatnonzero(is_full).tolist():
                jj, kk = int(j[r]), int(k[r])
                a, z = int(index["long_first"][jj]), int(index["long_first"][jj + 1])
                i = a + int(numpy.searchsorted(index["long_pieces"][a:z], kk, side="right")) - 1
                slot = int(numpy.flatnonzero(rows == r)[0])
                ranks[slot] = int(index["long_rank"][i])
                piece[slot] = kk - int(index["long_pieces"][i])
        sequences = lo + self._deal(j[rows] * self.window + ranks)
        lengths = self.dataset.sequence_lengths[sequences].astype(numpy.int64)
        full_pieces, rest = split_documents(lengths, cap)
        full_row = is_full[rows]
        offsets = numpy.where(full_row, piece * cap, full_pieces * cap)
        runs = numpy.where(full_row, cap, rest)
        pointers, item = self.dataset.sequence_pointers, self.dataset.dtype.itemsize
        starts = pointers[sequences] // item + offsets
        used = numpy.bincount(rows, weights=runs, minlength=b.size).astype(numpy.int64)
        return starts.tolist(), runs.tolist(), counts.tolist(), used.tolist()
