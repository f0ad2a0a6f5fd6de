"""Where a batch's document fields are written: :class:`FieldTargets` (arrays given, such as a ring
slot's, else one new block)."""

from __future__ import annotations

from typing import Any

import numpy

from statefulset.index import compiled


class FieldTargets:
    """Where a batch's document fields go: ``given``'s arrays where they fit (a ring slot), else three new
    arrays; and the addresses a kernel writes them at (``request``).

    ``request`` is ``[cu_seqlens, max_seqlen, position_ids, code, keep]``: the three arrays' addresses,
    a code the kernel sets, 0 once it wrote the fields (``sf_gather_batch``'s ``fields``), then
    ``keep``: whether the batch's pieces are still wanted where the kernel wrote the fields (without,
    they are not copied out of its block: the caller needs them for nothing else). Written for a
    per-batch cost of a few µs: numpy's per-call overheads (``prod``, ``.ctypes``) would otherwise
    cost more than the kernel's work.
    """

    __slots__ = ("fields", "request")

    def __init__(self, rows: int, seq_length: int, given: dict[str, numpy.ndarray], keep: bool = True) -> None:
        cu, top, pos = given.get("cu_seqlens"), given.get("max_seqlen"), given.get("position_ids")
        if not (
            fits(cu, (rows, seq_length + 1), _INT32)
            and fits(top, (rows,), _INT32)
            and fits(pos, (rows, seq_length), _INT64)
        ):  # three new arrays: one block's three views cost more in numpy's calls than they save
            cu = numpy.empty((rows, seq_length + 1), dtype=_INT32)
            top = numpy.empty(rows, dtype=_INT32)
            pos = numpy.empty((rows, seq_length), dtype=_INT64)
        self.fields: dict[str, Any] = {"cu_seqlens": cu, "max_seqlen": top, "position_ids": pos}
        self.request = [data_address(cu), data_address(top), data_address(pos), -1, keep]  # type: ignore[arg-type]

    @property
    def written(self) -> bool:
        """Whether a kernel wrote the fields (its code is 0)."""
        return self.request[3] == 0


_INT32, _INT64 = numpy.dtype(numpy.int32), numpy.dtype(numpy.int64)


def data_address(array: numpy.ndarray) -> int:
    """A C-contiguous array's data address: ~0.4 µs where ``.ctypes.data`` costs ~1.4 µs (read-only
    arrays, such as pieces read from a memory map, take the slower way)."""
    found = compiled.writable_address(array)
    return found if found is not None else array.ctypes.data


def fits(array: numpy.ndarray | None, shape: tuple[int, ...], dtype: numpy.dtype) -> bool:
    return array is not None and array.shape == shape and array.dtype == dtype and array.flags.c_contiguous
