"""The one exception family users catch: every bad input surfaces as a ``StatefulsetError``."""

from __future__ import annotations

import operator

import numpy


class StatefulsetError(Exception):
    """Bad input: a missing or corrupt shard, a bad spec, a state that does not fit.

    The message always says what is wrong and where (file, field or rank).
    """


class SequenceIndexError(StatefulsetError, IndexError):
    """A sequence index outside ``[-len(ds), len(ds))``.

    Also an ``IndexError`` so that Python's sequence protocol (iteration, ``in``) works.
    """


def check_int(
    name: str, value: object, low: int = 0, where: str = "", *, high: int | None = None, none_ok: bool = False
) -> int | None:
    """``value`` as an int in ``[low, high]``, or a ``StatefulsetError`` naming ``where`` and ``name``.

    Rejects bools (``True`` is an int to Python, never a count here) and floats; accepts numpy
    integers. ``none_ok`` lets None through.
    """
    if value is None and none_ok:
        return None
    try:
        number = None if isinstance(value, bool) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = None
    if number is None or number < low or (high is not None and number > high):
        kind = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
        prefix = f"{where}: " if where else ""
        raise StatefulsetError(f"{prefix}{name} must be {kind}{' or None' if none_ok else ''}, got {value!r}")
    return number


def check_int_array(name: str, value: object) -> numpy.ndarray:
    """``value`` as a 1-D integer numpy array, or a ``StatefulsetError`` naming ``name``."""
    array = numpy.asarray(value)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise StatefulsetError(f"{name} must be a 1-D integer array, got {array.dtype} with shape {array.shape}")
    return array
