"""Fill-in-the-middle in token mode over a whole micro-batch, in place, in one compiled call.

The loader's path for :class:`~statefulset.transforms.fim.FillInTheMiddle` (no tokenizer): the
rows of a micro-batch (``text`` int64 ``[B, seq_length + 1]`` and the dataset's other fields, as
``BatchSource`` builds them) are FIM'd where they lie by ``sf_fim_rows`` (kernels.c), which walks
each row's segments, draws from numpy's Philox keyed by ``(sample_id, key)`` exactly as the
loader's keyed generator does (:class:`~statefulset.transforms.keyed.Rekeyed`), computed as
:mod:`~statefulset.transforms.fim_draws` computes them, and gathers the row as
:mod:`~statefulset.transforms.fim_tokens` does. Each row then equals ``encode_sample`` of its
TokenSample with that generator, field for field (``tests/test_fim_rows.py``), the document fields
of a changed row (``cu_seqlens``, ``max_seqlen``, ``position_ids``) computed again by the kernel
from its permuted documents, by the rule of ``streams.documents.document_fields``.

Where the path does not apply (no compiled kernels: logged once as a WARNING by
:mod:`statefulset.index.compiled`; tokenizer mode; fields of other shapes, dtypes or names) it
changes nothing and says so, and the loader calls ``encode_sample`` per sample instead: the same
samples, more slowly.
"""

from __future__ import annotations

from typing import Any

import numpy

from statefulset.errors import StatefulsetError
from statefulset.index import compiled
from statefulset.transforms.fim_draws import inversion_constants

_MASK64 = (1 << 64) - 1
_DOCUMENT_FIELDS = ("cu_seqlens", "max_seqlen", "position_ids")
_PARAMS = 11  # kernels.c's SF_FIM_PARAMS


def fim_rows(fim: Any, rows: dict[str, Any], sample_ids: numpy.ndarray, key: int) -> bool:
    """FIM ``rows`` in place as ``fim.encode_sample`` would each row with the generator keyed by
    ``(key, sample_id)``; False (nothing changed) where this path does not apply."""
    if fim.tokenizer is not None or not _plain(rows, sample_ids):
        return False
    text = rows["text"]
    count, width = text.shape
    if fim.rate == 0.0 or count == 0:
        return True  # every sample as it is
    lib = compiled.library()
    if lib is None:
        return False
    constants = _constants(fim)
    # One per-thread block carries the kernel's params, the sample ids and its scratch: one address,
    # read once (an array's .ctypes.data costs ~1.4 µs), nothing allocated per call.
    block, at = compiled.scratch(_PARAMS + count + _work(width))
    block[:_PARAMS] = constants.params
    block[:3] = (count, width, _signed(key))
    block[_PARAMS : _PARAMS + count] = sample_ids
    label, cu = rows.get("loss_mask"), rows.get("cu_seqlens")
    top, pos = rows.get("max_seqlen"), rows.get("position_ids")
    found = lib.sf_fim_rows(
        at, constants.rates_at, at + 8 * _PARAMS, constants.no_prefix_at, _address(text),
        *(None if a is None else _address(a) for a in (label, cu, top, pos)), at + 8 * (_PARAMS + count),
        block.size - _PARAMS - count,
    )  # fmt: skip
    if found != 0:
        raise StatefulsetError(
            f"internal: FillInTheMiddle's compiled path failed (code {found}) on the micro-batch from sample "
            f"{int(sample_ids[0])}"
        )
    return True


def _work(width: int) -> int:
    """The scratch ``sf_fim_rows`` needs (kernels.c's ``sf_fim_work``), in int64 values."""
    room, pieces = width + 3, 6 * (width + 2)
    return 3 * room + 2 * pieces + 4 * width + (3 * room + width + 1) // 2


def _address(array: numpy.ndarray) -> int:
    found = compiled.writable_address(array)  # ~0.4 µs where array.ctypes.data costs ~1.4 µs
    return found if found is not None else array.ctypes.data


class _Constants:
    """One FIM parameter set's kernel arguments: its params (the first three set per call), and its
    rates and no_prefix arrays with their addresses, read once."""

    def __init__(self, fim: Any) -> None:
        prefix = fim.no_prefix if isinstance(fim.no_prefix, tuple) else ()
        self.params = numpy.array(
            [0, 0, 0, fim.prefix_id, fim.middle_id, fim.suffix_id, fim.eod_id is not None, fim.eod_id or 0,
             fim.split_sample is not None, fim.split_sample or 0, len(prefix)],
            dtype=numpy.int64,
        )  # fmt: skip
        self.rates = numpy.array([v for p in (fim.rate, fim.fragment_rate, fim.spm_rate) for v in _rate(p)])
        self.no_prefix = numpy.array(prefix or (0,), dtype=numpy.int64)
        self.rates_at, self.no_prefix_at = self.rates.ctypes.data, self.no_prefix.ctypes.data


# Per FIM's parameters (never written: threads share them).
_CONSTANTS: dict[tuple[Any, ...], _Constants] = {}


def _constants(fim: Any) -> _Constants:
    prefix = fim.no_prefix if isinstance(fim.no_prefix, tuple) else ()
    ids = (fim.prefix_id, fim.middle_id, fim.suffix_id, fim.eod_id, fim.split_sample)
    name = (fim.rate, fim.fragment_rate, fim.spm_rate, ids, prefix)
    found = _CONSTANTS.get(name)
    if found is None:
        if len(_CONSTANTS) >= 64:
            _CONSTANTS.clear()
        found = _CONSTANTS[name] = _Constants(fim)
    return found


def _plain(rows: dict[str, Any], sample_ids: numpy.ndarray) -> bool:
    """Whether ``rows`` are the dataset's fields as the loader builds them, writable, in the layouts
    ``encode_sample`` gives back (else the per-sample path runs)."""
    text = rows.get("text")
    if not _array(text, numpy.int64, 2) or text.shape[1] < 2 or text.shape[0] != len(sample_ids):
        return False
    count, width = text.shape
    shapes = {
        "text": (numpy.int64, (count, width)),
        "loss_mask": (numpy.float32, (count, width - 1)),
        "cu_seqlens": (numpy.int32, (count, width)),
        "max_seqlen": (numpy.int32, (count,)),
        "position_ids": (numpy.int64, (count, width - 1)),
    }
    for name, value in rows.items():
        if name not in shapes or not _array(value, shapes[name][0], len(shapes[name][1])):
            return False
        if value.shape != shapes[name][1]:
            return False
    has = [name in rows for name in _DOCUMENT_FIELDS]
    return has[0] or not any(has)  # the document fields follow cu_seqlens


def _array(value: Any, dtype: Any, ndim: int) -> bool:
    return (
        type(value) is numpy.ndarray
        and value.dtype == dtype
        and value.ndim == ndim
        and value.flags.c_contiguous
        and value.flags.writeable
    )


def _signed(key: int) -> int:
    """A 64-bit key as the int64 holding its bits."""
    key &= _MASK64
    return key - (1 << 64) if key >= 1 << 63 else key


def _rate(p: float) -> tuple[float, float, float]:
    """``(p, qn, second)``: the binomial's inversion constants for ``min(p, 1 - p)``, as fim_draws has them."""
    if p == 0.0:
        return 0.0, 1.0, 0.0
    return (p, *inversion_constants(p if p <= 0.5 else 1.0 - p))
