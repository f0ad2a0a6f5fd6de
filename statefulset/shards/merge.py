"""``merge_datasets``: shards concatenated in the given order into one, streaming, in constant memory.

Folders and globs are expanded in natural order (part_2 before part_10) by
:mod:`statefulset.shards.names`, which also keeps shards of different JSON keys apart.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from statefulset.errors import StatefulsetError
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
    if not prefixes:
        raise StatefulsetError(f"{os.fspath(output_prefix)}: nothing to merge (no input prefixes)")
    first = IndexedDataset(prefixes[0], multimodal=multimodal, validate=False)
    with IndexedDatasetWriter(output_prefix, first.dtype, multimodal) as writer:
        for prefix in prefixes:
            writer.add_index(prefix)
    return IndexedDataset(output_prefix, multimodal=multimodal, validate=False)
