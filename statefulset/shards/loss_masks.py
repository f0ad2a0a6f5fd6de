"""Loss-mask shards: ``<prefix>_loss_mask.{bin,idx}`` beside a token shard (CONTRACT §16).

A mask shard is a shard of uint8 values, one per token of its token shard, with the same sequence
lengths and documents: 1 where the loss counts on the token (it came from a ``"loss": true``
segment), 0 elsewhere. ``statefulset preprocess`` writes one for a key that held segment lists
(:mod:`statefulset.tools.segments`); the loader reads it along the same token ranges as the tokens.
A mask shard whose dtype, sequence lengths or documents differ from its token shard's is refused
at open, naming both files.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy

from statefulset.errors import StatefulsetError
from statefulset.shards.faults import bounded_call, with_retries
from statefulset.shards.names import MASK_SUFFIX
from statefulset.shards.reader import IndexedDataset
from statefulset.shards.remote import open_filesystem
from statefulset.shards.storage import local_path

MASK_DTYPE = numpy.dtype(numpy.uint8)
_DOCUMENTS_PER_BLOCK = 1 << 18  # merge_datasets writes ones for an unmasked input in blocks of documents


def mask_prefix(prefix: str) -> str:
    """Where the mask shard of the token shard ``prefix`` lives."""
    return prefix + MASK_SUFFIX


def is_mask_prefix(prefix: str) -> bool:
    return prefix.endswith(MASK_SUFFIX)


def exists(prefix: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether the mask shard of ``prefix`` is there (its ``.idx``; the ``.bin`` is checked when opened)."""
    idx = mask_prefix(prefix) + ".idx"
    local = local_path(idx)
    if local is not None:
        return os.path.exists(local)
    fs, path = open_filesystem(idx, storage_options)
    return bool(with_retries(idx, lambda: bounded_call(idx, "look up", fs, "exists", path), "look up"))


def open_mask(tokens: IndexedDataset, facts_dir: str | None = None) -> IndexedDataset | None:
    """The mask shard beside ``tokens``, checked against it; None when there is none."""
    if not exists(tokens.path_prefix, tokens.storage_options):
        return None
    mask = IndexedDataset(mask_prefix(tokens.path_prefix), storage_options=tokens.storage_options, facts_dir=facts_dir)
    check_matches(tokens, mask)
    return mask


def check_matches(tokens: IndexedDataset, mask: IndexedDataset) -> None:
    """A ``StatefulsetError`` naming both files when ``mask`` does not describe ``tokens`` token for token."""
    both = f"{mask.path_prefix}.idx does not match its token shard {tokens.path_prefix}.idx"
    if mask.dtype != MASK_DTYPE:
        raise StatefulsetError(f"{both}: a loss mask holds uint8 values, this one {mask.dtype}")
    if len(mask) != len(tokens):
        raise StatefulsetError(f"{both}: {len(mask)} sequences, the token shard {len(tokens)}")
    differ = numpy.flatnonzero(mask.sequence_lengths != tokens.sequence_lengths)
    if differ.size:
        i = int(differ[0])
        raise StatefulsetError(
            f"{both}: sequence {i} has {int(mask.sequence_lengths[i])} values, the token shard "
            f"{int(tokens.sequence_lengths[i])} tokens ({differ.size} sequences differ)"
        )
    if not numpy.array_equal(mask.document_indices, tokens.document_indices):
        raise StatefulsetError(f"{both}: the documents differ (document indices)")


def ones_like(tokens: IndexedDataset) -> Iterator[tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]]:
    """``(values, lengths, sequences per document)`` blocks of an all-ones mask for ``tokens``: what an
    unmasked shard contributes to a merged mask shard."""
    bounds = numpy.asarray(tokens.document_indices, dtype=numpy.int64)
    lengths = tokens.sequence_lengths
    for first in range(0, bounds.size - 1, _DOCUMENTS_PER_BLOCK):
        ends = bounds[first : first + _DOCUMENTS_PER_BLOCK + 1]
        block = numpy.asarray(lengths[ends[0] : ends[-1]], dtype=numpy.int64)
        yield numpy.ones(int(block.sum()), MASK_DTYPE), block, numpy.diff(ends)
