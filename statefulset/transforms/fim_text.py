"""Characters through a tokenizer, for fill-in-the-middle's tokenizer mode (docs/transforms.md).

Megatron-LM's FIM decodes a segment's tokens to text without special tokens
(``ids_to_text(..., remove_special_tokens=True)``), cuts the text at characters and tokenises each
piece again without adding special tokens. :func:`text_codec` gives those two operations for the
tokenizers statefulset users hold:

- a ``tokenizers.Tokenizer`` (Hugging Face's Rust library);
- a :class:`statefulset.shards.tokenizers.TokenizerSpec` (built in the process that uses it), or
  the ``ByteTokenizer`` / ``HFTokenizer`` it builds (special tokens are never added to a piece);
- any object with ``decode(ids)`` and ``encode(text)`` returning a list of ids (or an object with
  ``.ids``), such as a ``transformers`` tokenizer (``skip_special_tokens`` and
  ``add_special_tokens=False`` are passed where the method takes them).
"""

from __future__ import annotations

import copy
import inspect
import itertools
from dataclasses import replace
from typing import Any

import numpy

from statefulset.errors import StatefulsetError
from statefulset.shards.tokenizers import TokenizerSpec


class TextCodec:
    """``decode``: token ids -> text without special tokens; ``encode``: text -> int64 ids, no special tokens."""

    def __init__(self, tokenizer: Any) -> None:
        if isinstance(tokenizer, TokenizerSpec):
            tokenizer = replace(tokenizer, add_special_tokens=False).build()
        elif hasattr(tokenizer, "encode_batch") and getattr(tokenizer, "add_special_tokens", False) is True:
            tokenizer = copy.copy(tokenizer)  # statefulset's HFTokenizer: never add specials to a piece
            tokenizer.add_special_tokens = False
        for method in ("decode",):
            if not callable(getattr(tokenizer, method, None)):
                raise StatefulsetError(
                    f"FillInTheMiddle(tokenizer=...): {type(tokenizer).__qualname__} has no {method}(); "
                    "give a tokenizers.Tokenizer, a TokenizerSpec or an object with encode() and decode()"
                )
        self.tokenizer = tokenizer
        self._statefulset = _is_statefulset_tokenizer(tokenizer)
        if not self._statefulset and not callable(getattr(tokenizer, "encode", None)):
            raise StatefulsetError(
                f"FillInTheMiddle(tokenizer=...): {type(tokenizer).__qualname__} has no encode(); "
                "give a tokenizers.Tokenizer, a TokenizerSpec or an object with encode() and decode()"
            )
        self._skip_kw = not self._statefulset and _takes(tokenizer.decode, "skip_special_tokens")
        self._add_kw = not self._statefulset and _takes(tokenizer.encode, "add_special_tokens")

    def decode(self, ids: numpy.ndarray) -> str:
        ids = numpy.asarray(ids)
        # Python ints: tolist() in one C call for integer arrays (a per-token int() loop cost ~100x more)
        values = ids.tolist() if ids.dtype.kind in "iu" else [int(t) for t in ids]
        if self._statefulset:
            return str(self.tokenizer.decode(numpy.asarray(values, dtype=numpy.int64)))
        if self._skip_kw:
            return str(self.tokenizer.decode(values, skip_special_tokens=True))
        return str(self.tokenizer.decode(values))

    def ids(self, text: str) -> list[Any]:
        """:meth:`encode`'s ids as the list the tokenizer gave (no array per piece; made int64 with the
        sample's other ids, as :meth:`encode` would make them)."""
        if not text:
            return []
        if self._statefulset:
            tokens, _ = self.tokenizer.encode_batch([text])
            return numpy.asarray(tokens, dtype=numpy.int64).tolist()  # type: ignore[no-any-return]
        found = self.tokenizer.encode(text, add_special_tokens=False) if self._add_kw else self.tokenizer.encode(text)
        return list(getattr(found, "ids", found))

    def encode(self, text: str) -> numpy.ndarray:
        """:meth:`ids` as an int64 array."""
        return numpy.asarray(self.ids(text), dtype=numpy.int64)


def _is_statefulset_tokenizer(tokenizer: Any) -> bool:
    """statefulset's own tokenizers: ``encode_batch`` returns (flat tokens, lengths), ``decode`` skips specials."""
    return type(tokenizer).__module__ == "statefulset.shards.tokenizers"


def _takes(method: Any, keyword: str) -> bool:
    """Whether ``method`` accepts ``keyword`` (the Rust library's methods carry a text signature)."""
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return keyword in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def text_codec(tokenizer: Any) -> TextCodec:
    """The decode/encode pair FIM uses for ``tokenizer`` (see the module's docstring)."""
    return TextCodec(tokenizer)


# A FIM'd fragment: ``text[a:b]`` gives way to these int64 tokens (the layout of its three pieces).
Edit = tuple[int, int, numpy.ndarray]


def text_edits(
    fim: Any,
    codec: TextCodec,
    text: numpy.ndarray,
    mask: numpy.ndarray | None,
    runs: list[tuple[int, int]],
    draws: Any,
) -> list[Edit]:
    """Tokenizer mode's walk over ``text``: the segments of each document run ``(start, end)`` in
    ``runs`` (split again at ``eod_id``), their fragments and draws (Megatron-LM's rules, in its
    order: the module docstring of :mod:`~statefulset.transforms.fim`); each FIM'd segment or
    fragment as an :data:`Edit`, in order. Empty: no segment changed. Everything outside the edits
    stays where it is. A segment whose ``mask`` (per token; None: no mask) is not one value
    throughout is left as it is (a per-token mask cannot follow a character cut)."""
    walk = _Walk(fim, codec, text, mask, draws)
    for start, end in runs:
        for a, b in _segments(text, start, end, fim.eod_id):
            walk.segment(a, b)
    return walk.edits


def spliced(values: numpy.ndarray, edits: list[Edit], replaced: Any) -> numpy.ndarray:
    """``values`` (one per token of the text) with each edit's range given way to ``replaced(a,
    tokens)``: the FIM'd sample's tokens, mask or documents, from slices and one array per edit."""
    chunks: list[numpy.ndarray] = []
    kept = 0  # values[kept:] not yet taken
    for a, b, tokens in edits:
        chunks.append(values[kept:a])
        chunks.append(replaced(a, tokens))
        kept = b
    chunks.append(values[kept:])
    return numpy.concatenate(chunks)


def text_fim(fim: Any, codec: TextCodec, text: numpy.ndarray, draws: Any) -> numpy.ndarray | None:
    """Tokenizer-mode FIM of a sample with neither a loss mask nor documents (Megatron-LM's case): its
    tokens after FIM (int64, not yet cut or padded to the sample's width), or None when no segment
    changed: the whole sample one document run, no mask to carry (``tests/test_fim_text.py``)."""
    edits = text_edits(fim, codec, text, None, [(0, int(text.size))], draws)
    if not edits:
        return None
    return spliced(text, edits, lambda a, tokens: tokens).astype(numpy.int64)


def _segments(text: numpy.ndarray, start: int, end: int, eod_id: int | None) -> list[tuple[int, int]]:
    """The non-empty runs of ``[start, end)`` between EOD tokens (Megatron-LM's segments; the EOD
    tokens stay in place)."""
    if eod_id is None:
        return [(start, end)]
    bounds = [start - 1, *(start + numpy.flatnonzero(text[start:end] == eod_id)).tolist(), end]
    return [(a + 1, b) for a, b in itertools.pairwise(bounds) if b > a + 1]


class _Walk:
    """One segment or fragment at a time, recording the FIM'd ones as edits."""

    def __init__(self, fim: Any, codec: TextCodec, text: numpy.ndarray, mask: numpy.ndarray | None, draws: Any):
        self.fim, self.codec, self.text, self.mask, self.draws = fim, codec, text, mask, draws
        self.edits: list[Edit] = []

    def segment(self, a: int, b: int) -> None:
        """``text[a:b]``, split at ``split_sample`` when it holds that token (Megatron-LM's rule)."""
        fim = self.fim
        if fim.split_sample is None:
            self.permute(a, b, fim.rate)
            return
        breaks = (a + numpy.flatnonzero(self.text[a:b] == fim.split_sample)).tolist()
        if not breaks:
            self.permute(a, b, fim.rate)
            return
        if not self.draws.binomial(fim.rate):
            return
        current = a
        for loc in [*breaks, b]:
            if loc > current:  # an empty fragment is no FIM (Megatron-LM FIMs an empty last one)
                self.permute(current, loc, fim.fragment_rate)
            current = loc + 1  # the split token stays in place

    def permute(self, a: int, b: int, rate: float) -> None:
        """FIM ``text[a:b]`` with probability ``rate`` (the rate, the cut points, the SPM choice)."""
        fim, codec, tokens = self.fim, self.codec, self.text[a:b]
        if self.mask is not None:
            mask = self.mask[a:b]
            if mask.min() != mask.max():
                return  # a per-token mask cannot follow a character cut: left as it is
        if not self.draws.binomial(rate):
            return
        contents = codec.decode(tokens)
        prefix = fim.no_prefix
        if isinstance(prefix, str) and contents.startswith(prefix):
            return
        if isinstance(prefix, tuple) and tokens.size >= len(prefix) and (tokens[: len(prefix)] == prefix).all():
            return
        lo, hi, spm = self.draws.cut(len(contents), fim.spm_rate)
        before, middle, after = codec.ids(contents[:lo]), codec.ids(contents[lo:hi]), codec.ids(contents[hi:])
        if spm:
            ids = [fim.prefix_id, fim.suffix_id, *after, fim.middle_id, *before, *middle]
        else:
            ids = [fim.prefix_id, *before, fim.suffix_id, *after, fim.middle_id, *middle]
        self.edits.append((a, b, numpy.array(ids, dtype=numpy.int64)))
