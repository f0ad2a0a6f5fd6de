"""``packing: bestfit``: samples of whole documents (best-fit decreasing in windows), padded with ``pad_id``.

Sources are :class:`statefulset.index.bestfit.source.BestFitSource` (their packed index comes
from the content-keyed index cache, or is built once, in one pass), blended position by position
by the native blend tree (:mod:`statefulset.index.native.blend_tree`), so a bestfit stream has
the shape of a native one: every ``p >= 0`` is a sample, a restore is a seek.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy

from statefulset.index.bestfit.source import BestFitSource, build_index, window_documents
from statefulset.index.cache import IndexCache
from statefulset.index.native.keys import derive_key
from statefulset.spec.model import DatasetSpec
from statefulset.spec.splits import SPLITS
from statefulset.streams.base import BlendedStream, OpenedSources
from statefulset.streams.documents import Pieces, packed_pieces
from statefulset.streams.label_masks import gather_ranges
from statefulset.streams.overview import logs_here

logger = logging.getLogger("statefulset")
# Above this share of padding a bestfit source is worth a WARNING: its documents are mostly much
# shorter than a sample, which best fit cannot fix (a sample holds what fits, the rest is pad_id).
PADDING_WARNING = 0.25

DEFAULT_PAD_ID = -1
BESTFIT_VERSION = 1  # of the dealing and packing rules: part of every cache key and fingerprint
_INDEX_VERSION = 2  # of the stored index's arrays (a cache key part only)


class BinFiller:
    def __init__(self, source: BestFitSource, pad_id: int) -> None:
        self.source = source
        self.pad_id = pad_id

    def fill(
        self, local: numpy.ndarray, out: numpy.ndarray, want: bool = False, masks: numpy.ndarray | None = None
    ) -> Pieces | None:
        starts, lengths, counts, used = self.source.plan(local)
        width = out.shape[1]
        padded = None if all(u == width for u in used) else used
        gather_ranges(self.source.dataset, starts, lengths, out, masks, padded, self.pad_id)
        if not want:
            return None
        return packed_pieces(counts + used + lengths, len(counts))


class BestFitStream(BlendedStream):
    """Bins of whole documents of each source, blended position by position."""

    def __init__(self, spec, split, identity, sources: list[BestFitSource], weights: list[float], pad_id: int):
        fillers = [BinFiller(s, pad_id) for s in sources]
        super().__init__(spec, split, identity, sources, fillers, weights, one_pass=split != "train")
        self.pad_id = pad_id
        self.padded = True


def check_pad_id(spec: DatasetSpec, opened: OpenedSources) -> int:
    """The spec's pad id, refused when it is a token id the shards can hold."""
    pad_id = DEFAULT_PAD_ID if spec.pad_id is None else spec.pad_id
    for dataset in opened.datasets:
        info = numpy.iinfo(dataset.dtype)
        if 0 <= pad_id <= info.max:
            raise spec.error(
                "pad_id",
                f"{pad_id} is a token id of {dataset.path_prefix} ({dataset.dtype} holds 0..{info.max}); padding "
                f"must differ from every token: use a negative id (default {DEFAULT_PAD_ID}) or one above {info.max}",
            )
    if not -(2**63) <= pad_id < 2**63:
        raise spec.error("pad_id", f"{pad_id} does not fit in int64")
    return pad_id


def bestfit_sources(spec: DatasetSpec, split: str, opened: OpenedSources, keys: list[int]) -> list[BestFitSource]:
    """Each source's packed index (cached, or built in one pass) under its key."""
    cache = IndexCache(opened.cache_root)
    capacity = spec.seq_length + 1
    sources = []
    for dataset, (lo, hi), digest, key in zip(opened.datasets, opened.ranges, opened.digests, keys, strict=True):
        first, last = dataset.token_span(lo, hi)
        window = window_documents(hi - lo, last - first, capacity)
        description = {
            "kind": "BestFitIndex",
            "version": BESTFIT_VERSION,
            "index_version": _INDEX_VERSION,
            "content_digest": digest,
            "sequences": [lo, hi],
            "seq_length": spec.seq_length,
            "key": key,
            "window": window,
        }

        def build(dataset=dataset, lo=lo, hi=hi, key=key, window=window) -> dict[str, numpy.ndarray]:
            return build_index(dataset, (lo, hi), spec.seq_length, key, window)

        with spec.blame("path_to_cache"):
            index = cache.get_or_build("BestFitIndex", description, build)
        with spec.blame(spec.data_key(split)):
            sources.append(BestFitSource(dataset, (lo, hi), spec.seq_length, key, window, index))
        _warn_padding(sources[-1], last - first, hi - lo, capacity, split)
    return sources


def _warn_padding(source: BestFitSource, tokens: int, sequences: int, capacity: int, split: str) -> None:
    """A WARNING (rank 0, not in workers) when a source's samples are mostly padding."""
    slots = source.samples_per_epoch * capacity
    padding = 1 - tokens / slots if slots else 0.0
    if padding <= PADDING_WARNING or not logs_here():
        return
    logger.warning(
        "statefulset: packing bestfit: %s (%s split) is %.1f%% padding: its %d sequences average %.0f tokens "
        "while a sample holds seq_length + 1 = %d; lower seq_length, or use packing native (no padding)",
        source.dataset.path_prefix, split, 100 * padding, sequences, tokens / max(sequences, 1), capacity,
    )  # fmt: skip


def open_bestfit(spec: DatasetSpec, split: str, identity: dict[str, Any], opened: OpenedSources) -> BestFitStream:
    """Each source's packed index (cached, or built in one pass), blended as native sources are."""
    pad_id = check_pad_id(spec, opened)
    keys = [derive_key(spec.seed, i, SPLITS.index(split)) for i in range(len(opened.datasets))]
    sources = bestfit_sources(spec, split, opened, keys)
    identity["pad_id"] = pad_id
    identity["bestfit"] = BESTFIT_VERSION
    weights = [float(w) for _, w in opened.live] if opened.weighted else [float(s.samples_per_epoch) for s in sources]
    return BestFitStream(spec, split, identity, sources, weights, pad_id)
