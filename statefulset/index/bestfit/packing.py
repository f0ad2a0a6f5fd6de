"""Best-fit decreasing of a window's items into bins of ``capacity`` tokens, and how documents become items.

A document of at most ``capacity`` tokens is one item, never cut. A longer one is cut into
``L // capacity`` *full pieces* of exactly ``capacity`` tokens (each a bin of its own) and a
remainder of ``L % capacity`` tokens, which is an item like any document. Items of 0 tokens
(empty documents, remainders of exact multiples) take no room and no bin.

The packing (one rule, a C kernel and this Python version, equal result for result): items in
decreasing size, ties in index order; each goes to the open bin with the least room that still
holds it, among equal rooms the bin that reached that room last; with none, to a new bin.
"""

from __future__ import annotations

import bisect

import numpy

from statefulset.errors import StatefulsetError
from statefulset.index import compiled


def split_documents(lengths: numpy.ndarray, capacity: int) -> tuple[numpy.ndarray, numpy.ndarray]:
    """``(full, rest)``: full pieces and remainder item of each document."""
    lengths = numpy.asarray(lengths, dtype=numpy.int64)
    long = lengths > capacity
    full = numpy.where(long, lengths // capacity, 0)
    rest = numpy.where(long, lengths % capacity, lengths)
    return full, rest


def pack_window(sizes: numpy.ndarray, capacity: int, native: bool | None = None) -> tuple[numpy.ndarray, int]:
    """``(bin_of, bins)``: the bin of each item (-1 for empty ones) and the number of bins."""
    sizes = numpy.ascontiguousarray(sizes, dtype=numpy.int64)
    _check(sizes, capacity)
    lib = compiled.pick(native)
    if lib is not None:
        bin_of = numpy.empty(sizes.size, dtype=numpy.int64)
        bins = int(lib.sf_bestfit_window(sizes, sizes.size, capacity, bin_of))
        if bins < 0:
            raise StatefulsetError(f"best-fit packing failed in the compiled kernel (code {bins})")
        return bin_of, bins
    return _pack_python(sizes.tolist(), capacity)


def count_bins(sizes: numpy.ndarray, window: int, capacity: int, native: bool | None = None) -> numpy.ndarray:
    """Bins of each window of ``window`` consecutive items (the last window may be shorter)."""
    sizes = numpy.ascontiguousarray(sizes, dtype=numpy.int64)
    _check(sizes, capacity)
    windows = -(-sizes.size // window)
    lib = compiled.pick(native)
    if lib is not None:
        out = numpy.empty(windows, dtype=numpy.int64)
        code = int(lib.sf_bestfit_counts(sizes, sizes.size, window, capacity, out))
        if code < 0:
            raise StatefulsetError(f"best-fit packing failed in the compiled kernel (code {code})")
        return out
    values = sizes.tolist()
    return numpy.array(
        [_pack_python(values[j * window : (j + 1) * window], capacity)[1] for j in range(windows)], dtype=numpy.int64
    )


def window_entries(
    sizes: numpy.ndarray, capacity: int, native: bool | None = None
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """``(entries, bin_end)``: the window's items bin after bin (placement order within a bin) and the entry
    count through each bin, both uint32; what the stored index keeps of a window."""
    sizes = numpy.ascontiguousarray(sizes, dtype=numpy.int64)
    _check(sizes, capacity)
    if sizes.size >= 2**32:
        raise StatefulsetError(f"best-fit packing: a window of {sizes.size} items is too large")
    lib = compiled.pick(native)
    if lib is not None:
        entries = numpy.empty(sizes.size, dtype=numpy.uint32)
        bin_end = numpy.empty(sizes.size, dtype=numpy.uint32)
        bins = int(lib.sf_bestfit_entries(sizes, sizes.size, capacity, entries, bin_end))
        if bins < 0:
            raise StatefulsetError(f"best-fit packing failed in the compiled kernel (code {bins})")
        return entries[: int(bin_end[bins - 1]) if bins else 0], bin_end[:bins]
    bin_of, bins = _pack_python(sizes.tolist(), capacity)
    placed = sorted(numpy.flatnonzero(bin_of >= 0).tolist(), key=lambda i: (-int(sizes[i]), i))
    entries = numpy.array(sorted(placed, key=lambda i: int(bin_of[i])), dtype=numpy.uint32)  # stable
    bin_end = numpy.cumsum(numpy.bincount(bin_of[bin_of >= 0], minlength=bins)).astype(numpy.uint32)
    return entries, bin_end


def _check(sizes: numpy.ndarray, capacity: int) -> None:
    if capacity < 1:
        raise StatefulsetError(f"best-fit packing: capacity must be positive, got {capacity}")
    if sizes.size and (int(sizes.min()) < 0 or int(sizes.max()) > capacity):
        raise StatefulsetError(f"best-fit packing: item sizes must lie in [0, {capacity}]")


def _pack_python(sizes: list[int], capacity: int) -> tuple[numpy.ndarray, int]:
    order = sorted((i for i, s in enumerate(sizes) if s > 0), key=lambda i: (-sizes[i], i))
    bin_of = [-1] * len(sizes)
    room: list[int] = []
    stacks: dict[int, list[int]] = {}  # room -> bins with that room, the latest last
    rooms: list[int] = []  # sorted rooms that have a bin
    for item in order:
        size = sizes[item]
        k = bisect.bisect_left(rooms, size)
        if k == len(rooms):
            bin_ = len(room)
            room.append(capacity)
        else:
            r = rooms[k]
            bin_ = stacks[r].pop()
            if not stacks[r]:
                del stacks[r]
                rooms.pop(k)
        bin_of[item] = bin_
        room[bin_] -= size
        left = room[bin_]
        if left > 0:
            if left not in stacks:
                stacks[left] = []
                bisect.insort(rooms, left)
            stacks[left].append(bin_)
    return numpy.array(bin_of, dtype=numpy.int64), len(room)
