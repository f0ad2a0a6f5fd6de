"""``TokenSample``: one sample of the stream as a task encoder sees it (CONTRACT §15).

A plain dataclass, so that Energon-style code that reads and replaces fields works unchanged. An
encoder may change any field and add its own (plain attributes); :meth:`TokenSample.fields` lists
what the sample holds, in order: the dataset's fields first, then the ones an encoder added.
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
