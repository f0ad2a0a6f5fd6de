"""One key's texts of a chunk into its arrays: tokens, sequence lengths, sequences per document and,
where a line held a segment list, the loss mask (:mod:`statefulset.tools.segments`), all vectorised."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy

from statefulset.tools import segments


@dataclass
class KeyArrays:
    tokens: numpy.ndarray
    sequence_lengths: numpy.ndarray
    sequences_per_document: numpy.ndarray
    loss_mask: numpy.ndarray | None = None  # uint8 per token when the chunk held a segment list (tools/segments.py)


def narrow(tokens: numpy.ndarray, dtype: numpy.dtype) -> numpy.ndarray:
    """Send tokens back in the shard's dtype (a quarter of int64's bytes for uint16) when they
    fit; ones that do not fit stay wide so that the writer reports them."""
    if dtype.kind in "iu" and tokens.size:
        info = numpy.iinfo(dtype)
        if tokens.min() < info.min or tokens.max() > info.max:
            return tokens
    return tokens.astype(dtype)


def assemble(tokens, lengths, owner, documents, eod, mask=None, last_loss=None) -> KeyArrays:
    """Drop empty sequences and append the end-of-document token (with the loss of the sequence's
    last text, ``last_loss``, in ``mask``), all vectorised."""
    keep = lengths > 0
    seq_lengths, seq_owner = lengths[keep], owner[keep]
    per_doc = numpy.bincount(seq_owner, minlength=documents).astype(numpy.int64)
    if eod is not None and seq_lengths.size:
        last = numpy.flatnonzero(numpy.r_[seq_owner[1:] != seq_owner[:-1], True])
        doc_ends = numpy.cumsum(seq_lengths)[last]
        tokens = numpy.insert(tokens, doc_ends, eod)
        if mask is not None:
            mask = numpy.insert(mask, doc_ends, last_loss[keep][last])
        seq_lengths = seq_lengths.copy()
        seq_lengths[last] += 1
    return KeyArrays(tokens, seq_lengths, per_doc, mask)


@dataclass
class KeyTexts:
    """One key's texts of a chunk: each text's sequence and loss, each sequence's document."""

    texts: list[str] = field(default_factory=list)
    text_sequence: list[int] = field(default_factory=list)
    losses: list[bool] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    segmented: bool = False

    def add(self, value: segments.Value, document: int) -> None:
        first = len(self.owners)
        if value.segments:
            self.text_sequence += [first] * len(value.texts)
            self.owners.append(document)
            self.segmented = True
        else:
            self.text_sequence += range(first, first + len(value.texts))
            self.owners += [document] * len(value.texts)
        self.texts += value.texts
        self.losses += value.losses

    def encode(self, tokenizer, documents: int, eod: int | None, dtype: numpy.dtype) -> KeyArrays:
        tokens, text_lengths = tokenizer.encode_batch(self.texts)
        owner = numpy.asarray(self.owners, dtype=numpy.int64)
        if not self.segmented:  # each text a sequence: no mask
            assembled = assemble(tokens, numpy.asarray(text_lengths, dtype=numpy.int64), owner, documents, eod)
        else:
            which = numpy.asarray(self.text_sequence, dtype=numpy.int64)
            text_lengths = numpy.asarray(text_lengths, dtype=numpy.int64)
            lengths = numpy.bincount(which, weights=text_lengths, minlength=owner.size).astype(numpy.int64)
            losses = numpy.asarray(self.losses, dtype=bool)
            last_loss = numpy.ones(owner.size, dtype=bool)
            last_loss[which] = losses  # the last text of each sequence wins
            mask = segments.piece_masks(losses, text_lengths)
            assembled = assemble(tokens, lengths, owner, documents, eod, mask, last_loss)
        assembled.tokens = narrow(assembled.tokens, dtype)
        return assembled
