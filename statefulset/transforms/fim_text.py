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


def text_fim(fim: Any, codec: TextCodec, text: numpy.ndarray, draws: Any) -> numpy.ndarray | None:
    """Tokenizer-mode FIM of a sample with neither a loss mask nor documents (Megatron-LM's case): its
    tokens after FIM (int64, not yet cut or padded to the sample's width), or None when no segment
    changed. The segments, draws and pieces of ``FillInTheMiddle._transform`` (its mask all ones
    there, so never consulted), built as slices of ``text`` and one array per FIM'd fragment instead
    of an array, a mask and documents per piece: the same tokens (``tests/test_fim_text.py``)."""
    chunks: list[numpy.ndarray] = []
    kept = 0  # text[kept:] not yet taken
    for a, b in _segments(text, fim.eod_id):
        got = _segment(fim, codec, text[a:b], draws)
        if got is None:
            continue
        if a > kept:
            chunks.append(text[kept:a])
        chunks.extend(got)
        kept = b
    if not chunks:
        return None
    if kept < text.size:
        chunks.append(text[kept:])
    return numpy.concatenate(chunks).astype(numpy.int64)  # as FillInTheMiddle's _joined promotes and casts


def _segments(text: numpy.ndarray, eod_id: int | None) -> list[tuple[int, int]]:
    """The non-empty runs between EOD tokens (Megatron-LM's segments; the EOD tokens stay in place)."""
    if eod_id is None:
        return [(0, int(text.size))]
    bounds = [-1, *numpy.flatnonzero(text == eod_id).tolist(), int(text.size)]
    return [(a + 1, b) for a, b in itertools.pairwise(bounds) if b > a + 1]


def _segment(fim: Any, codec: TextCodec, tokens: numpy.ndarray, draws: Any) -> list[numpy.ndarray] | None:
    """One segment's pieces, split at ``split_sample`` when it holds that token; None when unchanged."""
    breaks = [] if fim.split_sample is None else numpy.flatnonzero(tokens == fim.split_sample).tolist()
    if not breaks:
        got = _permute(fim, codec, tokens, fim.rate, draws)
        return None if got is None else [got]
    if not draws.binomial(fim.rate):
        return None
    pieces, changed, current = [], False, 0
    for loc in [*breaks, tokens.size]:
        if loc > current:  # an empty fragment is no FIM
            got = _permute(fim, codec, tokens[current:loc], fim.fragment_rate, draws)
            changed |= got is not None
            pieces.append(tokens[current:loc] if got is None else got)
        if loc < tokens.size:
            pieces.append(tokens[loc : loc + 1])
        current = loc + 1
    return pieces if changed else None


def _permute(fim: Any, codec: TextCodec, tokens: numpy.ndarray, rate: float, draws: Any) -> numpy.ndarray | None:
    """FIM one fragment with probability ``rate`` (the rate, the cut points, the SPM choice); None: kept."""
    if not draws.binomial(rate):
        return None
    contents = codec.decode(tokens)
    prefix = fim.no_prefix
    if isinstance(prefix, str) and contents.startswith(prefix):
        return None
    if isinstance(prefix, tuple) and tokens.size >= len(prefix) and (tokens[: len(prefix)] == prefix).all():
        return None
    lo, hi = sorted(draws.pair(len(contents)))
    before, middle, after = codec.ids(contents[:lo]), codec.ids(contents[lo:hi]), codec.ids(contents[hi:])
    if draws.binomial(fim.spm_rate):
        ids = [fim.prefix_id, fim.suffix_id, *after, fim.middle_id, *before, *middle]
    else:
        ids = [fim.prefix_id, *before, fim.suffix_id, *after, fim.middle_id, *middle]
    return numpy.array(ids, dtype=numpy.int64)
