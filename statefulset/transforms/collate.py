"""The batch an encoder without ``batch`` gets: encoded samples collated as the loader collates its own.

A dict of tensors: ``text`` int64 ``[B, S+1]``, ``sample_id`` int64 ``[B]`` and the dataset's other
fields, then the fields the encoder added. A field is stacked into one tensor when every sample
holds an array (or tensor, or number) of one shape and dtype; otherwise it is a list, one entry
per sample. ``source`` (a string per sample) is left out, as batches without an encoder have none.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import numpy
import torch

from statefulset.errors import StatefulsetError
from statefulset.transforms.sample import TokenSample

_SKIPPED = ("source",)
_OWN = tuple(f.name for f in dataclasses.fields(TokenSample))  # what a TokenSample is made with


def sample_fields(sample: Any, who: str) -> dict[str, Any]:
    """An encoded sample's fields by name: a TokenSample's, a dict's, or a dataclass's."""
    if isinstance(sample, TokenSample):
        missing = [name for name in _OWN if name not in vars(sample)]
        if missing:  # deleted (a dataclass attribute can be)
            raise StatefulsetError(
                f"{who}: encode_sample's sample {vars(sample).get('sample_id', '?')} has no {missing[0]!r} "
                "(a TokenSample keeps every field it was made with; set one to None to leave it out)"
            )
        return {k: v for k, v in sample.fields().items() if k not in _SKIPPED}
    if isinstance(sample, dict):
        return {k: v for k, v in sample.items() if k not in _SKIPPED}
    if dataclasses.is_dataclass(sample) and not isinstance(sample, type):
        return {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample) if f.name not in _SKIPPED}
    raise StatefulsetError(
        f"{who}: encode_sample returned a {type(sample).__name__}; without a batch() method the loader collates "
        "TokenSamples, dicts or dataclasses (define batch() to build other batches)"
    )


def _as_array(value: Any) -> numpy.ndarray | torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, numpy.ndarray | numpy.generic):
        return numpy.asarray(value)
    if isinstance(value, bool | numbers.Integral | numbers.Real) and not isinstance(value, str):
        return numpy.asarray(value)  # int -> int64, float -> float64, bool -> bool
    return None


def stack(values: list[Any]) -> Any:
    """One tensor ``[B, ...]`` when every value is an array of one shape and dtype, else the list."""
    arrays = [_as_array(v) for v in values]
    if any(a is None for a in arrays):
        return list(values)
    if all(isinstance(a, torch.Tensor) for a in arrays):
        first = arrays[0]
        if all(a.shape == first.shape and a.dtype == first.dtype for a in arrays):
            return torch.stack(arrays)  # type: ignore[arg-type]
        return list(values)
    if any(isinstance(a, torch.Tensor) for a in arrays) or arrays[0].dtype.hasobject:  # type: ignore[union-attr]
        return list(values)
    first = arrays[0]
    if not all(a.shape == first.shape and a.dtype == first.dtype for a in arrays):  # type: ignore[union-attr]
        return list(values)
    try:
        return torch.from_numpy(numpy.stack(arrays))  # type: ignore[arg-type]
    except TypeError:  # a dtype torch has no tensor for (strings, records)
        return list(values)


def collate(samples: list[Any], who: str) -> dict[str, Any]:
    """The samples as one batch (see the module's docstring); every sample must hold the same fields."""
    rows = [sample_fields(s, who) for s in samples]
    names = list(rows[0])
    for i, row in enumerate(rows[1:], 1):
        if list(row) != names:
            raise StatefulsetError(
                f"{who}: encoded samples of one micro-batch hold different fields (row 0: {names}, row {i}: "
                f"{list(row)}); define batch() to collate them"
            )
    return {name: stack([row[name] for row in rows]) for name in names}
