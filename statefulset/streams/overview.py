"""What an opened stream holds, per source: the figures megatron-core logs when it builds or loads.

:func:`describe` reads them off the opened stream in O(1) per source (binary searches in the
mapped ``.idx`` and the lengths of the built index arrays; a blend's realised shares come from
the per-source counts the open already takes), so logging them never adds a pass over the corpus.
:func:`log_open` writes them at INFO on the ``statefulset`` logger, once per job (global rank 0,
never in loader workers), as megatron-core's ``log_single_rank`` does. ``statefulset inspect
SPEC.yaml`` (:mod:`statefulset.tools.preview`) prints the same figures.
"""

from __future__ import annotations

import bisect
import logging
import sys
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from statefulset.index.megatron.gpt import plan_epochs

if TYPE_CHECKING:
    from statefulset.shards.reader import IndexedDataset
    from statefulset.streams.base import SampleStream

logger = logging.getLogger("statefulset")


@dataclass
class SourceOverview:
    """One source (a prefix's split) of a stream."""

    prefix: str
    sequence_range: list[int]  # [first, end) sequence ids of the split in the shard
    sequences: int
    documents: int  # documents whose first sequence lies in the range
    tokens: int
    samples_per_epoch: int  # samples one pass over the range gives
    weight: float | None  # the requested weight, normalised over the sources (None: blended by size)
    share: float  # the share of the split's samples it actually serves
    samples: int | None = None  # megatron: samples of its built index (GPTDataset length)
    epochs: int | None = None  # megatron: epochs the index was built over
    separate_final_epoch: bool | None = None  # megatron: the last epoch shuffled apart
    built_for: int | None = None  # megatron: num_samples the index was built for (None: one epoch)
    blend_samples: int | None = None  # megatron blend: samples the blend draws from this source
    epochs_at_num_samples: float | None = None  # native: passes over this source that num_samples makes


@dataclass
class SplitOverview:
    """One split of a spec, as opened."""

    split: str
    packing: str
    seq_length: int
    seed: int
    num_samples: int | None  # requested (megatron: what the train split is built for)
    samples: int | None  # samples served: len(stream), or None for native train (every position is a sample)
    samples_per_epoch: int  # native: one pass over every source's windows; megatron: sum over sources
    cache: str | None
    sources: list[SourceOverview] = field(default_factory=list)
    # A data schedule (train split of a spec with stages:): each stage's start and normalised weights.
    stages: list[dict[str, Any]] = field(default_factory=list)
    seconds: float | None = None  # time the open took
    built: dict[str, int] = field(default_factory=dict)  # cache entries this open built, by kind

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self, settings: bool = True) -> list[str]:
        """Readable lines: the split (with packing, seq_length and seed when ``settings``), then each source."""
        size = f"{self.samples:,} samples" if self.samples is not None else "unbounded (any position)"
        asked = f", num_samples {self.num_samples:,}" if self.num_samples is not None else ""
        shown = f", packing {self.packing}, seq_length {self.seq_length}, seed {self.seed}" if settings else ""
        head = [f"{self.split}: {size}, {self.samples_per_epoch:,} samples per epoch{shown}{asked}"]
        if self.seconds is not None:
            made = ", ".join(f"{n} {kind}" for kind, n in sorted(self.built.items()))
            if made:
                how = f"; built {made} indices"
            else:
                how = "; indices loaded from the cache" if self.packing == "megatron" else " (nothing to build)"
            head.append(f"  opened in {self.seconds:.2f} s{how}")
        for k, stage in enumerate(self.stages):
            until = f" until {self.stages[k + 1]['start']:,}" if k + 1 < len(self.stages) else " on"
            mix = ", ".join(f"{prefix} {w:.4f}" for prefix, w in stage["weights"].items())
            head.append(f"  stage {k} (from {stage['start']:,}{until}): {mix}")
        for s in self.sources:
            head.append(f"  {s.prefix}")
            lo, hi = s.sequence_range
            head.append(
                f"    sequences [{lo:,}, {hi:,}) = {s.sequences:,}, documents {s.documents:,}, tokens {s.tokens:,}, "
                f"{s.samples_per_epoch:,} samples per epoch"
            )
            if s.epochs is not None:
                goal = f"num_samples {s.built_for:,}" if s.built_for is not None else "one epoch"
                apart = ", final epoch separate" if s.separate_final_epoch else ""
                head.append(f"    index built for {goal}: {s.samples:,} samples over {s.epochs} epoch(s){apart}")
            if s.epochs_at_num_samples is not None:
                head.append(f"    num_samples {self.num_samples:,} passes over it {s.epochs_at_num_samples:.2f} times")
            if self.stages:
                wanted = "weights by stage (above)"
            else:
                wanted = f"weight {s.weight:.4f}" if s.weight is not None else "no weight (blended by size)"
            drawn = f" ({s.blend_samples:,} samples)" if s.blend_samples is not None else ""
            if len(self.sources) > 1:
                head.append(f"    {wanted}, realised share {s.share:.4f}{drawn}")
        return head


def _tokens(dataset: IndexedDataset, lo: int, hi: int) -> int:
    """Tokens of sequences [lo, hi): validated pointers are the running byte sum of the lengths."""
    if hi <= lo:
        return 0
    last = int(dataset.sequence_pointers[hi - 1]) + int(dataset.sequence_lengths[hi - 1]) * dataset.dtype.itemsize
    return (last - int(dataset.sequence_pointers[lo])) // dataset.dtype.itemsize


def _documents(dataset: IndexedDataset, lo: int, hi: int) -> int:
    """Documents starting in sequences [lo, hi): two binary searches (bisect reads the unaligned
    mapped array in place, where numpy.searchsorted would copy it first)."""
    starts = dataset.document_indices
    last = len(starts) - 1  # the final entry is the end, not a document
    return bisect.bisect_left(starts, hi, 0, last) - bisect.bisect_left(starts, lo, 0, last)


def _normalised(weights: list[float | None]) -> list[float | None]:
    if any(w is None for w in weights):
        return [None] * len(weights)
    total = sum(w for w in weights if w is not None)
    return [w / total for w in weights if w is not None]


def describe(stream: SampleStream) -> SplitOverview:
    """The figures of an opened stream, source by source, in O(1) per source."""
    spec = stream.spec
    blend, num_samples = spec.blend_for(stream.split) or ([], None)
    live = [w for _, w in blend if w is None or w > 0]
    # A megatron blend without num_samples (valid/test) is blended by size whatever the weights.
    by_weight = len(live) > 1 and (stream.packing != "megatron" or num_samples is not None)
    weights = _normalised(live) if by_weight else [None] * len(live)
    overview = SplitOverview(
        stream.split,
        stream.packing,
        stream.seq_length,
        spec.seed,
        num_samples,
        None if stream.unbounded and stream.split == "train" else len(stream),  # valid/test: one pass
        0,
        spec.path_to_cache,
    )
    sources: list[Any] = stream.sources  # type: ignore[attr-defined]
    for i, source in enumerate(sources):
        dataset = source.dataset
        lo, hi = source.sequence_range
        tokens = _tokens(dataset, lo, hi)
        item = SourceOverview(
            dataset.path_prefix,
            [lo, hi],
            hi - lo,
            _documents(dataset, lo, hi),
            tokens,
            max(0, (tokens - 1) // stream.seq_length),
            weights[i],
            1.0,
        )
        if stream.packing == "bestfit":
            item.samples_per_epoch = source.samples_per_epoch  # bins, not windows
        if stream.packing == "megatron":
            item.samples = len(source)
            item.epochs = int(source.document_index.shape[0]) // max(hi - lo, 1)
            item.built_for = source.num_samples
            item.separate_final_epoch = plan_epochs(tokens, stream.seq_length, source.num_samples).separate_final_epoch
        overview.sources.append(item)
    counts = getattr(stream, "blend_counts", None)
    if counts is not None:  # megatron blend: what the built blend index draws from each source
        for item, count in zip(overview.sources, counts.tolist(), strict=True):
            item.blend_samples = int(count)
            item.share = count / max(len(stream), 1)
    elif stream.packing in ("native", "bestfit") and len(sources) > 1:
        total = sum(stream.weights)  # type: ignore[attr-defined]
        for item, w in zip(overview.sources, stream.weights, strict=True):  # type: ignore[attr-defined]
            item.share = w / total  # exact by construction, within ceil(log2 K) samples at any prefix
    if stream.packing in ("native", "bestfit") and num_samples is not None:
        for item in overview.sources:
            item.epochs_at_num_samples = num_samples * item.share / max(item.samples_per_epoch, 1)
    if spec.stages is not None and stream.split == "train":
        overview.stages = _stages(stream)
    overview.samples_per_epoch = sum(s.samples_per_epoch for s in overview.sources)
    overview.seconds, overview.built = stream.open_seconds, dict(stream.open_built)
    return overview


def _stages(stream: Any) -> list[dict[str, Any]]:
    """Each stage's start and its sources' normalised weights (a schedule's train stream)."""
    out = []
    for start, members, weights in zip(stream.starts.tolist(), stream.stage_sources, stream.stage_weights, strict=True):
        total = sum(weights)
        out.append(
            {"start": start, "weights": {stream.prefixes[m]: w / total for m, w in zip(members, weights, strict=True)}}
        )
    return out


def logs_here() -> bool:
    """Global rank 0 and not a loader worker: the one process of a job that logs what it opened."""
    torch = sys.modules.get("torch")
    if torch is None:
        return True
    data = getattr(getattr(torch, "utils", None), "data", None)
    if data is not None and data.get_worker_info() is not None:
        return False
    dist = getattr(torch, "distributed", None)
    return dist is None or not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def record_open(stream: SampleStream, seconds: float, built: dict[str, int], where: str) -> None:
    """Keep how long the open took and what it built; log the split at INFO (sources, samples, epochs, shares)."""
    stream.open_seconds, stream.open_built = seconds, built
    if not logger.isEnabledFor(logging.INFO) or not logs_here():
        return
    if stream.packing not in ("megatron", "native", "bestfit"):  # a packing this module does not know yet
        logger.info("statefulset: %s: opened %r in %.2f s", where, stream, seconds)
        return
    lines = describe(stream).lines()
    logger.info("statefulset: %s: %s", where, lines[0])
    for line in lines[1:]:
        logger.info("statefulset: %s", line)
