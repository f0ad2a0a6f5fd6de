"""Fill-in-the-middle as Megatron-LM's ``GPTFIMDataset``, with keyed randomness (CONTRACT §15).

The rules are Megatron-LM's (``megatron/training/datasets/fim_dataset.py``, read at d98e8a6):

- A sample's *segments* are FIM'd one by one. Megatron-LM's segments are the runs between EOD
  tokens, the EOD tokens staying where they are; here they are the sample's documents where it has
  ``cu_seqlens`` (the shard's sequences, never a scan), each split again at ``eod_id`` when that is
  given (Megatron-LM's ``--fim-eod-token``), else the whole sample.
- A segment is FIM'd with probability ``rate``. With ``split_sample`` and the segment holding that
  token, one draw at ``rate`` decides for the segment, then each fragment between split tokens is
  FIM'd with probability ``fragment_rate``; the split tokens stay where they are.
- FIM: two cut points drawn uniformly from ``0..n`` (n tokens; in tokenizer mode n characters of
  the segment decoded without special tokens, each piece tokenised again), sorted; the pieces are
  laid out as PSM ``[prefix_id] prefix [suffix_id] suffix [middle_id] middle`` or, with probability
  ``spm_rate``, SPM ``[prefix_id, suffix_id] suffix [middle_id] prefix middle``.
- ``no_prefix``: a segment (or fragment) that starts with it is left as it is (after the ``rate``
  draw, as Megatron-LM). A string is compared with the decoded text (tokenizer mode), token ids with
  the tokens.
- The sample keeps its ``seq_length + 1`` tokens: cut at the end when longer, padded at the end
  with ``pad_id`` when shorter (only tokenizer mode can shrink a segment).

Randomness comes only from the ``rng`` the loader passes (keyed by spec seed, encoder and
``sample_id``), drawn in Megatron-LM's order: the rate, the two cut points, the SPM choice (read
from its raw stream: :mod:`~statefulset.transforms.fim_draws`). Token mode is index arithmetic
(:mod:`~statefulset.transforms.fim_tokens`); tokenizer mode runs here. How the document fields and
``loss_mask`` follow the permuted pieces (:mod:`~statefulset.transforms.fim_fields`): docs/transforms.md.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import numpy

from statefulset.errors import StatefulsetError
from statefulset.shards.tokenizers import TokenizerSpec
from statefulset.transforms.fim_draws import CallDraws, RawDraws, draws_of
from statefulset.transforms.fim_fields import (
    document_of_tokens,
    pad_document,
    runs_of,
    set_document_fields,
    tail_start,
    token_mask,
)
from statefulset.transforms.fim_rows import fim_rows
from statefulset.transforms.fim_text import TextCodec, text_codec, text_fim
from statefulset.transforms.fim_tokens import Gathered, token_fim
from statefulset.transforms.sample import TokenSample

# One run of output tokens: its tokens, their token-level loss mask (None: the sample has none), and
# the document (segment of cu_seqlens) each token belongs to.
Run = tuple[numpy.ndarray, "numpy.ndarray | None", numpy.ndarray]
# Tokens and their mask, before documents are attached.
Span = tuple[numpy.ndarray, "numpy.ndarray | None"]
Draws = RawDraws | CallDraws


class FillInTheMiddle:
    """Megatron-LM's fill-in-the-middle over token samples, as a task encoder (docs/transforms.md).

    ``rate``, ``spm_rate``, ``split_sample``, ``fragment_rate`` and ``no_prefix`` are Megatron-LM's
    ``--fim-rate``, ``--fim-spm-rate``, ``--fim-split-sample`` (here a token id),
    ``--fim-fragment-rate`` and ``--fim-no-prefix``; ``prefix_id``, ``middle_id``, ``suffix_id``,
    ``pad_id`` and ``eod_id`` the ids of ``--fim-{prefix,middle,suffix,pad,eod}-token``. Without a
    tokenizer the cut points are token positions; with one (a ``tokenizers.Tokenizer``, a
    ``TokenizerSpec`` or anything with ``encode``/``decode``) they are characters, as Megatron-LM.
    ``rate=0`` returns every sample as it is.
    """

    # Raise when the transform's output changes for the same parameters; ``version`` adds them.
    VERSION = 1

    def __init__(
        self,
        rate: float,
        spm_rate: float,
        prefix_id: int,
        middle_id: int,
        suffix_id: int,
        pad_id: int,
        split_sample: int | None = None,
        fragment_rate: float = 0.0,
        no_prefix: str | int | tuple[int, ...] | None = None,
        tokenizer: Any = None,
        *,
        eod_id: int | None = None,
    ) -> None:
        self.rate = _probability("rate", rate)
        self.spm_rate = _probability("spm_rate", spm_rate)
        self.fragment_rate = _probability("fragment_rate", fragment_rate)
        self.prefix_id = _token_id("prefix_id", prefix_id)
        self.middle_id = _token_id("middle_id", middle_id)
        self.suffix_id = _token_id("suffix_id", suffix_id)
        self.pad_id = _token_id("pad_id", pad_id)
        self.split_sample = None if split_sample is None else _token_id("split_sample", split_sample)
        self.eod_id = None if eod_id is None else _token_id("eod_id", eod_id)
        self.no_prefix = _no_prefix(no_prefix, tokenizer)
        self.tokenizer = tokenizer
        self._codec: TextCodec | None = None
        if tokenizer is not None:
            self._codec = text_codec(tokenizer)  # checks the tokenizer now, in the caller's process

    def __getstate__(self) -> dict[str, Any]:
        state = dict(vars(self))
        state["_codec"] = None  # built again where it is used (a worker process)
        return state

    def __repr__(self) -> str:
        shown = ("rate", "spm_rate", "prefix_id", "middle_id", "suffix_id", "pad_id", "split_sample")
        more = ("fragment_rate", "no_prefix", "eod_id")
        args = [f"{k}={getattr(self, k)!r}" for k in shown]
        args += [f"{k}={getattr(self, k)!r}" for k in more if getattr(self, k) not in (None, 0.0)]
        if self.tokenizer is not None:
            args.append(f"tokenizer={type(self.tokenizer).__qualname__}")
        return f"FillInTheMiddle({', '.join(args)})"

    @property
    def version(self) -> str:
        """``1-<digest of the parameters and tokenizer>``: part of the encoder identity a state records,
        so a restore under other FIM parameters is refused instead of FIM'ing other samples silently."""
        ids = (self.prefix_id, self.middle_id, self.suffix_id, self.pad_id, self.split_sample, self.eod_id)
        params = (
            self.rate,
            self.spm_rate,
            self.fragment_rate,
            ids,
            self.no_prefix,
            _tokenizer_identity(self.tokenizer),
        )
        digest = hashlib.blake2b(repr(params).encode(), digest_size=6).hexdigest()
        return f"{self.VERSION}-{digest}"

    @property
    def codec(self) -> TextCodec | None:
        if self._codec is None and self.tokenizer is not None:
            self._codec = text_codec(self.tokenizer)
        return self._codec

    def encode_sample(self, sample: TokenSample, rng: numpy.random.Generator) -> TokenSample:
        """``sample`` with its segments FIM'd; all randomness from ``rng``."""
        if self.rate == 0.0:
            return sample
        text = numpy.asarray(sample.text)
        if text.ndim != 1 or text.size < 2:
            raise StatefulsetError(
                f"FillInTheMiddle: sample {sample.sample_id} ({sample.source}): text has shape {text.shape}, "
                "not [seq_length + 1]"
            )
        mask = token_mask(sample, text.size)
        if mask is None and sample.cu_seqlens is None and self.codec is not None:
            return self._plain_text(sample, text, rng)  # Megatron-LM's case: no per-token fields to carry
        if mask is None and self.tokenizer is not None:
            mask = numpy.ones(text.size, dtype=numpy.float32)  # padding may come: every sample gets a mask
        docs = document_of_tokens(sample, text.size)
        tail = tail_start(text, mask)
        draws = draws_of(rng)
        try:
            if self.codec is None:
                got = token_fim(self, text, mask, docs, tail, draws)
            else:
                runs, changed = self._transform(text, mask, docs, tail, draws)
                got = _joined(runs) if changed else None
        finally:
            draws.finish()  # the generator left as the per-call draws leave it
        if got is None:
            if mask is None or sample.loss_mask is not None:
                return sample
            out = copy.copy(sample)
            out.loss_mask = mask[1:].copy()
            return out
        return self._rebuilt(sample, got, text.size, pad_document(docs, tail))

    def _plain_text(self, sample: TokenSample, text: numpy.ndarray, rng: numpy.random.Generator) -> TokenSample:
        """Tokenizer mode for a sample without ``loss_mask`` or ``cu_seqlens``: what the general path
        gives it (its mask all ones, so the sample gets a ``loss_mask`` of ones, padding 0), through
        :func:`~statefulset.transforms.fim_text.text_fim` (no arrays per piece)."""
        draws = draws_of(rng)
        try:
            tokens = text_fim(self, self.codec, text, draws)
        finally:
            draws.finish()  # the generator left as the per-call draws leave it
        width = text.size
        mask = numpy.ones(width, dtype=numpy.float32)
        out = copy.copy(sample)
        if tokens is not None:
            if tokens.size > width:
                tokens = tokens[:width]
            elif tokens.size < width:
                mask[tokens.size :] = 0.0
                tokens = numpy.concatenate([tokens, numpy.full(width - tokens.size, self.pad_id, dtype=numpy.int64)])
            out.text = tokens
        out.loss_mask = mask[1:].copy()
        return out

    def encode_rows_in_place(self, rows: dict[str, Any], sample_ids: numpy.ndarray, key: int) -> bool:
        """The loader's path for a whole micro-batch: ``rows`` (each field's ``[B, ...]`` array) FIM'd in
        place, each row as :meth:`encode_sample` gives it with the generator keyed by ``(key, sample_id)``
        (:func:`~statefulset.transforms.keyed.keyed_generator`). False, with nothing changed, where that
        path does not apply (tokenizer mode, a subclass's own ``encode_sample``, no compiled kernels):
        the loader then calls :meth:`encode_sample` per sample."""
        if type(self).encode_sample is not FillInTheMiddle.encode_sample:
            return False
        return fim_rows(self, rows, sample_ids, key)

    def _transform(
        self,
        text: numpy.ndarray,
        mask: numpy.ndarray | None,
        docs: numpy.ndarray,
        tail: int,
        rng: Draws,
    ) -> tuple[list[Run], bool]:
        """Tokenizer mode: the sample's runs after FIM, in order; whether any segment changed."""
        runs: list[Run] = []
        changed = False
        for start, end in runs_of(docs[:tail]):
            doc = int(docs[start])
            for a, b, fim in self._eod_split(text, start, end):
                segment = (text[a:b], None if mask is None else mask[a:b])
                spans, done = self._split_and_permute(segment, rng) if fim else ([segment], False)
                changed |= done
                runs.extend((t, m, numpy.full(t.size, doc, dtype=numpy.int64)) for t, m in spans)
        if tail < text.size:  # padding (or trailing masked tokens): kept, never FIM'd
            runs.append((text[tail:], None if mask is None else mask[tail:], docs[tail:]))
        return runs, changed

    def _eod_split(self, text: numpy.ndarray, start: int, end: int) -> list[tuple[int, int, bool]]:
        """Spans of ``[start, end)``: (a, b, FIM it?); EOD tokens kept in place (Megatron-LM's segments)."""
        if self.eod_id is None:
            return [(start, end, True)]
        spans, current = [], start
        for loc in (start + numpy.flatnonzero(text[start:end] == self.eod_id)).tolist():
            if loc > current:
                spans.append((current, loc, True))
            spans.append((loc, loc + 1, False))
            current = loc + 1
        if end > current:
            spans.append((current, end, True))
        return spans

    def _split_and_permute(self, segment: Span, rng: Draws) -> tuple[list[Span], bool]:
        """One segment, split at ``split_sample`` when it holds that token (Megatron-LM's rule)."""
        tokens, mask = segment
        if self.split_sample is None:
            return self._permute(segment, self.rate, rng)
        breaks = numpy.flatnonzero(tokens == self.split_sample).tolist()
        if not breaks:
            return self._permute(segment, self.rate, rng)
        if not rng.binomial(self.rate):
            return [segment], False
        spans: list[Span] = []
        changed = False
        current = 0
        for loc in [*breaks, tokens.size]:
            if loc > current:  # an empty fragment is no FIM (Megatron-LM FIMs an empty last one)
                fragment = (tokens[current:loc], None if mask is None else mask[current:loc])
                got, done = self._permute(fragment, self.fragment_rate, rng)
                spans.extend(got)
                changed |= done
            if loc < tokens.size:
                spans.append((tokens[loc : loc + 1], None if mask is None else mask[loc : loc + 1]))
            current = loc + 1
        return spans, changed

    def _permute(self, segment: Span, rate: float, rng: Draws) -> tuple[list[Span], bool]:
        """Tokenizer mode: FIM one segment with probability ``rate``: ([its spans], changed)."""
        tokens, mask = segment
        codec = self.codec
        assert codec is not None  # token mode: statefulset.transforms.fim_tokens
        if mask is not None and mask.size and mask.min() != mask.max():
            return [segment], False  # a per-token mask cannot follow a character cut: left as it is
        if not rng.binomial(rate):
            return [segment], False
        contents = codec.decode(tokens)
        if isinstance(self.no_prefix, str) and contents.startswith(self.no_prefix):
            return [segment], False
        if isinstance(self.no_prefix, tuple) and _starts_with(tokens, self.no_prefix):
            return [segment], False
        lo, hi = sorted(rng.pair(len(contents)))
        value = 1.0 if mask is None or mask.size == 0 else float(mask[0])
        encoded = [codec.encode(contents[:lo]), codec.encode(contents[lo:hi]), codec.encode(contents[hi:])]
        pieces = [(t, None if mask is None else numpy.full(t.size, value, dtype=numpy.float32)) for t in encoded]
        return [self._layout(pieces, value, mask is not None, rng)], True

    def _layout(self, pieces: list[Span], sentinel: float, masked: bool, rng: Draws) -> Span:
        """PSM ``<P> prefix <S> suffix <M> middle`` or SPM ``<P> <S> suffix <M> prefix middle``."""
        (prefix, prefix_mask), (middle, middle_mask), (suffix, suffix_mask) = pieces
        pre, mid, suf = ([self.prefix_id], [self.middle_id], [self.suffix_id])
        one = numpy.array([sentinel], dtype=numpy.float32)
        if rng.binomial(self.spm_rate):
            order = [pre, suf, suffix, mid, prefix, middle]
            masks = [one, one, suffix_mask, one, prefix_mask, middle_mask]
        else:
            order = [pre, prefix, suf, suffix, mid, middle]
            masks = [one, prefix_mask, one, suffix_mask, one, middle_mask]
        tokens = numpy.concatenate([numpy.asarray(t, dtype=numpy.int64) for t in order])
        return tokens, numpy.concatenate(masks).astype(numpy.float32) if masked else None  # type: ignore[arg-type]

    def _rebuilt(self, sample: TokenSample, got: Gathered, width: int, pad_doc: int) -> TokenSample:
        """The sample from its FIM'd tokens: cut or padded to ``width`` tokens, its fields following the pieces."""
        tokens, mask, docs = got
        if tokens.size > width:
            tokens, docs = tokens[:width], docs[:width]
            mask = None if mask is None else mask[:width]
        elif tokens.size < width:
            missing = width - tokens.size
            if mask is None:
                raise StatefulsetError("internal: FillInTheMiddle shrank a sample that has no loss mask")
            tokens = numpy.concatenate([tokens, numpy.full(missing, self.pad_id, dtype=numpy.int64)])
            docs = numpy.concatenate([docs, numpy.full(missing, pad_doc, dtype=numpy.int64)])
            mask = numpy.concatenate([mask, numpy.zeros(missing, dtype=numpy.float32)])
        out = copy.copy(sample)
        out.text = tokens
        if mask is not None:
            out.loss_mask = mask[1:].copy()
        if sample.cu_seqlens is not None:
            set_document_fields(out, sample, docs, width - 1)
        return out


def _joined(runs: list[Run]) -> Gathered:
    """Tokenizer mode's runs as one array of tokens, of mask values (or None) and of documents."""
    tokens = numpy.concatenate([r[0] for r in runs]).astype(numpy.int64)
    docs = numpy.concatenate([r[2] for r in runs])
    masked = runs[0][1] is not None
    mask = numpy.concatenate([r[1] for r in runs]).astype(numpy.float32) if masked else None  # type: ignore[misc]
    return tokens, mask, docs


def _part(mask: numpy.ndarray | None, a: int, b: int) -> numpy.ndarray | None:
    return None if mask is None else mask[a:b]


def _starts_with(tokens: numpy.ndarray, prefix: tuple[int, ...]) -> bool:
    return tokens.size >= len(prefix) and bool((tokens[: len(prefix)] == numpy.asarray(prefix)).all())


def _tokenizer_identity(tokenizer: Any) -> str | None:
    """What FIM's character cuts depend on: a TokenizerSpec's fingerprint (its file's digest), a
    ``tokenizers.Tokenizer``'s serialised form, else the tokenizer's class."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, TokenizerSpec):
        return tokenizer.fingerprint()
    to_str = getattr(tokenizer, "to_str", None)
    if callable(to_str):
        return hashlib.sha256(str(to_str()).encode()).hexdigest()
    cls = type(tokenizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _probability(name: str, value: Any) -> float:
    try:
        found = float(value)
    except (TypeError, ValueError):
        found = float("nan")
    if isinstance(value, bool) or not 0.0 <= found <= 1.0:
        raise StatefulsetError(f"FillInTheMiddle: {name}={value!r} is not a probability in [0, 1]")
    return found


def _token_id(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, numpy.integer)):
        raise StatefulsetError(f"FillInTheMiddle: {name}={value!r} is not a token id (an int)")
    return int(value)


def _no_prefix(value: Any, tokenizer: Any) -> str | tuple[int, ...] | None:
    """A string (compared with decoded text: needs a tokenizer) or token ids (compared with tokens)."""
    if value is None:
        return None
    if isinstance(value, str):
        if tokenizer is None:
            raise StatefulsetError(
                f"FillInTheMiddle: no_prefix={value!r} is text, which needs tokenizer=; without one give token ids"
            )
        found: str | tuple[int, ...] = value
    else:
        ids = (value,) if isinstance(value, (int, numpy.integer)) else tuple(value)
        found = tuple(_token_id("no_prefix", v) for v in ids)
    if not found:  # every segment starts with nothing: FIM would never apply
        raise StatefulsetError(f"FillInTheMiddle: no_prefix={value!r} is empty (use None for no such rule)")
    return found
