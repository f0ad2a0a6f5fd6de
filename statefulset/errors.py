"""The one exception family users catch: every bad input surfaces as a ``StatefulsetError``."""

from __future__ import annotations


class StatefulsetError(Exception):
    """Bad input: a missing or corrupt shard, a bad spec, a state that does not fit.

    The message always says what is wrong and where (file, field or rank).
    """


class SequenceIndexError(StatefulsetError, IndexError):
    """A sequence index outside ``[-len(ds), len(ds))``.

    Also an ``IndexError`` so that Python's sequence protocol (iteration, ``in``) works.
    """
