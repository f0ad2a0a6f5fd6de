"""Opening a spec's split into its sample stream: ``open_stream(spec, split)``.

It reads the spec, opens every source's shards, computes the split's sequence ranges and the
stream's identity (what a state's fingerprint covers: packing, split, seq_length, seed and each
source's content digest, of its ``.idx`` and its ``.bin`` (:mod:`statefulset.shards.digests`),
range and weight), then hands over to the packing
(:mod:`statefulset.streams.megatron`, :mod:`statefulset.streams.native`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy

from statefulset import settings
from statefulset.errors import StatefulsetError
from statefulset.index.cache import builds as cache_builds
from statefulset.shards import loss_masks
from statefulset.shards.digests import ShardDigest, identify, shard_checks
from statefulset.shards.identifying import Identifications
from statefulset.shards.reader import IndexedDataset
from statefulset.spec.model import DatasetSpec, load_spec
from statefulset.spec.splits import SPLITS, parse_split, split_matrix, split_range
from statefulset.streams.base import OpenedSources, SampleStream
from statefulset.streams.bestfit import open_bestfit
from statefulset.streams.megatron import build_ahead, open_megatron
from statefulset.streams.members import members_of, trim
from statefulset.streams.native import open_native
from statefulset.streams.overview import record_open
from statefulset.streams.stages import open_staged


def open_stream(spec: DatasetSpec | str | os.PathLike[str] | Mapping[str, Any], split: str = "train") -> SampleStream:
    """The stream of ``split`` ("train", "valid" or "test") described by ``spec``.

    Every ``StatefulsetError`` raised here names the spec's file (``spec.source``), and the key at
    fault where one is. Logs what it opened at INFO on the ``statefulset`` logger
    (:mod:`statefulset.streams.overview`).
    """
    started, before = time.perf_counter(), dict(cache_builds)
    stream = _open_stream(spec, split)
    built = {kind: n - before.get(kind, 0) for kind, n in cache_builds.items() if n > before.get(kind, 0)}
    where = os.fspath(spec) if isinstance(spec, str | os.PathLike) else "spec"
    record_open(stream, time.perf_counter() - started, built, where)
    return stream


def _open_stream(spec: DatasetSpec | str | os.PathLike[str] | Mapping[str, Any], split: str) -> SampleStream:
    if split not in SPLITS:
        raise StatefulsetError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not isinstance(spec, DatasetSpec):
        spec = load_spec(spec)
    try:
        stream = _open(spec, split)
    except StatefulsetError as exc:
        if str(exc).startswith(f"{spec.source}: "):
            raise
        raise type(exc)(f"{spec.source}: {exc}") from exc  # a shard or cache error: say which spec
    stream.reopen = _open_stream
    return stream


def cache_folder(spec: DatasetSpec) -> str:
    """The spec's ``path_to_cache``, or this node's default (``<user cache>/indices``) when it is null."""
    return spec.path_to_cache or os.path.join(settings.user_cache_dir(), "indices")


def _open(spec: DatasetSpec, split: str) -> SampleStream:
    live, num_samples = _live_blend(spec, split)
    per_split = spec.data_path is None and spec.stages is None
    # Derived indices and facts about shard versions (full check passed, content digest) live in
    # path_to_cache, so every node that mounts it trusts them; without one, in this node's default
    # cache, so that processes and workers of a node never rebuild what another one built.
    cache_root = cache_folder(spec)
    memo = os.path.join(cache_root, "facts")
    datasets, ranges, found, ahead = _open_sources(spec, split, live, per_split, memo, num_samples)
    digests = [d.content for d in found]
    # A plain data_path is the one-stage schedule (CONTRACT §12): the same stream, so a state saved
    # on it restores into a schedule that begins with it and a run can be annealed later.
    scheduled = split == "train" and (
        spec.stages is not None or (spec.data_path is not None and spec.packing in ("native", "bestfit"))
    )
    identity = _identity(spec, split, per_split, num_samples, scheduled, live, ranges, found)
    weighted = live[0][1] is not None
    opened = OpenedSources(live, weighted, per_split, num_samples, datasets, ranges, digests, cache_root, ahead)
    stream = _hand_over(spec, split, identity, opened, scheduled)
    _describe_sources(stream, live, datasets, ranges, found)
    return stream


def _live_blend(spec: DatasetSpec, split: str) -> tuple[list[tuple[str, float | None]], int | None]:
    """The split's sources with a weight above zero (or no weight), and its sample count; refuses an empty split."""
    selected = spec.blend_for(split)
    if selected is None:
        if spec.data_path is not None:
            raise spec.error("split", f"the {split} split is empty (split {spec.split!r} gives it no share)")
        raise spec.error(split, f"the {split} split is empty: the spec has no {split}: section")
    blend, num_samples = selected
    return [(prefix, weight) for prefix, weight in blend if weight is None or weight > 0], num_samples


def _open_sources(
    spec: DatasetSpec,
    split: str,
    live: list[tuple[str, float | None]],
    per_split: bool,
    memo: str,
    num_samples: int | None,
) -> tuple[list[IndexedDataset], list[tuple[int, int]], list[ShardDigest], dict[int, Any]]:
    """Each source's shards (with its loss mask), its sequence range in the split, and its digest, in order;
    and what the packing built while the ``.idx`` files new to this machine were hashed (:func:`build_ahead`)."""
    if per_split:
        bookends: tuple[float, float] = (0.0, 1.0)
    else:
        bookends = split_matrix(parse_split(spec.split))[SPLITS.index(split)]
    datasets, ranges = [], []
    data_key = spec.data_key(split)
    with Identifications(memo) as identifying:
        for prefix, _ in live:
            with spec.blame(data_key):
                dataset = IndexedDataset(prefix, storage_options=spec.storage_options, facts_dir=memo)
                identifying.start(dataset)
            lo_hi = split_range(bookends, len(dataset))
            if lo_hi is None or lo_hi[1] <= lo_hi[0]:
                if per_split:
                    raise spec.error(data_key, f"{prefix} holds no sequences")
                raise spec.error(
                    "split",
                    f"{prefix}: the {split} split of split {spec.split!r} holds no sequences of its {len(dataset)}",
                )
            datasets.append(dataset)
            ranges.append(lo_hi)
            with spec.blame(data_key):
                dataset.loss_mask = loss_masks.open_mask(dataset, memo)
        ahead = build_ahead(spec, split, live, per_split, datasets, ranges, num_samples) if identifying.hashing else {}
        with spec.blame(data_key):
            found = identifying.results()
            found = [with_mask(d, dataset.loss_mask, memo) for d, dataset in zip(found, datasets, strict=True)]
    return datasets, ranges, found, ahead


def _identity(
    spec: DatasetSpec,
    split: str,
    per_split: bool,
    num_samples: int | None,
    scheduled: bool,
    live: list[tuple[str, float | None]],
    ranges: list[tuple[int, int]],
    found: list[ShardDigest],
) -> dict[str, Any]:
    """What a state's fingerprint covers: packing, split, seq_length, seed and the sources (CONTRACT §12)."""
    identity: dict[str, Any] = {
        "packing": spec.packing,
        "split": split,
        "split_ratios": None if per_split else spec.split,
        "seq_length": spec.seq_length,
        "seed": spec.seed,
        "num_samples": num_samples if spec.packing == "megatron" else None,
    }
    # A schedule's weights live in its stages, so its sources are described without them.
    described_live = [(prefix, None) for prefix, _ in live] if scheduled else live
    identity["data"] = _sources_digest([{"digest": d.content} for d in found], ranges, live)
    # Per source, a few hex digits of its .idx/range/weight and of its .bin: what lets a refused
    # restore name the shard that changed (identity["data"] is what decides).
    described = [
        _sources_digest([{"idx_digest": d.idx}], [r], [x])
        for d, r, x in zip(found, ranges, described_live, strict=True)
    ]
    identity["shards"] = shard_checks(described, [d.bin for d in found])
    # So that a refusal can say which weight or range differs (streams.members), while small.
    identity["members"] = members_of([d.content for d in found], ranges, [w for _, w in described_live])
    trim(identity)
    return identity


def _hand_over(
    spec: DatasetSpec, split: str, identity: dict[str, Any], opened: OpenedSources, scheduled: bool
) -> SampleStream:
    """The stream the spec's packing (or its schedule of stages) makes of the opened sources."""
    if scheduled:
        return open_staged(spec, split, identity, opened)
    if spec.packing == "native":
        return open_native(spec, split, identity, opened)
    if spec.packing == "bestfit":
        return open_bestfit(spec, split, identity, opened)
    return open_megatron(spec, split, identity, opened)


def _describe_sources(
    stream: SampleStream,
    live: list[tuple[str, float | None]],
    datasets: list[IndexedDataset],
    ranges: list[tuple[int, int]],
    found: list[ShardDigest],
) -> None:
    """Set what the loader needs to know of the stream's sources on ``stream``."""
    # Batches travel between processes in the narrowest dtype that holds every source's tokens
    # (and the padding id, for packing bestfit).
    dtypes = [d.dtype for d in datasets]
    if stream.padded:
        dtypes.append(numpy.min_scalar_type(stream.pad_id))  # type: ignore[attr-defined]
    stream.token_dtype = numpy.result_type(*dtypes)
    stream.remote = any(d.is_remote for d in datasets)
    stream.source_prefixes = [prefix for prefix, _ in live]
    # What "data" was before identities covered the .bin (statefulset 0.1.0): such states restore
    # when their .idx, ranges and weights match (statefulset.loading.state.check_identity).
    stream.legacy_data = _sources_digest([{"idx_digest": d.idx} for d in found], ranges, live)
    # A mask shard is read as its tokens are: pinned and checked for replacement the same way.
    stream.shards = list(datasets) + [d.loss_mask for d in datasets if d.loss_mask is not None]
    stream.masked = any(d.loss_mask is not None for d in datasets)


def with_mask(tokens: ShardDigest, mask: IndexedDataset | None, memo: str) -> ShardDigest:
    """A source's digest: its token shard's, and its mask shard's where it has one (so that a mask shard
    that appears, goes or changes makes another source, and a state saved on the other is refused)."""
    if mask is None:
        return tokens
    masks = identify(mask, memo)

    def both(a: str, b: str) -> str:
        return hashlib.blake2b(f"{a}+loss_mask:{b}".encode(), digest_size=16).hexdigest()

    return ShardDigest(both(tokens.idx, masks.idx), both(tokens.bin, masks.bin))


def _sources_digest(digests: list[dict[str, str]], ranges: list[tuple[int, int]], live: list[Any]) -> str:
    described = [{**d, "sequences": list(r), "weight": w} for d, r, (_, w) in zip(digests, ranges, live, strict=True)]
    return hashlib.blake2b(json.dumps(described).encode(), digest_size=12).hexdigest()
