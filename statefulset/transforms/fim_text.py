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
        values = [int(t) for t in ids]
        if self._skip_kw:
            return str(self.tokenizer.decode(values, skip_special_tokens=True))
        return str(self.tokenizer.decode(numpy.asarray(values, dtype=numpy.int64) if self._statefulset else values))

    def encode(self, text: str) -> numpy.ndarray:
        if not text:
            return numpy.empty(0, dtype=numpy.int64)
        if self._statefulset:
            tokens, _ = self.tokenizer.encode_batch([text])
            return numpy.asarray(tokens, dtype=numpy.int64)
        found = self.tokenizer.encode(text, add_special_tokens=False) if self._add_kw else self.tokenizer.encode(text)
        ids = getattr(found, "ids", found)
        return numpy.asarray(list(ids), dtype=numpy.int64)


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
