"""Byte-level BPE (GPT-2's pre-tokenizer) with each distinct piece encoded once per process.

A GPT-2 style ``tokenizer.json`` splits a text with one regular expression and runs BPE on each
piece alone, so a text's ids are its pieces' ids in order, whatever surrounds them. The Rust
pipeline does that for every occurrence, with per-character alignment bookkeeping and an
``Encoding`` (strings, offsets, masks) per text. Here a text is split with the same expression in
Python, each piece new to this process is encoded once through the real tokenizer, and a batch's
ids are gathered from a table of the pieces' ids with numpy.

Only where the ids are certainly the same: no normalizer, the ``ByteLevel`` pre-tokenizer with its
regex and no prefix space, BPE without dropout, nothing added by a post-processor, no truncation
or padding (:func:`unsupported`); and per text only when every character is one whose Unicode
category is the same in this Python's tables and in Unicode 3.2 (so Oniguruma's tables, which the
Rust pattern uses, agree on it: ASCII, Latin, Greek, Cyrillic, CJK, ... but not emoji or lone
surrogates) and the text holds no added token's text. Every other text goes through the
tokenizer as before, in the same call.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from itertools import chain, compress, repeat

import numpy

# The table starts again at a batch that finds it past either bound (so it holds at most one batch more).
MAX_PIECES = 1 << 18  # distinct pieces kept per process: tens of MB for words
MAX_CHARS = 1 << 25  # and their characters: long pieces (a base64 blob is one) cannot grow it past ~32 MB
_CONTRACTIONS = "'s|'t|'re|'ve|'m|'ll|'d"  # the pattern's first alternatives, as tokenizers writes them


def _ranges(codes: list[int]) -> str:
    """Sorted code points as the inside of a regex character class."""
    out, start = [], None
    for k, code in enumerate(codes):
        if start is None:
            start = code
        if k + 1 == len(codes) or codes[k + 1] != code + 1:
            out.append(f"\\u{start:04x}" if start == code else f"\\u{start:04x}-\\u{code:04x}")
            start = None
    return "".join(out)


@functools.cache
def patterns() -> tuple[re.Pattern, re.Pattern]:
    """(tokenizers' ByteLevel pattern over the characters it is certain for, a pattern finding any other one).

    Theirs: ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``.
    """
    old = unicodedata.ucd_3_2_0.category
    letters, numbers, spaces, others = [], [], [], []
    for code in range(0x10000):
        char = chr(code)
        category = unicodedata.category(char)
        if category != old(char) or category in ("Cn", "Cs"):
            continue
        if 0x09 <= code <= 0x0D or code == 0x85 or category in ("Zs", "Zl", "Zp"):  # Oniguruma's \s
            spaces.append(code)
        elif category[0] == "L":
            letters.append(code)
        elif category[0] == "N":
            numbers.append(code)
        else:
            others.append(code)
    let, num, space, other = _ranges(letters), _ranges(numbers), _ranges(spaces), _ranges(others)
    split = re.compile(
        rf"{_CONTRACTIONS}| ?[{let}]+| ?[{num}]+| ?[{other}]+|[{space}]+(?![{let}{num}{other}])|[{space}]+"
    )
    return split, re.compile(f"[^{let}{num}{space}{other}]")


def unsupported(config: dict) -> str | None:
    """Why this ``tokenizer.json`` (parsed) cannot be encoded piece by piece, or None when it can."""
    pre = config.get("pre_tokenizer") or {}
    model = config.get("model") or {}
    post = config.get("post_processor")
    if config.get("normalizer") is not None:
        return "it has a normalizer"
    if pre.get("type") != "ByteLevel" or pre.get("add_prefix_space") or not pre.get("use_regex", True):
        return "its pre-tokenizer is not ByteLevel with its regex and no prefix space"
    if model.get("type") != "BPE" or model.get("dropout") is not None:
        return "its model is not BPE without dropout"
    if post is not None and post.get("type") != "ByteLevel":
        return "its post-processor may add tokens"
    if config.get("truncation") is not None or config.get("padding") is not None:
        return "it truncates or pads"
    return None


def _flat(encoded: list[list[int]]) -> tuple[numpy.ndarray, numpy.ndarray]:
    lengths = numpy.fromiter(map(len, encoded), numpy.int64, count=len(encoded))
    return numpy.fromiter(chain.from_iterable(encoded), numpy.int64, count=int(lengths.sum())), lengths


class PieceCache:
    """Ids of texts for a tokenizer that :func:`unsupported` accepts.

    ``encode`` is the tokenizer's own batch call (list of texts -> list of id lists); new pieces go
    through it in one call per batch, and so do the texts this cache does not take.
    """

    def __init__(self, encode, added_tokens: list[str]) -> None:
        self.encode = encode
        self.added = re.compile("|".join(map(re.escape, added_tokens))) if added_tokens else None
        self.split, self.foreign = patterns()
        self.texts_fast = self.texts_slow = 0
        self._reset()

    def _reset(self) -> None:
        self.index: dict[str, int] = {}  # piece -> its row in the table
        self.chars = 0  # the pieces' characters
        self.ids = numpy.empty(0, numpy.int64)  # every piece's ids, one after another
        self.starts = numpy.empty(0, numpy.int64)
        self.lengths = numpy.empty(0, numpy.int64)

    def _learn(self, pieces: list[str]) -> None:
        ids, lengths = _flat(self.encode(pieces))
        self.chars += sum(map(len, pieces))
        starts = self.ids.size + numpy.cumsum(lengths) - lengths
        self.index.update(zip(pieces, range(len(self.index), len(self.index) + len(pieces)), strict=True))
        self.ids = numpy.concatenate([self.ids, ids])
        self.starts = numpy.concatenate([self.starts, starts])
        self.lengths = numpy.concatenate([self.lengths, lengths])

    def _is_plain(self, text: str) -> bool:
        if not text.isascii() and self.foreign.search(text) is not None:
            return False
        return self.added is None or self.added.search(text) is None

    def encode_batch(self, texts: list[str]) -> tuple[numpy.ndarray, numpy.ndarray]:
        """All texts' ids concatenated (int64) and the number of ids of each text."""
        if len(self.index) > MAX_PIECES or self.chars > MAX_CHARS:
            self._reset()
        plain = list(map(self._is_plain, texts))
        pieces = [self.split.findall(t) if ok else [""] for t, ok in zip(texts, plain, strict=True)]  # "": no piece
        counts = numpy.fromiter(map(len, pieces), numpy.int64, count=len(pieces))
        flat = list(chain.from_iterable(pieces))
        rows = numpy.fromiter(map(self.index.get, flat, repeat(-1)), numpy.int64, count=len(flat))
        missing = rows < 0
        if missing.any():
            names = list(compress(flat, missing))
            new = [p for p in dict.fromkeys(names) if p]
            if new:
                self._learn(new)
            rows[missing] = numpy.fromiter(map(self.index.get, names, repeat(-1)), numpy.int64, count=len(names))
        ids, starts, lengths = self.ids, self.starts, self.lengths
        slow = [i for i, ok in enumerate(plain) if not ok]
        if slow:  # each such text is one row of its own, after the table's
            slow_ids, slow_lengths = _flat(self.encode([texts[i] for i in slow]))
            rows[(numpy.cumsum(counts) - 1)[slow]] = lengths.size + numpy.arange(len(slow))
            ids = numpy.concatenate([ids, slow_ids])
            starts = numpy.concatenate([starts, self.ids.size + numpy.cumsum(slow_lengths) - slow_lengths])
            lengths = numpy.concatenate([lengths, slow_lengths])
        per_piece = lengths[rows]
        ends = numpy.cumsum(per_piece)
        tokens = ids[numpy.repeat(starts[rows] - (ends - per_piece), per_piece) + numpy.arange(int(ends[-1:].sum()))]
        bounds = numpy.concatenate([[0], ends])[numpy.concatenate([[0], numpy.cumsum(counts)])]
        self.texts_fast += len(texts) - len(slow)
        self.texts_slow += len(slow)
        return tokens, numpy.diff(bounds)
