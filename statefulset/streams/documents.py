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
from statefulset.streams.field_targets import FieldTargets, data_address

DOCUMENT_FIELDS = ("cu_seqlens", "max_seqlen", "position_ids")
# How the document fields of a batch travel from a DataLoader worker: its pieces, not the fields
# (which are ~100x their bytes); the trainer computes the fields from them (fields_from_wire).
WIRE = "document_pieces"


@dataclass
class Pieces:
    """The documents inside each row of a gathered batch."""

    counts: numpy.ndarray  # int64 [B]: pieces in each row
    lengths: numpy.ndarray  # int64, row after row: each piece's tokens
    used: numpy.ndarray  # int64 [B]: real tokens of each row (seq_length + 1 unless padded)
    # int64: counts, used, then exactly the lengths, of which the three are views (packed_pieces): the
    # kernels' input and the wire's layout, made once instead of concatenated per batch.
    packed: numpy.ndarray | None = None

    def for_rows(self, rows: numpy.ndarray) -> Pieces:
        """The pieces of ``rows`` (in that order)."""
        first = numpy.cumsum(self.counts) - self.counts
        counts = self.counts[rows]
        at = numpy.repeat(first[rows], counts) + within_rows(counts)
        return Pieces(counts, self.lengths[at], self.used[rows])


def packed_pieces(values: Any, rows: int) -> Pieces:
    """:class:`Pieces` of ``rows`` rows from one flat sequence (a list is converted in one call): the
    counts, the used tokens, then the lengths, as :attr:`Pieces.packed` holds them."""
    flat = numpy.ascontiguousarray(values, dtype=numpy.int64)
    return Pieces(flat[:rows], flat[2 * rows :], flat[rows : 2 * rows], flat)


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
    pieces: Pieces,
    seq_length: int,
    positions: numpy.ndarray | None = None,
    native: bool | None = None,
    out: dict[str, numpy.ndarray] | None = None,
) -> dict[str, numpy.ndarray]:
    """``cu_seqlens`` int32 ``[B, S+1]``, ``max_seqlen`` int32 ``[B]``, ``position_ids`` int64 ``[B, S]``.

    One pass of the compiled kernel when available (``native`` as in :func:`compiled.pick`),
    straight into ``out``'s arrays when they have those shapes and dtypes (a worker's ring slot);
    the numpy version below gives the same arrays, and the error messages.
    """
    rows = pieces.counts.size
    if rows == 0:
        return _empty(seq_length)
    lib = compiled.pick(native)
    if lib is not None:
        found = _fields_compiled(lib, pieces, seq_length, out or {})
        if found is not None:
            return found
    return _document_fields_numpy(pieces, seq_length, positions)


def _fields_compiled(
    lib: Any, pieces: Pieces, seq_length: int, given: dict[str, numpy.ndarray], targets: FieldTargets | None = None
) -> dict[str, numpy.ndarray] | None:
    """The kernel's fields, into ``targets`` (made from ``given``'s arrays, a ring slot's, when None),
    or None where the kernel refuses the pieces."""
    rows = pieces.counts.size
    targets = FieldTargets(rows, seq_length, given) if targets is None else targets
    packed = pieces.packed  # the kernel checks its counts against its lengths itself
    if packed is None:
        total = int(pieces.counts.sum())
        if pieces.lengths.size < total:
            raise StatefulsetError(f"internal: {pieces.lengths.size} piece lengths for {total} pieces")
        packed = numpy.concatenate([pieces.counts, pieces.used, pieces.lengths]).astype(numpy.int64, copy=False)
    # The kernel gets raw addresses: every array behind one is held by this frame (packed) or by
    # targets until the call returns.
    code = lib.sf_document_fields(data_address(packed), packed.size, rows, seq_length, *targets.request[:3])
    return targets.fields if code == 0 else None


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


def field_layout(
    seq_length: int, token_dtype: numpy.dtype, boundaries: bool, padded: bool, wire: bool = False
) -> list[FieldSpec]:
    """The fields of a micro-batch's rows, in the order they travel: ``text`` first; ``padded``: rows
    carry a ``loss_mask`` (packing bestfit, or a source with a loss-mask shard). ``wire``: the
    document fields travel as their pieces (:data:`WIRE`, see :func:`fields_from_wire`)."""
    layout = [FieldSpec("text", (seq_length + 1,), numpy.dtype(token_dtype))]
    if padded:
        layout.append(FieldSpec("loss_mask", (seq_length,), numpy.dtype(numpy.float32)))
    if boundaries and wire:
        layout.append(FieldSpec(WIRE, (seq_length + 3,), numpy.dtype(numpy.int64)))
    elif boundaries:
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

    ``out`` (name -> array) receives them in place, ``text`` possibly in a narrower dtype. A stream
    with loss-mask shards (``stream.masked``) reads each token's mask along the tokens' ranges: its
    ``loss_mask`` covers bestfit padding too (:mod:`statefulset.streams.label_masks`).
    """
    out = {} if out is None else out
    padded, masked = stream.padded, stream.masked
    if not boundaries and not padded and not masked:
        out["text"] = stream.gather(positions, out=out.get("text"))
        return out
    # The document fields written by the batch kernel itself, in the call that copies the rows (no
    # pieces handed to Python and back), where the stream has one; else computed from the pieces.
    rows = positions.size if isinstance(positions, numpy.ndarray) else numpy.asarray(positions).size
    targets, lib = None, compiled.library()
    if boundaries and WIRE not in out and rows and lib is not None:  # pieces not copied out where unused
        targets = FieldTargets(rows, stream.seq_length, out, keep=padded or masked)
    documents = targets.request if targets is not None else None
    if masked:
        given = out.get("loss_mask")
        text, pieces, labels = stream.gather_masked(
            positions, out=out.get("text"), want=boundaries, labels=given, documents=documents
        )
        if labels is not given:
            _put(out, "loss_mask", labels)
    else:
        text, pieces = stream.gather_pieces(positions, out=out.get("text"), documents=documents)
    out["text"] = text
    if padded and not masked:
        _put(out, "loss_mask", loss_mask(pieces.used, stream.seq_length))
    if boundaries and WIRE in out:
        to_wire(pieces, out[WIRE], stream.seq_length, positions)
    elif boundaries:
        found = None
        if targets is not None:  # computed apart where the batch kernel did not write them
            found = (
                targets.fields if targets.written else _fields_compiled(lib, pieces, stream.seq_length, out, targets)
            )
        if found is None:  # no kernels, or refused: the numpy rule, which names what is wrong
            found = document_fields(pieces, stream.seq_length, positions, out=out)
        for name, value in found.items():
            if out.get(name) is not value:
                _put(out, name, value)
    return out


def _put(out: dict[str, numpy.ndarray], name: str, value: numpy.ndarray) -> None:
    if name in out:
        out[name][...] = value
    else:
        out[name] = value


def to_wire(pieces: Pieces, wire: numpy.ndarray, seq_length: int, positions: numpy.ndarray | None = None) -> None:
    """Write a batch's pieces into ``wire`` (int64 ``[B, S+3]``, read flat): counts ``[B]``, used ``[B]``,
    then the lengths, row after row: the input of the document fields kernel, a few hundred bytes.

    Rows with more pieces than ``cu_seqlens`` has room for are refused here, as
    :func:`document_fields` refuses them; every other check is the trainer's (:func:`fields_from_wire`).
    """
    rows, lengths = pieces.counts.size, pieces.lengths
    flat = wire.reshape(-1)  # a C-contiguous ring slot: a view
    packed = pieces.packed
    if packed is not None and packed.size <= flat.size:  # the wire's own layout: one copy
        flat[: packed.size] = packed
        return
    if 2 * rows + lengths.size > flat.size:  # only the first counts.sum() lengths are pieces
        total = int(pieces.counts.sum())
        if total > flat.size - 2 * rows or lengths.size < total:
            _document_fields_numpy(pieces, seq_length, positions)  # raises, naming the sample
            raise StatefulsetError(f"internal: {total} document pieces for {rows} rows of {seq_length + 1} tokens")
        lengths = lengths[:total]
    # One numpy call: each costs ~1.5 µs, more than these few hundred bytes.
    numpy.concatenate((pieces.counts, pieces.used, lengths), out=flat[: 2 * rows + lengths.size], casting="same_kind")


def fields_from_wire(
    wire: numpy.ndarray,
    seq_length: int,
    out: dict[str, numpy.ndarray],
    positions: Any,
    native: bool | None = None,
) -> None:
    """The document fields of ``count`` batches from what :func:`to_wire` wrote (int64 ``[count, B, S+3]``)
    into ``out``'s arrays (``cu_seqlens`` int32 ``[count, B, S+1]``, ``max_seqlen`` int32 ``[count, B]``,
    ``position_ids`` int64 ``[count, B, S]``): one kernel call for them all, the same values as
    :func:`document_fields`. ``positions(i)``: batch ``i``'s stream positions, for error messages.
    """
    count, rows = wire.shape[0], wire.shape[1]
    shapes = {"cu_seqlens": (count, rows, seq_length + 1), "max_seqlen": (count, rows),
              "position_ids": (count, rows, seq_length)}  # fmt: skip
    if wire.shape != (count, rows, seq_length + 3) or any(out[k].shape != v for k, v in shapes.items()):
        raise StatefulsetError(f"internal: document fields of shapes {wire.shape} -> {[out[k].shape for k in shapes]}")
    lib = compiled.pick(native)
    first = 0
    if lib is not None and count and rows:
        code = lib.sf_document_fields_batches(
            compiled.address(wire, numpy.int64), count, rows * (seq_length + 3), rows, seq_length,
            compiled.address(out["cu_seqlens"], numpy.int32), compiled.address(out["max_seqlen"], numpy.int32),
            compiled.address(out["position_ids"], numpy.int64),
        )  # fmt: skip
        if code == 0:
            return
        first = (abs(int(code)) - 1) // rows  # the batch at fault: again in numpy, for its message
    for i in range(first, count):
        flat = wire[i].reshape(-1)
        counts, used = flat[:rows].copy(), flat[rows : 2 * rows].copy()
        total = int(counts.sum())
        if (counts < 0).any() or total > flat.size - 2 * rows:
            raise StatefulsetError(f"internal: batch {i} of a bundle has {total} document pieces for {rows} rows")
        found = _document_fields_numpy(Pieces(counts, flat[2 * rows : 2 * rows + total].copy(), used),
                                       seq_length, numpy.asarray(positions(i)))  # fmt: skip
        for name in DOCUMENT_FIELDS:
            out[name][i][...] = found[name]
        if lib is not None:
            raise StatefulsetError(f"internal: the document fields kernel refused batch {i}, the numpy rule did not")
