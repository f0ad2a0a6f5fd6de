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
(:mod:`~statefulset.transforms.fim_tokens`); tokenizer mode's walk is
:func:`~statefulset.transforms.fim_text.text_edits`. How the document fields and ``loss_mask``
follow the permuted pieces (:mod:`~statefulset.transforms.fim_fields`): docs/transforms.md.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import numpy

from statefulset.errors import StatefulsetError
from statefulset.shards.tokenizers import TokenizerSpec
from statefulset.transforms.fim_draws import draws_of
from statefulset.transforms.fim_fields import (
    document_of_tokens,
    pad_document,
    runs_of,
    set_document_fields,
    tail_start,
    token_mask,
)
from statefulset.transforms.fim_rows import fim_rows
from statefulset.transforms.fim_text import Edit, TextCodec, spliced, text_codec, text_edits, text_fim
from statefulset.transforms.fim_tokens import Gathered, token_fim
from statefulset.transforms.sample import TokenSample


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
                edits = text_edits(self, self.codec, text, mask, runs_of(docs[:tail]), draws)
                got = _edited(text, mask, docs, edits) if edits else None
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


def _edited(text: numpy.ndarray, mask: numpy.ndarray | None, docs: numpy.ndarray, edits: list[Edit]) -> Gathered:
    """Tokenizer mode's output: the tokens, mask values (or None) and documents with each edit's range
    given way to its tokens, which take the range's mask value and document (one each throughout)."""
    tokens = spliced(text, edits, lambda a, got: got).astype(numpy.int64)
    out_docs = spliced(docs, edits, lambda a, got: numpy.full(got.size, docs[a], dtype=numpy.int64))
    if mask is None:
        return tokens, None, out_docs
    out_mask = spliced(mask, edits, lambda a, got: numpy.full(got.size, mask[a], dtype=numpy.float32))
    return tokens, out_mask.astype(numpy.float32), out_docs


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
