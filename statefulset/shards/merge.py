"""``merge_datasets``: shards concatenated in the given order into one, streaming, in constant memory.

Folders and globs are expanded in natural order (part_2 before part_10) by
:mod:`statefulset.shards.names`, which also keeps shards of different JSON keys apart. Loss-mask
shards (:mod:`statefulset.shards.loss_masks`) are merged along with their token shards: when any
input has one, the output has one, with ones for the inputs that have none.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from statefulset.errors import StatefulsetError
from statefulset.shards import loss_masks
from statefulset.shards.reader import IndexedDataset
from statefulset.shards.writer import IndexedDatasetWriter


def merge_datasets(
    prefixes: Iterable[str | os.PathLike[str]],
    output_prefix: str | os.PathLike[str],
    *,
    multimodal: bool = False,
) -> IndexedDataset:
    """Concatenate shards in the given order into ``output_prefix``, in constant memory."""
    prefixes = [os.fspath(p) for p in prefixes]
    output_prefix = os.fspath(output_prefix)
    if not prefixes:
        raise StatefulsetError(f"{output_prefix}: nothing to merge (no input prefixes)")
    first = IndexedDataset(prefixes[0], multimodal=multimodal, validate=False)
    masked = [loss_masks.exists(p) for p in prefixes]
    out_mask = loss_masks.mask_prefix(output_prefix)
    if any(masked):
        _merge_masks(prefixes, masked, out_mask)  # first: never new tokens beside an old mask shard
    else:
        for ext in (".idx", ".bin"):  # a stale mask shard of an earlier merge into this prefix
            if os.path.lexists(out_mask + ext):
                os.remove(out_mask + ext)
    with IndexedDatasetWriter(output_prefix, first.dtype, multimodal) as writer:
        for prefix in prefixes:
            writer.add_index(prefix)
    return IndexedDataset(output_prefix, multimodal=multimodal, validate=False)


def _merge_masks(prefixes: list[str], masked: list[bool], out_mask: str) -> None:
    """The inputs' mask shards (each checked against its token shard), ones for an input without one."""
    with IndexedDatasetWriter(out_mask, loss_masks.MASK_DTYPE) as writer:
        for prefix, has_mask in zip(prefixes, masked, strict=True):
            tokens = IndexedDataset(prefix, validate=False)
            if has_mask:
                loss_masks.open_mask(tokens)  # refused here when it does not match its tokens
                writer.add_index(loss_masks.mask_prefix(prefix))
                continue
            for values, lengths, per_document in loss_masks.ones_like(tokens):
                writer.add_documents(values, lengths, sequences_per_document=per_document)
