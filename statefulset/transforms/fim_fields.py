"""The per-token fields of a sample that FillInTheMiddle rearranges, and its document fields afterwards.

Before the pieces move, each of the ``seq_length + 1`` tokens gets its loss (``loss_mask`` shifted
onto the tokens) and its document (from ``cu_seqlens``); the padding bestfit appended is found
and left out of FIM. After, ``cu_seqlens``, ``max_seqlen`` and ``position_ids`` are rebuilt from
the runs of equal documents in the output (statefulset's rule, docs/transforms.md).
"""

from __future__ import annotations

import itertools

import numpy

from statefulset.errors import StatefulsetError
from statefulset.streams.documents import Pieces, document_fields
from statefulset.transforms.sample import TokenSample


def set_document_fields(out: TokenSample, sample: TokenSample, docs: numpy.ndarray, seq_length: int) -> None:
    """``cu_seqlens``, ``max_seqlen``, ``position_ids`` of the permuted documents (statefulset's rule)."""
    lengths = numpy.array([b - a for a, b in runs_of(docs)], dtype=numpy.int64)
    pieces = Pieces(numpy.array([lengths.size]), lengths, numpy.array([seq_length + 1]))
    fields = document_fields(pieces, seq_length)
    out.cu_seqlens = fields["cu_seqlens"][0].copy()
    if sample.max_seqlen is not None:
        top = fields["max_seqlen"][0]
        out.max_seqlen = numpy.asarray(top) if isinstance(sample.max_seqlen, numpy.ndarray) else numpy.int32(top)
    if sample.position_ids is not None:
        out.position_ids = fields["position_ids"][0].copy()


def runs_of(docs: numpy.ndarray) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of equal values."""
    if docs.size == 0:
        return []
    cuts = (numpy.flatnonzero(docs[1:] != docs[:-1]) + 1).tolist()
    bounds = [0, *cuts, int(docs.size)]
    return list(itertools.pairwise(bounds))


def token_mask(sample: TokenSample, width: int) -> numpy.ndarray | None:
    """Per token: 1 where it is a label with loss (``loss_mask`` shifted by one); token 0 as token 1."""
    if sample.loss_mask is None:
        return None
    given = numpy.asarray(sample.loss_mask, dtype=numpy.float32)
    if given.shape != (width - 1,):
        raise StatefulsetError(
            f"FillInTheMiddle: sample {sample.sample_id} ({sample.source}): loss_mask has shape {given.shape}, "
            f"not [{width - 1}] (one per label text[1:])"
        )
    mask = numpy.empty(width, dtype=numpy.float32)
    mask[1:] = given
    mask[0] = given[0]
    return mask


def document_of_tokens(sample: TokenSample, width: int) -> numpy.ndarray:
    """Each of the ``seq_length + 1`` tokens' document, from ``cu_seqlens`` (one document without it)."""
    if sample.cu_seqlens is None:
        return numpy.zeros(width, dtype=numpy.int64)
    cu = numpy.asarray(sample.cu_seqlens, dtype=numpy.int64)
    starts = numpy.unique(cu[(cu > 0) & (cu < width - 1)])
    return numpy.searchsorted(starts, numpy.arange(width), side="right").astype(numpy.int64)


def tail_start(text: numpy.ndarray, mask: numpy.ndarray | None) -> int:
    """Where the sample's padding begins (bestfit's: one value, no loss, to the end): never FIM'd.

    Trailing tokens of other values without loss (a §16 prompt cut by the sample's end) are content.
    """
    if mask is None:
        return text.size
    content = numpy.flatnonzero((mask != 0) | (text != text[-1]))
    return int(content[-1]) + 1 if content.size else 0


def pad_document(docs: numpy.ndarray, tail: int) -> int:
    """The document that added padding joins: the padding segment the sample ends with, else a new one."""
    if tail < docs.size and (tail == 0 or docs[tail] != docs[tail - 1]) and docs[tail] == docs[-1]:
        return int(docs[-1])
    return -1
