"""The fields beside ``text``: document boundaries (``cu_seqlens``, ``max_seqlen``, ``position_ids``) and ``loss_mask``.

Every packing describes a sample of ``seq_length + 1`` tokens as its *pieces*: the lengths of the
parts of shard sequences (documents) it holds, in order, followed by padding up to ``used``
(packing bestfit only). Boundaries come from there, that is from the shard index, never from
scanning for an EOD token.

The document fields follow megatron-core 0.19's ``GPTDataset(inter_document_masking=True)``:
the segments of the ``seq_length + 1`` tokens are the pieces (then the padding, if any); the last
segment loses the extra token (the one only a label sees) and disappears if that empties it;
``cu_seqlens`` (int32 ``[S+1]``) are their cumulative ends, padded with ``S``; ``max_seqlen`` is the
longest segment; ``position_ids`` restart at 0 where each segment starts. Padding is a segment of
its own, so a padded row's ``cu_seqlens`` still end at ``S`` and no real token attends to padding.
All of it is vectorised over a batch: no Python loop per document, no ``S x S`` mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy

from statefulset.errors import StatefulsetError
from statefulset.index import compiled

DOCUMENT_FIELDS = ("cu_seqlens", "max_seqlen", "position_ids")


@dataclass
class Pieces:
    """The documents inside each row of a gathered batch."""

    counts: numpy.ndarray  # int64 [B]: pieces in each row
    lengths: numpy.ndarray  # int64, row after row: each piece's tokens
    used: numpy.ndarray  # int64 [B]: real tokens of each row (seq_length + 1 unless padded)

    def for_rows(self, rows: numpy.ndarray) -> Pieces:
        """The pieces of ``rows`` (in that order)."""
        first = numpy.cumsum(self.counts) - self.counts
        counts = self.counts[rows]
        at = numpy.repeat(first[rows], counts) + within_rows(counts)
        return Pieces(counts, self.lengths[at], self.used[rows])


def within_rows(counts: numpy.ndarray) -> numpy.ndarray:
    """0, 1, ..., counts[i] - 1 for each row, concatenated."""
    total = int(counts.sum())
    return numpy.arange(total, dtype=numpy.int64) - numpy.repeat(numpy.cumsum(counts) - counts, counts)


def merge_pieces(size: int, parts: list[tuple[numpy.ndarray, Pieces]]) -> Pieces:
    """One :class:`Pieces` for ``size`` rows from the pieces of disjoint row sets (one per source)."""
    counts = numpy.zeros(size, dtype=numpy.int64)
    used = numpy.zeros(size, dtype=numpy.int64)
    for rows, part in parts:
        counts[rows] = part.counts
        used[rows] = part.used
    first = numpy.cumsum(counts) - counts
    lengths = numpy.empty(int(counts.sum()), dtype=numpy.int64)
    for rows, part in parts:
        lengths[numpy.repeat(first[rows], part.counts) + within_rows(part.counts)] = part.lengths
    return Pieces(counts, lengths, used)


def document_fields(
    pieces: Pieces, seq_length: int, positions: numpy.ndarray | None = None, native: bool | None = None
) -> dict[str, numpy.ndarray]:
    """``cu_seqlens`` int32 ``[B, S+1]``, ``max_seqlen`` int32 ``[B]``, ``position_ids`` int64 ``[B, S]``.

    One pass of the compiled kernel when available (``native`` as in :func:`compiled.pick`); the
    numpy version below gives the same arrays, and the error messages.
    """
    rows = pieces.counts.size
    if rows == 0:
        return _empty(seq_length)
    lib = compiled.pick(native)
    if lib is not None:
        out = {
            "cu_seqlens": numpy.empty((rows, seq_length + 1), dtype=numpy.int32),
            "max_seqlen": numpy.empty(rows, dtype=numpy.int32),
            "position_ids": numpy.empty((rows, seq_length), dtype=numpy.int64),
        }
        counts = numpy.ascontiguousarray(pieces.counts, dtype=numpy.int64)
        lengths = numpy.ascontiguousarray(pieces.lengths, dtype=numpy.int64)
        used = numpy.ascontiguousarray(pieces.used, dtype=numpy.int64)
        if lengths.size < int(counts.sum()):
            raise StatefulsetError(f"internal: {lengths.size} piece lengths for {int(counts.sum())} pieces")
        i64, i32 = numpy.int64, numpy.int32
        code = lib.sf_document_fields(
            *(compiled.address(a, i64) for a in (counts, lengths, used)),
            rows,
            seq_length,
            compiled.address(out["cu_seqlens"], i32),
            compiled.address(out["max_seqlen"], i32),
            compiled.address(out["position_ids"], i64),
        )
        if code == 0:
            return out
    return _document_fields_numpy(pieces, seq_length, positions)


def _document_fields_numpy(
    pieces: Pieces, seq_length: int, positions: numpy.ndarray | None
) -> dict[str, numpy.ndarray]:
    width = seq_length + 1
    rows = pieces.counts.size
    pad = (pieces.used < width).astype(numpy.int64)
    seg_counts = pieces.counts + pad
    first = numpy.cumsum(seg_counts) - seg_counts
    last = first + seg_counts - 1
    segments = numpy.empty(int(seg_counts.sum()), dtype=numpy.int64)
    piece_at = numpy.repeat(first, pieces.counts) + within_rows(pieces.counts)
    segments[piece_at] = pieces.lengths
    segments[last[pad == 1]] = (width - pieces.used)[pad == 1]
    if (segments[last] < 1).any():
        bad = int(numpy.flatnonzero(segments[last] < 1)[0])
        raise StatefulsetError(_where(positions, bad) + "its last document piece is empty (a broken index)")
    # The extra token leaves the last segment; an emptied segment goes (megatron-core pops it).
    segments[last] -= 1
    gone = segments[last] == 0
    if gone.any():
        keep = numpy.ones(segments.size, dtype=bool)
        keep[last[gone]] = False
        segments = segments[keep]
        seg_counts = seg_counts - gone
        first = numpy.cumsum(seg_counts) - seg_counts
    if int(seg_counts.max()) > seq_length:
        bad = int(numpy.flatnonzero(seg_counts > seq_length)[0])
        raise StatefulsetError(
            _where(positions, bad) + f"it holds {int(seg_counts[bad])} documents (empty ones included), "
            f"more than cu_seqlens has room for ({seq_length})"
        )
    row = numpy.repeat(numpy.arange(rows, dtype=numpy.int64), seg_counts)
    ends = numpy.cumsum(segments) - row * seq_length
    cu_seqlens = numpy.full((rows, width), seq_length, dtype=numpy.int32)
    cu_seqlens[:, 0] = 0
    cu_seqlens[row, within_rows(seg_counts) + 1] = ends
    max_seqlen = numpy.maximum.reduceat(segments, first).astype(numpy.int32)
    starts = ends - segments
    position_ids = numpy.tile(numpy.arange(seq_length, dtype=numpy.int64), rows) - numpy.repeat(starts, segments)
    return {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, "position_ids": position_ids.reshape(rows, seq_length)}


def loss_mask(used: numpy.ndarray, seq_length: int) -> numpy.ndarray:
    """float32 ``[B, S]``: 1 where the label ``text[i + 1]`` is a real token, 0 where it is padding."""
    return (numpy.arange(1, seq_length + 1, dtype=numpy.int64)[None, :] < used[:, None]).astype(numpy.float32)


def _empty(seq_length: int) -> dict[str, numpy.ndarray]:
    return {
        "cu_seqlens": numpy.empty((0, seq_length + 1), dtype=numpy.int32),
        "max_seqlen": numpy.empty(0, dtype=numpy.int32),
        "position_ids": numpy.empty((0, seq_length), dtype=numpy.int64),
    }


def _where(positions: numpy.ndarray | None, row: int) -> str:
    if positions is None:
        return f"document boundaries of row {row}: "
    return f"document boundaries of the sample at position {int(positions[row])}: "


def field_layout(seq_length: int, token_dtype: numpy.dtype, boundaries: bool, padded: bool) -> list[FieldSpec]:
    """The fields of a micro-batch's rows, in the order they travel: ``text`` first."""
    layout = [FieldSpec("text", (seq_length + 1,), numpy.dtype(token_dtype))]
    if padded:
        layout.append(FieldSpec("loss_mask", (seq_length,), numpy.dtype(numpy.float32)))
    if boundaries:
        layout += [
            FieldSpec("cu_seqlens", (seq_length + 1,), numpy.dtype(numpy.int32)),
            FieldSpec("max_seqlen", (), numpy.dtype(numpy.int32)),
            FieldSpec("position_ids", (seq_length,), numpy.dtype(numpy.int64)),
        ]
    return layout


@dataclass(frozen=True)
class FieldSpec:
    """One field of a batch row: its name, shape per row and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: numpy.dtype


def gather_fields(
    stream: Any, positions: numpy.ndarray, boundaries: bool, out: dict[str, numpy.ndarray] | None = None
) -> dict[str, numpy.ndarray]:
    """``text`` and, as the stream and ``boundaries`` ask, ``loss_mask`` and the document fields of ``positions``.

    ``out`` (name -> array) receives them in place, ``text`` possibly in a narrower dtype.
    """
    out = {} if out is None else out
    padded = stream.padded
    if not boundaries and not padded:
        out["text"] = stream.gather(positions, out=out.get("text"))
        return out
    text, pieces = stream.gather_pieces(positions, out=out.get("text"))
    out["text"] = text
    if padded:
        _put(out, "loss_mask", loss_mask(pieces.used, stream.seq_length))
    if boundaries:
        for name, value in document_fields(pieces, stream.seq_length, positions).items():
            _put(out, name, value)
    return out


def _put(out: dict[str, numpy.ndarray], name: str, value: numpy.ndarray) -> None:
    if name in out:
        out[name][...] = value
    else:
        out[name] = value
