"""``TokenSample``: one sample of the stream as a task encoder sees it (CONTRACT §15).

A plain dataclass, so that Energon-style code that reads and replaces fields works unchanged. An
encoder may change any field and add its own (plain attributes); :meth:`TokenSample.fields` lists
what the sample holds, in order: the dataset's fields first, then the ones an encoder added.
``text`` is a property over the instance's own attribute: a sample the loader made from a worker's
ring row holds that row in the corpus's dtype until ``text`` is first read, which widens it to int64
(what an encoder always sees), so that an encoder that never reads it costs no widening.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy

# The dataset's own fields, in the order a batch lists them.
DATASET_FIELDS = ("text", "loss_mask", "cu_seqlens", "max_seqlen", "position_ids")


@dataclass(eq=False)
class TokenSample:
    """``text``: int64 ``[seq_length + 1]``; ``sample_id``: the global position; ``source``: the
    prefix the sample came from (a blend's or stage's source); the other fields where the dataset
    has them (``loss_mask`` with packing bestfit, the document fields with ``document_boundaries``)."""

    text: numpy.ndarray
    sample_id: int
    source: str
    loss_mask: numpy.ndarray | None = None
    cu_seqlens: numpy.ndarray | None = None
    max_seqlen: Any = None
    position_ids: numpy.ndarray | None = None

    def fields(self) -> dict[str, Any]:
        """Every field the sample holds (None ones left out), the dataset's first, ``sample_id`` and
        ``source`` included."""
        out: dict[str, Any] = {}
        for name in DATASET_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        out["sample_id"] = self.sample_id
        out["source"] = self.source
        for name, value in vars(self).items():
            if name not in out and name not in DATASET_FIELDS and value is not None:
                out[name] = value
        return out


def _text(sample: TokenSample) -> numpy.ndarray:
    """``sample.text``: int64. A worker's samples hold their batch ring's own row, in the corpus's dtype,
    until the encoder first reads it: the read gives, and keeps, an int64 copy (a narrower integer
    dtype widens exactly), so a sample whose text is never read (an identity) still holds the ring's
    row, which the worker then sends as it was gathered (statefulset.loading.ring.make_ring)."""
    try:
        value = sample.__dict__["text"]
    except KeyError:  # deleted
        raise AttributeError(f"{type(sample).__name__!r} object has no attribute 'text'") from None
    if type(value) is numpy.ndarray and narrower_integers(value.dtype):
        value = sample.__dict__["text"] = numpy.array(value, dtype=_INT64)
    return value


def narrower_integers(dtype: numpy.dtype) -> bool:
    """Whether ``dtype`` holds integers that int64 holds exactly (a corpus's token dtype but int64's)."""
    return dtype.itemsize < 8 and dtype.kind in "ui"


def _set_text(sample: TokenSample, value: Any) -> None:
    sample.__dict__["text"] = value


def _delete_text(sample: TokenSample) -> None:
    try:
        del sample.__dict__["text"]
    except KeyError:
        raise AttributeError("text") from None


_INT64 = numpy.dtype(numpy.int64)
# A data descriptor over the instance's own ``text`` (which the dataclass's __init__ sets through it):
# the sample is still a plain dataclass to Energon-style code; the widening happens on a read.
TokenSample.text = property(_text, _set_text, _delete_text, doc="int64 ``[seq_length + 1]``: the sample's tokens")  # type: ignore[assignment]
