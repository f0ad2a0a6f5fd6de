"""Segment lists and their loss-mask shards (CONTRACT §16, docs/instruction-data.md).

A JSON key (or Parquet column) may hold a list of segments ``[{"text": ..., "loss": bool}, ...]``
instead of a string: each segment is tokenised on its own, the tokens are concatenated into one
sequence, and a mask shard ``<prefix>_<key>_document_loss_mask`` (uint8, one value per token, the
same sequences and documents) records each token's ``loss`` (default true). The EOD appended by
``--append-eod`` takes the loss of the document's last segment.

A key whose values are strings in some lines and segment lists in others is one corpus: a string
is one segment with ``loss`` true (pre-training text mixed into instruction data). A key with no
segment list in the whole run gets no mask shard (and a stale one left by an earlier run at that
prefix is removed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy

from statefulset.shards.loss_masks import MASK_DTYPE, mask_prefix
from statefulset.shards.writer import IndexedDatasetWriter
from statefulset.tools import locations


@dataclass
class Value:
    """One key's value in one line: its texts, and per text whether the loss counts on it. ``segments``:
    the texts are the segments of one sequence (else each text is a sequence of its own)."""

    texts: list[str]
    losses: list[bool]
    segments: bool


def parse_value(value: object, key: str, chat: Any = None) -> Value | str:
    """A string, a list of strings, a list of segments or (with ``chat``, a
    :class:`~statefulset.tools.chat.ChatRenderer`) a conversation; else the reason it is refused."""
    if chat is not None and isinstance(value, list) and value and isinstance(value[0], dict) and "role" in value[0]:
        found = chat.segments(value, key)
        if isinstance(found, str):
            return found
        return Value([t for t, _ in found], [loss for _, loss in found], True)
    if isinstance(value, str):
        return Value([value], [True], False)
    if not isinstance(value, list):
        kind = "null" if value is None else type(value).__name__
        return f"key {key!r} must be a string or a list of strings or of segments, got {kind}"
    if all(isinstance(v, str) for v in value):
        return Value(list(value), [True] * len(value), False)
    texts, losses = [], []
    for i, segment in enumerate(value):
        if not isinstance(segment, dict) or not isinstance(segment.get("text"), str):
            return (
                f"key {key!r}: segment {i} must be an object with a string 'text' (and an optional boolean "
                f"'loss'), got {_shown(segment)}"
            )
        loss = segment.get("loss", True)
        if loss is None:  # a Parquet struct without the field reads as null
            loss = True
        if not isinstance(loss, bool):
            return f"key {key!r}: segment {i}'s 'loss' must be true or false, got {_shown(loss)}"
        texts.append(segment["text"])
        losses.append(loss)
    return Value(texts, losses, True)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def piece_masks(losses: numpy.ndarray, piece_lengths: numpy.ndarray) -> numpy.ndarray:
    """uint8, one per token: each text's loss repeated over its tokens."""
    return numpy.repeat(losses.astype(MASK_DTYPE), piece_lengths)


class MaskOutputs:
    """The mask shards of a run's keys, begun at a key's first segment list (the documents before it
    get ones, shaped like its token shard so far) and fed ones for the chunks without segments."""

    def __init__(self, outputs: dict[str, str]) -> None:
        self.prefixes = {k: mask_prefix(p) for k, p in outputs.items()}
        self.staged: dict[str, locations.StagedOutput] = {}
        self.writers: dict[str, IndexedDatasetWriter] = {}

    def add(self, key: str, arrays: Any, token_writer: IndexedDatasetWriter) -> None:
        """One chunk's masks for ``key`` (``arrays.loss_mask`` None: no segment list in it); called before
        its tokens go to ``token_writer``, which then holds exactly the documents before this chunk."""
        if key not in self.writers and arrays.loss_mask is None:
            return
        writer = self.writer(key, token_writer)
        mask = numpy.ones(arrays.tokens.size, MASK_DTYPE) if arrays.loss_mask is None else arrays.loss_mask
        writer.add_documents(mask, arrays.sequence_lengths, sequences_per_document=arrays.sequences_per_document)

    def writer(self, key: str, token_writer: IndexedDatasetWriter) -> IndexedDatasetWriter:
        """``key``'s mask writer; a new one first gets ones shaped as ``token_writer``'s documents so far."""
        writer = self.writers.get(key)
        if writer is None:
            self.staged[key] = locations.StagedOutput(self.prefixes[key])
            writer = self.writers[key] = IndexedDatasetWriter(self.staged[key].local, MASK_DTYPE)
            writer.add_shaped_like(token_writer, 1)
        return writer

    def discard(self) -> None:
        locations.discard_all(self.writers, self.staged)

    def publish(self) -> None:
        """Close and publish each mask shard; remove a stale local one where this run wrote none."""
        for key, prefix in self.prefixes.items():
            if key not in self.writers and not locations.is_url(prefix):
                for ext in (".idx", ".bin"):  # the .idx first: never an index without its tokens
                    if os.path.lexists(prefix + ext):
                        os.remove(prefix + ext)
        locations.publish_all(self.writers, self.staged)
