"""What shard tokens mean: a built-in byte-level tokenizer, and any local Hugging Face tokenizer.

Preprocessing encodes text into shard tokens with them; provenance (``explain``) decodes tokens
back into text. Both encode a whole batch of texts at once and hand back one flat token array plus the
length of each text, which is what the vectorised writer consumes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Protocol

import numpy

from statefulset import settings
from statefulset.errors import StatefulsetError
from statefulset.shards import piece_cache
from statefulset.shards.piece_cache import PieceCache

BYTES = "bytes"
logger = logging.getLogger("statefulset")


class Tokenizer(Protocol):
    vocab_size: int
    eod: int | None

    def encode_batch(self, texts: list[str]) -> tuple[numpy.ndarray, numpy.ndarray]:
        """All texts' tokens concatenated (int64) and the number of tokens of each text."""
        ...

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary's string for one token id (None when it has none)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255 and 256 as end of document: no vocabulary file, no download."""

    vocab_size = 257
    eod = 256

    def encode_batch(self, texts: list[str]) -> tuple[numpy.ndarray, numpy.ndarray]:
        encoded = [t.encode("utf-8") for t in texts]
        lengths = numpy.fromiter(map(len, encoded), numpy.int64, count=len(encoded))
        return numpy.frombuffer(b"".join(encoded), numpy.uint8).astype(numpy.int64), lengths

    def token_text(self, token_id: int) -> str | None:
        # Bytes have no strings of their own, and 256 is no text at all.
        return None

    def decode(self, tokens: numpy.ndarray) -> str:
        data = numpy.asarray(tokens)
        return bytes(data[data < 256].astype(numpy.uint8)).decode("utf-8", errors="replace")


_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


class HFTokenizer:
    """A local ``tokenizer.json`` (or a folder holding one) through the ``tokenizers`` library.

    ``add_special_tokens`` follows Hugging Face's default (True), as Megatron's
    HuggingFaceTokenizer does. The end-of-document token is ``eod_token`` if given, else the
    ``eos_token`` of a ``tokenizer_config.json`` beside it, else a well-known end token.
    """

    def __init__(
        self, path: str, eod_token: str | None = None, add_special_tokens: bool = True, content: str | None = None
    ) -> None:
        try:
            from tokenizers import Tokenizer as _Backend
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise StatefulsetError(
                f"{path}: Hugging Face tokenizers need the 'tokenizers' package: pip install 'statefulset[tokenizers]'"
            ) from exc
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if content is None and not os.path.isfile(file):
            raise StatefulsetError(f"{file}: no such tokenizer file (need a tokenizer.json or its folder)")
        try:
            # ``content``: the file's text, shipped to a machine that lacks the file (TokenizerSpec.shipped)
            self._backend = _Backend.from_str(content) if content is not None else _Backend.from_file(file)
        except Exception as exc:  # the Rust library raises its own Exception type
            raise StatefulsetError(f"{file}: not a valid tokenizer.json: {exc}") from exc
        self.path = file
        self.add_special_tokens = add_special_tokens
        self.vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        self.eod = self._find_eod(folder, eod_token)
        # encode_batch_fast (tokenizers 0.21+): the same ids as encode_batch, without computing offsets
        self._batch = getattr(self._backend, "encode_batch_fast", None)
        if self._batch is None:
            logger.warning(
                "%s: this tokenizers package has no encode_batch_fast (0.21+): encoding with offsets, slower", file
            )
            self._batch = self._backend.encode_batch
        self._pieces: PieceCache | None = None
        self._pieces_made = False  # made at the first encode_batch: a process that only probes never pays for it

    def piece_cache(self) -> PieceCache | None:
        """The piece cache where it gives this tokenizer's ids (:mod:`statefulset.shards.piece_cache`)."""
        if not self._pieces_made:
            self._pieces, self._pieces_made = self._make_piece_cache(), True
        return self._pieces

    def _make_piece_cache(self) -> PieceCache | None:
        if not settings.PIECE_CACHE.get():
            return None
        config = json.loads(self._backend.to_str())
        reason = piece_cache.unsupported(config)
        if reason is not None:
            logger.debug("%s: every text through the tokenizer's pipeline: %s", self.path, reason)
            return None
        added = [t["content"] for t in config.get("added_tokens") or [] if t.get("content")]
        return PieceCache(self._encode_ids, added)

    def _encode_ids(self, texts: list[str]) -> list[list[int]]:
        encodings = self._batch(texts, add_special_tokens=self.add_special_tokens)
        return [e.ids for e in encodings]

    def _find_eod(self, folder: str, eod_token: str | None) -> int | None:
        if eod_token is not None:
            token_id = self._backend.token_to_id(eod_token)
            if token_id is None:
                if eod_token.isdigit() and int(eod_token) < self.vocab_size:
                    return int(eod_token)
                raise StatefulsetError(f"{self.path}: --eod-token {eod_token!r} is not in the vocabulary")
            return token_id
        config = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(config):
            try:
                with open(config, encoding="utf-8") as f:
                    eos = json.load(f).get("eos_token")
            except (OSError, ValueError) as exc:
                raise StatefulsetError(f"{config}: unreadable: {exc}") from exc
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str) and self._backend.token_to_id(eos) is not None:
                return self._backend.token_to_id(eos)
        for candidate in _EOD_CANDIDATES:
            token_id = self._backend.token_to_id(candidate)
            if token_id is not None:
                return token_id
        return None

    def encode_batch(self, texts: list[str]) -> tuple[numpy.ndarray, numpy.ndarray]:
        pieces = self.piece_cache()
        if pieces is not None:
            return pieces.encode_batch(texts)
        ids = self._encode_ids(texts)
        lengths = numpy.fromiter(map(len, ids), numpy.int64, count=len(ids))
        tokens = numpy.fromiter(chain.from_iterable(ids), numpy.int64, count=int(lengths.sum()))
        return tokens, lengths

    def token_text(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    def decode(self, tokens: numpy.ndarray) -> str:
        return self._backend.decode([int(t) for t in tokens])


@dataclass(frozen=True)
class TokenizerSpec:
    """What to build in each worker process: picklable, cheap to send."""

    name: str = BYTES
    eod_token: str | None = None
    add_special_tokens: bool = True
    content: str | None = field(default=None, repr=False, compare=False)  # see shipped()

    def build(self) -> ByteTokenizer | HFTokenizer:
        if self.name == BYTES:
            if self.eod_token is not None:
                raise StatefulsetError("--eod-token applies to Hugging Face tokenizers; the byte tokenizer's is 256")
            return ByteTokenizer()
        return HFTokenizer(self.name, self.eod_token, self.add_special_tokens, self.content)

    def shipped(self) -> TokenizerSpec:
        """This spec carrying the tokenizer file's text, for workers on machines that do not have the
        file (Ray tasks); the end-of-document token is resolved here, where a ``tokenizer_config.json``
        beside the file can be read."""
        if self.name == BYTES or self.content is not None:
            return self
        built = self.build()
        eod = self.eod_token
        if eod is None and built.eod is not None:
            eod = str(built.eod) if built.token_text(built.eod) is None else built.token_text(built.eod)
        with open(built.path, encoding="utf-8") as f:
            return replace(self, eod_token=eod, content=f.read())

    def fingerprint(self) -> str:
        """What the tokens depend on: the spec and, for a file, a digest of its bytes."""
        if self.name == BYTES:
            return repr(self)
        shipped = self.shipped()
        digest = hashlib.sha256(shipped.content.encode()).hexdigest()[:16]  # type: ignore[union-attr]
        return f"{self!r} sha256:{digest}"
