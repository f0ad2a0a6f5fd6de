"""Fill-in-the-middle in token mode, as index arithmetic: the rules and draws of
:mod:`statefulset.transforms.fim`, without an array per piece.

The sample's segments (document runs, split at EOD tokens; fragments at split tokens) are walked
in order, drawing exactly as before (the rate, the two cut points, the SPM choice); each output
piece is recorded as a range of the input (the text with the three sentinels appended), and the
output is then gathered in one step: ``tokens = source[index]``, the token documents and loss
mask likewise, the sentinels' documents and mask values written afterwards. Outputs are bit for
bit the per-piece implementation's (``tests/test_fim_pinned.py``).
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

import numpy

from statefulset.errors import StatefulsetError

# Where a FIM's three sentinels lie among its six pieces: PSM <P> . <S> . <M> ., SPM <P> <S> . <M> . .
_PSM = numpy.array([0, 2, 4])
_SPM = numpy.array([0, 1, 3])
# The output tokens, their loss mask (None: the sample has none) and their documents.
Gathered = tuple[numpy.ndarray, "numpy.ndarray | None", numpy.ndarray]


class _Pieces:
    """The output as ranges of the source (``starts[k]``, ``lengths[k]``; a sentinel is the range of
    one of the three tokens appended to the text), and each FIM's first piece, layout, document and
    sentinel mask value."""

    def __init__(self, width: int) -> None:
        self.starts: list[int] = []
        self.lengths: list[int] = []
        self.fims: list[tuple[int, int, int, float]] = []  # (first piece, SPM?, document, sentinel mask)
        self.width = width  # source index of the prefix sentinel; middle +1, suffix +2

    def keep(self, a: int, b: int) -> None:
        """Input tokens ``[a, b)``, joined to the previous range when it ends at ``a`` (a sentinel's
        range lies past the text: it never does)."""
        if b <= a:
            return
        if self.starts and self.starts[-1] + self.lengths[-1] == a:
            self.lengths[-1] += b - a
            return
        self.starts.append(a)
        self.lengths.append(b - a)

    def fim(self, a: int, lo: int, hi: int, b: int, spm: int, doc: int, mask: float) -> None:
        """PSM ``<P> [a, lo) <S> [hi, b) <M> [lo, hi)`` or SPM ``<P> <S> [hi, b) <M> [a, lo) [lo, hi)``."""
        w = self.width
        self.fims.append((len(self.starts), spm, doc, mask))
        if spm:
            self.starts.extend((w, w + 2, hi, w + 1, a, lo))
            self.lengths.extend((1, 1, b - hi, 1, lo - a, hi - lo))
        else:
            self.starts.extend((w, a, w + 2, hi, w + 1, lo))
            self.lengths.extend((1, lo - a, 1, b - hi, 1, hi - lo))


def token_fim(
    fim: Any, text: numpy.ndarray, mask: numpy.ndarray | None, docs: numpy.ndarray, tail: int, draws: Any
) -> Gathered | None:
    """The FIM'd sample's tokens, loss mask and token documents (cut to the sample's width), or None
    when no segment changed (see the module's docstring)."""
    width = text.size
    pieces = _Pieces(width)
    changed = False
    eods = numpy.flatnonzero(text[:tail] == fim.eod_id).tolist() if fim.eod_id is not None else []
    splits = numpy.flatnonzero(text[:tail] == fim.split_sample).tolist() if fim.split_sample is not None else []
    unit = _Unit(fim, text, mask, pieces, draws)
    for start, end in _runs(docs, tail):
        doc = int(docs[start])
        current = start
        at = bisect.bisect_left(eods, start)
        while at < len(eods) and eods[at] < end:  # EOD tokens stay in place (Megatron-LM's segments)
            loc = eods[at]
            if loc > current:
                changed |= unit.segment(current, loc, doc, splits)
            pieces.keep(loc, loc + 1)
            current = loc + 1
            at += 1
        if end > current:
            changed |= unit.segment(current, end, doc, splits)
    if not changed:
        return None
    if tail < width:  # padding (or trailing masked tokens): kept, never FIM'd
        pieces.keep(tail, width)
    return _gather(pieces, text, mask, docs, fim)


def _runs(docs: numpy.ndarray, tail: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of equal documents in ``docs[:tail]``."""
    if tail == 0:
        return []
    cuts = (numpy.flatnonzero(docs[1:tail] != docs[: tail - 1]) + 1).tolist()
    bounds = [0, *cuts, tail]
    return list(itertools.pairwise(bounds))


class _Unit:
    """One segment or fragment at a time: the draws and pieces of tokenizer mode's walk
    (:func:`~statefulset.transforms.fim_text.text_edits`)."""

    def __init__(self, fim: Any, text: numpy.ndarray, mask: numpy.ndarray | None, pieces: _Pieces, draws: Any) -> None:
        self.fim, self.text, self.mask, self.pieces, self.draws = fim, text, mask, pieces, draws
        self.no_prefix = fim.no_prefix if isinstance(fim.no_prefix, tuple) else None

    def segment(self, a: int, b: int, doc: int, splits: list[int]) -> bool:
        """A segment, split at ``split_sample`` when it holds that token (Megatron-LM's rule)."""
        lo = bisect.bisect_left(splits, a)
        if lo == len(splits) or splits[lo] >= b:
            return self.permute(a, b, doc, self.fim.rate)
        if not self.draws.binomial(self.fim.rate):
            self.pieces.keep(a, b)
            return False
        changed = False
        current = a
        for loc in [*splits[lo : bisect.bisect_left(splits, b)], b]:
            if loc > current:  # an empty fragment is no FIM
                changed |= self.permute(current, loc, doc, self.fim.fragment_rate)
            if loc < b:
                self.pieces.keep(loc, loc + 1)
            current = loc + 1
        return changed

    def permute(self, a: int, b: int, doc: int, rate: float) -> bool:
        """FIM ``[a, b)`` with probability ``rate`` (Megatron-LM's draws: the rate, the cut points, SPM)."""
        if not self.draws.binomial(rate):
            self.pieces.keep(a, b)
            return False
        prefix = self.no_prefix
        if prefix is not None and b - a >= len(prefix) and bool((self.text[a : a + len(prefix)] == prefix).all()):
            self.pieces.keep(a, b)
            return False
        lo, hi, spm = self.draws.cut(b - a, self.fim.spm_rate)
        value = 1.0 if self.mask is None else float(self.mask[a:b].max())
        self.pieces.fim(a, a + lo, a + hi, b, spm, doc, value)
        return True


def _gather(
    pieces: _Pieces, text: numpy.ndarray, mask: numpy.ndarray | None, docs: numpy.ndarray, fim: Any
) -> Gathered:
    width = text.size
    source = numpy.empty(width + 3, dtype=numpy.int64)
    source[:width] = text
    source[width:] = (fim.prefix_id, fim.middle_id, fim.suffix_id)
    starts = numpy.array(pieces.starts, dtype=numpy.int64)
    lengths = numpy.array(pieces.lengths, dtype=numpy.int64)
    ends = numpy.cumsum(lengths)
    offsets = ends - lengths
    total = int(ends[-1])
    if total < width:
        raise StatefulsetError(f"internal: token-mode FIM gave {total} tokens for a sample of {width}")
    index = numpy.arange(width, dtype=numpy.int64) + numpy.repeat(starts - offsets, lengths)[:width]
    tokens = source[index]
    # Documents are numbered in order (fim_fields.document_of_tokens): one document throughout stays one.
    one_document = docs[0] == docs[-1]
    out_docs = docs
    if not one_document:
        docs_source = numpy.zeros(width + 3, dtype=numpy.int64)
        docs_source[:width] = docs
        out_docs = docs_source[index]
    out_mask = None
    if mask is not None:
        mask_source = numpy.zeros(width + 3, dtype=numpy.float32)
        mask_source[:width] = mask
        out_mask = mask_source[index]
    if pieces.fims and (out_mask is not None or not one_document):  # each FIM's sentinels: its document, mask
        fims = numpy.array(pieces.fims, dtype=numpy.float64)
        layout = numpy.where(fims[:, 1:2] != 0, _SPM, _PSM) + fims[:, 0:1].astype(numpy.int64)
        at = offsets[layout].ravel()
        inside = at < width
        if not one_document:
            out_docs[at[inside]] = numpy.repeat(fims[:, 2].astype(numpy.int64), 3)[inside]
        if out_mask is not None:
            out_mask[at[inside]] = numpy.repeat(fims[:, 3].astype(numpy.float32), 3)[inside]
    return tokens, out_mask, out_docs
