"""``packing: megatron``: megatron-core 0.16's GPTDataset, or BlendedDataset over GPTDatasets, sample for sample.

Indices come from :mod:`statefulset.index.megatron` and are kept in the content-keyed
:mod:`statefulset.index.cache`. The stream has ``len(stream)`` samples.
"""

from __future__ import annotations

from typing import Any

import numpy

from statefulset.errors import StatefulsetError
from statefulset.index.cache import IndexCache
from statefulset.index.megatron import blend as blending
from statefulset.index.megatron.gpt import build_gpt_indices, num_epochs, warn_if_sample_exceeds_split
from statefulset.shards.reader import IndexedDataset
from statefulset.spec.model import DatasetSpec
from statefulset.streams.base import EXTRA, OpenedSources, SampleStream, fill_by_source
from statefulset.streams.compiled_gather import megatron_kernel
from statefulset.streams.documents import Pieces, packed_pieces
from statefulset.streams.label_masks import gather_ranges

# Batches up to this many samples are planned on Python ints, larger gathers with numpy.
_LIST_PLAN_MAX_SAMPLES = 64
_THIS_AND_NEXT = numpy.array([0, 1], dtype=numpy.int64)


class GPTSource:
    """One megatron-core GPTDataset: a prefix's split with its three index arrays."""

    def __init__(
        self,
        dataset: IndexedDataset,
        arrays: dict[str, numpy.ndarray],
        seq_length: int,
        sequence_range: tuple[int, int] | None = None,
        num_samples: int | None = None,
    ) -> None:
        self.dataset = dataset
        self.sequence_range = sequence_range if sequence_range is not None else (0, len(dataset))
        self.num_samples = num_samples  # what the index was built for (None: one epoch)
        # Plain ndarray views of the (memory-mapped) cached arrays: numpy.memmap's Python-level
        # __getitem__ and __array_finalize__ cost ~1.5 µs per index, ten of them per batch.
        self.document_index = _plain(arrays["document_index"])
        self.sample_index = _plain(arrays["sample_index"])
        self.shuffle_index = _plain(arrays["shuffle_index"])
        self.seq_length = seq_length
        self._lengths = dataset.sequence_lengths
        # Byte pointers stay in the mapped .idx; dividing them all at open would hold 8 bytes per
        # sequence in every process (8 GB for 10^9 sequences) and cost milliseconds per open.
        self._pointers = dataset.sequence_pointers
        self._itemsize = dataset.dtype.itemsize

    def _first_tokens(self, seq: numpy.ndarray) -> numpy.ndarray:
        """Token offset in the ``.bin`` of each sequence in ``seq``."""
        return self._pointers[seq] // self._itemsize

    def __len__(self) -> int:
        return int(self.sample_index.shape[0]) - 1

    def fill(
        self, local: numpy.ndarray, out: numpy.ndarray, want: bool = False, masks: numpy.ndarray | None = None
    ) -> Pieces | None:
        """Rows of ``out`` (and ``masks``) for the GPTDataset samples ``local``; with ``want``, their pieces.

        The pieces are megatron-core's ``document_lengths`` (the extra token included).
        """
        k = self.shuffle_index[local].astype(numpy.int64)
        if k.size > _LIST_PLAN_MAX_SAMPLES:
            return self._fill_vectorised(k, out, want, masks)
        # A batch: rows k and k+1 of sample_index in one lookup, then a plan on Python ints (numpy's
        # per-call overhead would dominate for a few samples). Sample b is the pieces
        # document_index[first_b .. last_b]: the first starts at the sample's offset, the last ends
        # one token past the next sample's offset (the shared token).
        bounds = self.sample_index[k[:, None] + _THIS_AND_NEXT].reshape(-1, 4).tolist()
        documents = self.document_index
        seq = numpy.concatenate([documents[first : last + 1] for first, _, last, _ in bounds])
        starts = self._first_tokens(seq).tolist()
        lengths = self._lengths[seq].tolist()
        at = 0
        for first, offset, last, end in bounds:
            final = at + last - first
            starts[at] += offset
            if final == at:
                lengths[at] = end + EXTRA - offset
            else:
                lengths[at] -= offset
                lengths[final] = end + EXTRA
            at = final + 1
        gather_ranges(self.dataset, starts, lengths, out, masks)
        if not want:
            return None
        counts = [last - first + 1 for first, _, last, _ in bounds]
        return packed_pieces(counts + [out.shape[1]] * len(counts) + lengths, len(counts))

    def _fill_vectorised(
        self, k: numpy.ndarray, out: numpy.ndarray, want: bool, masks: numpy.ndarray | None
    ) -> Pieces | None:
        begin = self.sample_index[k].astype(numpy.int64)
        end = self.sample_index[k + 1].astype(numpy.int64)
        pieces = end[:, 0] - begin[:, 0] + 1
        if int(pieces.max()) == 1:  # every sample inside one sequence: no expansion needed
            seq = self.document_index[begin[:, 0]]
            starts = self._first_tokens(seq) + begin[:, 1]
            lengths = end[:, 1] + EXTRA - begin[:, 1]
        else:
            # Piece r of sample b is document_index[begin_b + r]; the first starts at the sample's
            # offset, the last ends one token past the next sample's offset (the shared token).
            total = int(pieces.sum())
            first_piece = numpy.cumsum(pieces) - pieces
            rel = numpy.arange(total, dtype=numpy.int64) - numpy.repeat(first_piece, pieces)
            row = numpy.repeat(begin[:, 0], pieces) + rel
            seq = self.document_index[row]
            lo = numpy.where(rel == 0, numpy.repeat(begin[:, 1], pieces), 0)
            last = row == numpy.repeat(end[:, 0], pieces)
            hi = numpy.where(last, numpy.repeat(end[:, 1] + EXTRA, pieces), self._lengths[seq])
            starts = self._first_tokens(seq) + lo
            lengths = hi - lo
        gather_ranges(self.dataset, starts, lengths, out, masks)
        if not want:
            return None
        return Pieces(pieces, lengths.astype(numpy.int64), numpy.full(k.size, out.shape[1], dtype=numpy.int64))


def _plain(array: numpy.ndarray) -> numpy.ndarray:
    """``array`` as a base-class ndarray (a view of the same memory; it keeps a memmap's mapping alive)."""
    return array.view(numpy.ndarray) if isinstance(array, numpy.memmap) else array


class MegatronStream(SampleStream):
    """GPTDataset, or BlendedDataset over GPTDatasets, exactly as megatron-core 0.16 builds them."""

    def __init__(self, spec, split, identity, sources: list[GPTSource], blend: dict[str, numpy.ndarray] | None):
        length = len(sources[0]) if blend is None else int(blend["dataset_index"].shape[0])
        super().__init__(spec, split, identity, length, unbounded=False)
        self.sources = sources
        self.blend = blend
        self.blend_counts: numpy.ndarray | None = None  # samples the blend draws from each source

    def _batch_kernel(self) -> Any:
        return megatron_kernel(self.sources, self.blend, len(self), self.seq_length + EXTRA)

    def _fill(
        self, positions: numpy.ndarray, out: numpy.ndarray, want: bool, masks: numpy.ndarray | None = None
    ) -> Pieces | None:
        if self.blend is None:
            return self.sources[0].fill(positions, out, want, masks)
        which = self.blend["dataset_index"][positions].astype(numpy.int64)
        local = self.blend["dataset_sample_index"][positions].astype(numpy.int64)
        return fill_by_source(which, local, out, self.sources, want, masks)


def open_megatron(spec: DatasetSpec, split: str, identity: dict[str, Any], opened: OpenedSources) -> MegatronStream:
    """GPTDataset indices of each source (built, or loaded from the content-keyed cache), blended as megatron-core."""
    cache = IndexCache(opened.cache_root)
    if len(opened.live) == 1 and (not opened.weighted or opened.per_split):
        # megatron-core builds a lone GPTDataset here, with no surplus and no blend.
        source, _ = _gpt_source(spec, split, opened, cache, 0, opened.num_samples)
        stream = MegatronStream(spec, split, identity, [source], None)
        if len(stream) == 0 and split == "train":
            raise _no_sample(spec)
        return stream
    return _open_blend(spec, split, identity, opened, cache)


def _gpt_source(
    spec: DatasetSpec, split: str, opened: OpenedSources, cache: IndexCache, i: int, samples: int | None
) -> tuple[GPTSource, dict[str, Any]]:
    """Source ``i``'s GPTDataset built for ``samples`` (None: one epoch), and the description that keys its cache."""
    ds, (lo, hi) = opened.datasets[i], opened.ranges[i]
    begin, end = ds.token_span(lo, hi)
    warn_if_sample_exceeds_split(ds.path_prefix, split, end - begin, spec.seq_length, EXTRA)
    description = {
        "kind": "GPTDataset",
        "megatron_core": "0.16",
        "content_digest": opened.digests[i],
        "sequences": [lo, hi],
        "seed": spec.seed,
        "seq_length": spec.seq_length,
        "num_samples": samples,
        "extra_token": EXTRA,
        "drop_last_partial": True,
    }

    ahead = opened.built_ahead.get(i)

    def build() -> dict[str, numpy.ndarray]:
        if ahead is not None and ahead[0] == samples:
            return ahead[1]
        return _gpt_arrays(spec, split, ds, (lo, hi), samples)

    try:
        with spec.blame("path_to_cache"):
            arrays = cache.get_or_build("GPTDataset", description, build)
    except (MemoryError, ValueError, OverflowError) as exc:  # numpy's refusals of a huge index
        raise spec.error(
            spec.num_samples_key(split),
            f"cannot build the {split} index of {ds.path_prefix} for {samples} samples: {exc}",
        ) from exc
    return GPTSource(ds, arrays, spec.seq_length, (lo, hi), samples), description


def _gpt_arrays(
    spec: DatasetSpec, split: str, ds: IndexedDataset, sequences: tuple[int, int], samples: int | None
) -> dict[str, numpy.ndarray]:
    """The three GPTDataset arrays of ``ds``'s ``sequences`` built for ``samples``."""
    with spec.blame(spec.data_key(split)):
        indices = build_gpt_indices(
            ds.sequence_lengths,
            range(*sequences),
            spec.seq_length,
            spec.seed,
            samples,
            where=ds.path_prefix,
        )
    return {
        "document_index": indices.document_index,
        "sample_index": indices.sample_index,
        "shuffle_index": indices.shuffle_index,
    }


def build_ahead(
    spec: DatasetSpec,
    split: str,
    live: list[tuple[str, float | None]],
    per_split: bool,
    datasets: list[IndexedDataset],
    ranges: list[tuple[int, int]],
    num_samples: int | None,
) -> dict[int, tuple[int | None, dict[str, numpy.ndarray]]]:
    """A lone source's one-epoch GPTDataset arrays, built while its ``.idx`` is still being hashed.

    On the first open of a shard version its ``.idx`` is hashed (:mod:`statefulset.shards.identifying`)
    before its cache entry can be named, looked up or written; a thread hashes it while this builds
    what needs no digest. :func:`open_megatron` then stores these arrays under the digest, or loads
    the entry the cache already holds (the same arrays: the entry is keyed by the same content) and
    drops them. That waste is bounded: only a build of one epoch is done ahead, which costs a few
    times the hash of the same shard, never a many-epoch build. Anything the build raises is left
    to the open's own build, which raises it where a build's errors are reported.
    """
    if spec.packing != "megatron" or spec.stages is not None or len(live) != 1 or not (live[0][1] is None or per_split):
        return {}
    ds, (lo, hi) = datasets[0], ranges[0]
    begin, end = ds.token_span(lo, hi)
    if num_epochs(end - begin, spec.seq_length, num_samples, EXTRA) != 1:
        return {}
    try:
        return {0: (num_samples, _gpt_arrays(spec, split, ds, (lo, hi), num_samples))}
    except Exception:  # reported by the open's own build of the same arrays
        return {}


def _open_blend(
    spec: DatasetSpec, split: str, identity: dict[str, Any], opened: OpenedSources, cache: IndexCache
) -> MegatronStream:
    """megatron-core's BlendedDataset over a GPTDataset per source, each built for its share of the blend."""
    live, weighted, num_samples = opened.live, opened.weighted, opened.num_samples
    num_samples_key = spec.num_samples_key(split)
    if weighted and num_samples is None:
        if split == "train":
            raise spec.error(
                num_samples_key,
                "a weighted blend with packing: megatron needs num_samples "
                "(megatron-core sizes each part of the blend from it); set it, or use packing: native",
            )
        weighted = False  # valid/test without a size: every source once, blended by size
    plan = blending.plan_blend([w for _, w in live] if weighted else None, num_samples, count=len(live))
    built = [_gpt_source(spec, split, opened, cache, i, plan.build_sizes[i]) for i in range(len(live))]
    sources = [source for source, _ in built]
    if not any(len(s) for s in sources) and (split == "train" or num_samples is not None):
        raise _no_sample(spec, split)  # blending nothing would divide by zero
    weights, size = plan.blend_weights([len(s) for s in sources])
    description = {
        "kind": "BlendedDataset",
        "datasets": [d for _, d in built],
        "weights": weights,
        "size": size,
    }

    def build_blend() -> dict[str, numpy.ndarray]:
        with spec.blame(num_samples_key):
            return blending.blend_indices(weights, size)

    with spec.blame("path_to_cache"):
        arrays = cache.get_or_build("BlendedDataset", description, build_blend)
    with spec.blame(num_samples_key):
        counts = blending.check_budgets(arrays, [len(s) for s in sources], [p for p, _ in live], split)
    stream = MegatronStream(spec, split, identity, sources, arrays)
    stream.blend_counts = counts  # samples drawn from each source: realised shares without another pass
    return stream


def _no_sample(spec: DatasetSpec, split: str = "train") -> StatefulsetError:
    """A train stream without samples would fail at the first batch, far from its cause; say it at open.

    An empty valid/test stream stays legal: Megatron skips that evaluation.
    """
    return spec.error(
        spec.num_samples_key(split),
        f"the {split} split holds no sample: its data is shorter than one sample of seq_length {spec.seq_length} "
        "+ 1 tokens and is built for one epoch (num_samples null, or a list of prefixes without weights); set "
        "num_samples (and weights, for a list of prefixes): samples then wrap into further epochs, as in "
        "megatron-core; or lower seq_length",
    )
