"""Where a sample came from: ``ds.explain(p)`` / ``stream.explain(p)`` / ``statefulset explain``.

A sample of ``seq_length + 1`` tokens is cut from one or more *pieces*: consecutive token runs of
the shard's sequences. :func:`explain` names them from the indices the stream already holds, in
O(1) per sample (O(log N) binary searches in the mapped ``.idx``, never a pass over the corpus):

- ``packing: megatron``: the GPTDataset sample ``k = shuffle_index[i]`` spans the rows
  ``sample_index[k][0] .. sample_index[k+1][0]`` of ``document_index`` (a blend first picks the
  part and ``i`` from ``dataset_index`` / ``dataset_sample_index``);
- ``packing: native``: local sample ``q`` of a source is window ``perm_e(q mod W)`` of epoch
  ``e = q // W``; a binary search over the sequence pointers finds the sequences it covers;
- ``packing: bestfit``: local sample ``q`` is bin ``perm_e(q mod n)`` of epoch ``e = q // n``,
  found in the stored index of its window's packing.

Concatenating the pieces' tokens gives exactly ``ds[p]["text"]`` (the tests check this), followed
by padding for a bestfit sample that does not fill up.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy

from statefulset.errors import SequenceIndexError, StatefulsetError
from statefulset.shards.tokenizers import TokenizerSpec

if TYPE_CHECKING:
    from statefulset.shards.reader import IndexedDataset
    from statefulset.streams.base import SampleStream

# Characters of decoded text shown per piece in the human-readable block.
_TEXT_PREVIEW = 240


class Decoder(Protocol):
    def decode(self, tokens: numpy.ndarray) -> str: ...


@dataclass(frozen=True)
class Piece:
    """A run of consecutive tokens of one sequence that a sample was cut from."""

    prefix: str  # the shard (path without .bin/.idx)
    sequence: int  # sequence id in the shard
    document: int  # document id in the shard (the document holding the sequence)
    offset: int  # first token of the run, counted within the sequence
    tokens: int  # tokens in the run
    bin_offset: int  # first token of the run, counted from the start of the .bin (in tokens)
    sequence_tokens: int  # length of the whole sequence
    text: str | None = None  # the run decoded, when a tokenizer was given
    # Where the shard has a loss-mask shard: the runs [first, stop) of tokens (counted within the
    # sequence, as ``offset``) whose loss counts; the tokens between them are masked (prompt).
    loss_spans: list[tuple[int, int]] | None = None

    def read(self, dataset: IndexedDataset) -> numpy.ndarray:
        """The run's tokens, read from the shard."""
        return dataset.read_range(self.bin_offset, self.tokens)


@dataclass(frozen=True)
class Provenance:
    """Where the sample at one global position came from (see docs/provenance.md).

    ``position`` is the position asked about; ``read_position`` the stream position actually
    read (``position % len(stream)`` when a finite megatron stream repeats, see ``wrap``).
    ``source`` / ``source_index`` name the blend part (the only prefix when there is no blend),
    ``local_sample`` is the sample's index within that part, and ``epoch`` the part's epoch
    the sample belongs to (megatron: the epoch of its first token in the built index; native:
    ``local_sample // windows``).
    """

    split: str
    packing: str
    seq_length: int
    position: int
    read_position: int
    wrap: int
    source: str
    source_index: int
    local_sample: int
    epoch: int
    pieces: list[Piece] = field(default_factory=list)
    task_encoder: str | None = None  # the encoder ds[p] runs (its identity and key), when the dataset has one

    @property
    def tokens(self) -> int:
        return sum(piece.tokens for piece in self.pieces)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (ints, strings, lists): what ``statefulset explain --json`` prints (``task_encoder``
        only when the dataset has one, a piece's ``loss_spans`` only when its shard has a loss mask)."""
        found = asdict(self)
        if found["task_encoder"] is None:
            del found["task_encoder"]
        for piece in found["pieces"]:  # loss_spans only for a shard with a loss-mask shard
            if piece["loss_spans"] is None:
                del piece["loss_spans"]
        return found

    def text(self) -> str:
        """One readable block: the sample, its source and epoch, then one line per piece."""
        where = f"read as position {self.read_position} (wrap {self.wrap}), " if self.wrap else ""
        lines = [
            f"sample {self.position} ({self.split}, packing {self.packing}, {self.tokens} tokens)",
            f"  {where}source {self.source_index}: {self.source}",
            f"  local sample {self.local_sample}, epoch {self.epoch}, {len(self.pieces)} piece(s):",
        ]
        if self.task_encoder is not None:
            lines.insert(2, f"  encoded by task encoder {self.task_encoder}")
        for piece in self.pieces:
            lines.append(
                f"    sequence {piece.sequence} (document {piece.document}): tokens "
                f"[{piece.offset}, {piece.offset + piece.tokens}) of {piece.sequence_tokens}, "
                f".bin token {piece.bin_offset}"
            )
            if piece.loss_spans is not None:
                spans = ", ".join(f"[{a}, {b})" for a, b in piece.loss_spans) or "none"
                lines.append(f"      loss on tokens {spans}; the rest of the run is masked")
            if piece.text is not None:
                shown = piece.text if len(piece.text) <= _TEXT_PREVIEW else piece.text[:_TEXT_PREVIEW] + "…"
                lines.append(f"      {shown!r}")
        return "\n".join(lines)


def decoder_for(tokenizer: Any) -> Decoder | None:
    """A decoder from ``"bytes"``, a tokenizer.json path or folder, a TokenizerSpec or an object with ``decode``."""
    if tokenizer is None:
        return None
    if hasattr(tokenizer, "decode"):
        return tokenizer
    if isinstance(tokenizer, str | os.PathLike):
        tokenizer = TokenizerSpec(os.fspath(tokenizer))
    if isinstance(tokenizer, TokenizerSpec):
        return tokenizer.build()
    raise StatefulsetError(
        f"explain: tokenizer must be 'bytes', a tokenizer.json path or an object with decode(), "
        f"got {type(tokenizer).__name__}"
    )


def explain(stream: SampleStream, position: int, tokenizer: Any = None) -> Provenance:
    """The provenance of ``stream[position]``; ``tokenizer`` adds each piece's decoded text."""
    p = int(position)
    if p < 0 or (not stream.unbounded and p >= len(stream)):
        raise SequenceIndexError(f"{stream.split} stream: position {p} is outside [0, {len(stream)})")
    if stream.packing == "megatron":
        found = _megatron(stream, p)
    elif stream.packing == "native":
        found = _native(stream, p)
    elif stream.packing == "bestfit":
        found = _bestfit(stream, p)
    else:
        raise StatefulsetError(f"explain: packing {stream.packing!r} has no provenance yet")
    decoder = decoder_for(tokenizer)
    if decoder is not None:
        dataset = _dataset_of(stream, found.source_index)
        pieces = [replace(pc, text=decoder.decode(pc.read(dataset))) for pc in found.pieces]
        found = replace(found, pieces=pieces)
    return found


def _dataset_of(stream: SampleStream, source: int) -> IndexedDataset:
    return stream.sources[source].dataset  # type: ignore[attr-defined]


def _documents(dataset: IndexedDataset, sequences: list[int]) -> list[int]:
    """Document id of each sequence: the last document starting at or before it (a binary search)."""
    # bisect, not numpy.searchsorted: the mapped index arrays are often unaligned (the .idx header
    # is 34 bytes), and searchsorted copies an unaligned array whole (8 bytes per entry) first.
    return [bisect.bisect_right(dataset.document_indices, s) - 1 for s in sequences]


def _pieces(dataset: IndexedDataset, runs: list[tuple[int, int, int]]) -> list[Piece]:
    """Pieces from ``(sequence, offset, tokens)`` runs; empty runs (empty sequences) are left out."""
    runs = [run for run in runs if run[2] > 0]
    sequences = [s for s, _, _ in runs]
    itemsize = dataset.dtype.itemsize
    pointers = dataset.sequence_pointers[sequences].tolist() if sequences else []
    lengths = dataset.sequence_lengths[sequences].tolist() if sequences else []
    documents = _documents(dataset, sequences)
    pieces = [
        Piece(dataset.path_prefix, s, d, offset, count, pointer // itemsize + offset, length)
        for (s, offset, count), pointer, length, d in zip(runs, pointers, lengths, documents, strict=True)
    ]
    if dataset.loss_mask is None:
        return pieces
    return [replace(pc, loss_spans=_loss_spans(dataset.loss_mask, pc)) for pc in pieces]


def _loss_spans(mask: IndexedDataset, piece: Piece) -> list[tuple[int, int]]:
    """The runs of ``piece`` whose mask is 1, as ``[first, stop)`` offsets within its sequence."""
    values = numpy.r_[0, mask.read_range(piece.bin_offset, piece.tokens) != 0, 0].astype(numpy.int8)
    edges = numpy.flatnonzero(numpy.diff(values))
    return [(piece.offset + int(a), piece.offset + int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def source_prefixes(stream: SampleStream, positions: numpy.ndarray) -> list[str]:
    """The source prefix of each stream position (what ``explain(p).source`` says), vectorised and O(1)
    per position: the blend's choice of source, without locating the pieces."""
    p = numpy.asarray(positions, dtype=numpy.int64).reshape(-1)
    prefixes = [source.dataset.path_prefix for source in stream.sources]  # type: ignore[attr-defined]
    if len(prefixes) == 1:  # one source: no choice to look up (a task encoder asks this per micro-batch)
        return prefixes * p.size
    blend = getattr(stream, "blend", None)
    if stream.packing == "megatron":
        which = numpy.zeros(p.size, dtype=numpy.int64) if blend is None else blend["dataset_index"][p]
    else:
        schedule = getattr(stream, "schedule", None)
        which = numpy.zeros(p.size, dtype=numpy.int64) if schedule is None else stream.locate(p)[0]
    return [prefixes[int(w)] for w in which]


def _megatron(stream: Any, p: int) -> Provenance:
    if stream.blend is None:
        which, local = 0, p
    else:
        which = int(stream.blend["dataset_index"][p])
        local = int(stream.blend["dataset_sample_index"][p])
    source = stream.sources[which]
    k = int(source.shuffle_index[local])
    (first, offset), (last, end) = source.sample_index[k].tolist(), source.sample_index[k + 1].tolist()
    rows = source.document_index[first : last + 1].tolist()
    lengths = source.dataset.sequence_lengths[rows].tolist()
    # As GPTDataset reads it: the first row from the sample's offset, the last up to one token
    # past the next sample's offset (the token shared with the next sample), the rest whole.
    runs = []
    for r, (seq, length) in enumerate(zip(rows, lengths, strict=True)):
        lo = offset if r == 0 else 0
        hi = end + 1 if r == len(rows) - 1 else length
        runs.append((seq, lo, hi - lo))
    lo_seq, hi_seq = source.sequence_range
    epoch = first // max(hi_seq - lo_seq, 1)
    return Provenance(
        stream.split,
        "megatron",
        stream.seq_length,
        p,
        p,
        0,
        source.dataset.path_prefix,
        which,
        local,
        epoch,
        _pieces(source.dataset, runs),
    )


def _source_of(stream: Any, p: int) -> tuple[int, int]:
    """``(source, local sample)`` of position ``p`` in a blended (or staged) stream."""
    if stream.schedule is None:
        return 0, p
    w, q = stream.locate(numpy.array([p], dtype=numpy.int64))
    return int(w[0]), int(q[0])


def _native(stream: Any, p: int) -> Provenance:
    which, local = _source_of(stream, p)
    source = stream.sources[which]
    dataset = source.dataset
    start = int(source.window_starts(numpy.array([local], dtype=numpy.int64))[0])
    stop = start + stream.seq_length + 1
    itemsize = dataset.dtype.itemsize
    pointers, lengths = dataset.sequence_pointers, dataset.sequence_lengths
    # The last sequence starting at or before the window's first token holds it (empty sequences
    # share their successor's pointer, so "last" skips them); validated indices are contiguous.
    seq = bisect.bisect_right(pointers, start * itemsize) - 1
    runs, at = [], start
    while at < stop:
        first = int(pointers[seq]) // itemsize
        length = int(lengths[seq])
        hi = min(length, stop - first)
        runs.append((seq, at - first, hi - (at - first)))
        at = first + hi
        seq += 1
    return Provenance(
        stream.split,
        "native",
        stream.seq_length,
        p,
        p,
        0,
        dataset.path_prefix,
        which,
        local,
        local // source.windows,
        _pieces(dataset, runs),
    )


def _bestfit(stream: Any, p: int) -> Provenance:
    which, local = _source_of(stream, p)
    source = stream.sources[which]
    b = int(source.bins_of(numpy.array([local], dtype=numpy.int64))[0])
    sequences, offsets, lengths = source.bin_items(b)
    runs = list(zip(sequences.tolist(), offsets.tolist(), lengths.tolist(), strict=True))
    return Provenance(
        stream.split,
        "bestfit",
        stream.seq_length,
        p,
        p,
        0,
        source.dataset.path_prefix,
        which,
        local,
        local // source.samples_per_epoch,
        _pieces(source.dataset, runs),
    )


# -- which positions a training step read ----------------------------------------------------------
@dataclass(frozen=True)
class StepLayout:
    """Global positions of an optimizer step, from the loader layout ``(t·W + r)·B + j``.

    A step consumes ``global_batch_size`` (G) consecutive positions ``[S·G, (S+1)·G)``: Megatron's
    pretraining sampler, and this project's loader with ``M = G / (W·B)`` micro-batches per step
    (gradient accumulation): micro-batch ``m`` of step ``S`` is the loader's batch
    ``t = S·M + m``. G defaults to ``W·B`` (no accumulation), where a step is one micro-batch.
    """

    global_batch_size: int
    dp_size: int | None = None
    micro_batch_size: int | None = None

    @classmethod
    def of(
        cls, global_batch_size: int | None = None, dp_size: int | None = None, micro_batch_size: int | None = None
    ) -> StepLayout:
        sizes = {"--global-batch-size": global_batch_size, "--dp-size": dp_size, "--micro-batch-size": micro_batch_size}
        for flag, value in sizes.items():
            if value is not None and value < 1:
                raise StatefulsetError(f"explain: {flag} must be positive, got {value}")
        if (dp_size is None) != (micro_batch_size is None):
            raise StatefulsetError("explain: give --dp-size and --micro-batch-size together")
        if dp_size is None or micro_batch_size is None:
            if global_batch_size is None:
                raise StatefulsetError("explain: --step needs --global-batch-size, or --dp-size and --micro-batch-size")
            return cls(global_batch_size)
        per_micro_batch = dp_size * micro_batch_size
        if global_batch_size is None:
            global_batch_size = per_micro_batch
        if global_batch_size % per_micro_batch:
            raise StatefulsetError(
                f"explain: --global-batch-size {global_batch_size} is not a multiple of "
                f"--dp-size x --micro-batch-size = {per_micro_batch}"
            )
        return cls(global_batch_size, dp_size, micro_batch_size)

    @property
    def micro_batches(self) -> int | None:
        """Micro-batches per step (the gradient-accumulation count), when the layout is known."""
        if self.dp_size is None or self.micro_batch_size is None:
            return None
        return self.global_batch_size // (self.dp_size * self.micro_batch_size)

    def positions(self, step: int, rank: int | None = None, row: int | None = None) -> list[int]:
        """Positions of ``step``; with ``rank`` only that DP rank's rows (and with ``row`` only row ``row``)."""
        if step < 0:
            raise StatefulsetError(f"explain: --step must be non-negative, got {step}")
        first = step * self.global_batch_size
        if rank is None:
            if row is not None:
                raise StatefulsetError("explain: --row is a row of one rank's micro-batches; give --rank too")
            return list(range(first, first + self.global_batch_size))
        if self.dp_size is None or self.micro_batch_size is None or self.micro_batches is None:
            raise StatefulsetError("explain: --rank needs --dp-size and --micro-batch-size")
        if not 0 <= rank < self.dp_size:
            raise StatefulsetError(f"explain: --rank {rank} is outside [0, --dp-size {self.dp_size})")
        b = self.micro_batch_size
        if row is not None and not 0 <= row < b:
            raise StatefulsetError(f"explain: --row {row} is outside [0, --micro-batch-size {b})")
        rows = range(b) if row is None else [row]
        return [first + (m * self.dp_size + rank) * b + j for m in range(self.micro_batches) for j in rows]

    def locate(self, position: int) -> dict[str, int]:
        """``step`` of a position and, when the layout is known, its ``micro_batch``, ``rank`` and ``row``."""
        step, within = divmod(position, self.global_batch_size)
        if self.dp_size is None or self.micro_batch_size is None:
            return {"step": step}
        micro_batch, within = divmod(within, self.dp_size * self.micro_batch_size)
        rank, row = divmod(within, self.micro_batch_size)
        return {"step": step, "micro_batch": micro_batch, "rank": rank, "row": row}
