"""The deterministic sample stream of a spec's split: ``stream[p]`` is a pure function of (spec, p).

``open_stream(spec, split)`` reads the spec, opens the shards and returns a ``SampleStream``:

- ``packing: megatron`` is megatron-core 0.16's GPTDataset, or BlendedDataset over GPTDatasets,
  sample for sample (indices from :mod:`statefulset.sampling` and :mod:`statefulset.blending`,
  kept in the content-keyed :mod:`statefulset.cache`). It has ``len(stream)`` samples.
- ``packing: native`` computes every sample from its position (:mod:`statefulset.native`):
  no index, O(1) memory, any position ``p >= 0``; ``len(stream)`` is one pass over the windows.

``stream.gather(positions)`` is the hot path: ``[B, seq_length + 1]`` int64 assembled with one
vectorised plan of token ranges per source and one copy per range.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy

from . import blending
from .cache import IndexCache, shard_digest
from .cache import builds as cache_builds
from .errors import SequenceIndexError, StatefulsetError
from .indexed import IndexedDataset
from .native import BlendSchedule, WindowSource
from .overview import record_open
from .permutation import derive_key
from .provenance import Provenance, explain
from .sampling import build_gpt_indices, warn_if_sample_exceeds_split
from .spec import DatasetSpec, load_spec
from .split import SPLITS, parse_split, split_matrix, split_range

# Megatron's add_extra_token_to_sequence: a sample holds seq_length + 1 tokens.
EXTRA = 1
# Batches up to this many samples are planned on Python ints, larger gathers with numpy.
_LIST_PLAN_MAX_SAMPLES = 64
_THIS_AND_NEXT = numpy.array([0, 1], dtype=numpy.int64)


class SampleStream:
    """Packed samples of ``seq_length + 1`` tokens at integer positions."""

    def __init__(self, spec: DatasetSpec, split: str, identity: dict[str, Any], length: int, unbounded: bool) -> None:
        self.spec = spec
        self.split = split
        self.seq_length = spec.seq_length
        self.packing = spec.packing
        # What the samples depend on, field by field (so a state that does not fit can say which);
        # "data" digests every source's .idx content, split range and weight.
        self.identity = identity
        self.fingerprint = hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=16).hexdigest()
        self._length = length
        self.unbounded = unbounded  # native: every p >= 0 is a sample; megatron: p < len(stream)
        self.open_seconds: float | None = None  # how long open_stream took, and the indices it built
        self.open_built: dict[str, int] = {}

    def __len__(self) -> int:
        return self._length

    def __reduce__(self) -> tuple[Any, ...]:
        # Workers started with spawn/forkserver reopen the stream (cached indices are mmapped)
        # instead of receiving pickled index arrays.
        return (_open_stream, (self.spec, self.split))

    def __getitem__(self, position: int) -> dict[str, Any]:
        try:
            p = int(position)
        except TypeError:
            raise TypeError(f"stream positions are ints, not {type(position).__name__}") from None
        return {"text": self.gather(numpy.array([p], dtype=numpy.int64))[0], "sample_id": p}

    def explain(self, position: int, tokenizer: Any = None) -> Provenance:
        """Where ``self[position]`` came from: split, source, epoch, the pieces it was cut from (docs/provenance.md)."""
        return explain(self, position, tokenizer)

    def gather(self, positions: Any, out: numpy.ndarray | None = None) -> numpy.ndarray:
        """The samples at ``positions`` as one int64 array ``[len(positions), seq_length + 1]``."""
        p = numpy.asarray(positions, dtype=numpy.int64).reshape(-1)
        if p.size and (int(p.min()) < 0 or (not self.unbounded and int(p.max()) >= self._length)):
            bad = int(p.min()) if int(p.min()) < 0 else int(p.max())
            raise SequenceIndexError(
                f"{self.split} stream: position {bad} is outside [0, {self._length})"
                + ("" if self.unbounded else " (megatron packing builds a finite stream; raise num_samples)")
            )
        width = self.seq_length + EXTRA
        if out is None:
            out = numpy.empty((p.size, width), dtype=numpy.int64)
        elif out.shape != (p.size, width) or out.dtype != numpy.int64 or not out.flags.c_contiguous:
            raise StatefulsetError(f"gather: out must be C-contiguous int64 {(p.size, width)}, got {out.shape}")
        if p.size:
            self._fill(p, out)
        return out

    def _fill(self, positions: numpy.ndarray, out: numpy.ndarray) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        size = "unbounded" if self.unbounded else f"{self._length} samples"
        return f"{type(self).__name__}({self.split}, seq_length={self.seq_length}, {size})"


def _fill_by_source(which: numpy.ndarray, local: numpy.ndarray, out: numpy.ndarray, sources: list[Any]) -> None:
    """Rows of ``out`` from several sources: each source gathers its rows in one call."""
    present = sorted(set(which.tolist()))  # not numpy.unique: its first call imports numpy.ma (~7 ms)
    if len(present) == 1:
        sources[present[0]].fill(local, out)
        return
    for d in present:
        rows = numpy.flatnonzero(which == d)
        block = numpy.empty((rows.size, out.shape[1]), dtype=numpy.int64)
        sources[d].fill(local[rows], block)
        out[rows] = block


# -- megatron packing -----------------------------------------------------------------------------
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
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
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

    def fill(self, local: numpy.ndarray, out: numpy.ndarray) -> None:
        k = self.shuffle_index[local].astype(numpy.int64)
        if k.size > _LIST_PLAN_MAX_SAMPLES:
            self._fill_vectorised(k, out)
            return
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
        self.dataset.gather(starts, lengths, out.reshape(-1))

    def _fill_vectorised(self, k: numpy.ndarray, out: numpy.ndarray) -> None:
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
        self.dataset.gather(starts, lengths, out.reshape(-1))


class MegatronStream(SampleStream):
    """GPTDataset, or BlendedDataset over GPTDatasets, exactly as megatron-core 0.16 builds them."""

    def __init__(self, spec, split, identity, sources: list[GPTSource], blend: dict[str, numpy.ndarray] | None):
        length = len(sources[0]) if blend is None else int(blend["dataset_index"].shape[0])
        super().__init__(spec, split, identity, length, unbounded=False)
        self.sources = sources
        self.blend = blend
        self.blend_counts: numpy.ndarray | None = None  # samples the blend draws from each source

    def _fill(self, positions: numpy.ndarray, out: numpy.ndarray) -> None:
        if self.blend is None:
            self.sources[0].fill(positions, out)
            return
        which = self.blend["dataset_index"][positions].astype(numpy.int64)
        local = self.blend["dataset_sample_index"][positions].astype(numpy.int64)
        _fill_by_source(which, local, out, self.sources)


# -- native packing -------------------------------------------------------------------------------
class _WindowFiller:
    def __init__(self, source: WindowSource) -> None:
        self.source = source

    def fill(self, local: numpy.ndarray, out: numpy.ndarray) -> None:
        starts = self.source.window_starts(local)
        lengths = numpy.full(starts.shape, out.shape[1], dtype=numpy.int64)
        self.source.dataset.gather(starts, lengths, out.reshape(-1))


class NativeStream(SampleStream):
    """Keyed windows of each source, blended position by position; nothing is built or stored."""

    def __init__(self, spec, split, identity, sources: list[WindowSource], weights: list[float]):
        super().__init__(spec, split, identity, sum(s.windows for s in sources), unbounded=True)
        self.sources = sources
        self.weights = weights
        self.schedule = BlendSchedule(weights) if len(sources) > 1 else None
        self._fillers = [_WindowFiller(s) for s in sources]

    def _fill(self, positions: numpy.ndarray, out: numpy.ndarray) -> None:
        if self.schedule is None:
            self._fillers[0].fill(positions, out)
            return
        which, local = self.schedule.locate(positions)
        _fill_by_source(which, local, out, self._fillers)


# -- opening a stream from a spec -----------------------------------------------------------------
def open_stream(spec: DatasetSpec | str | os.PathLike[str] | Mapping[str, Any], split: str = "train") -> SampleStream:
    """The stream of ``split`` ("train", "valid" or "test") described by ``spec``.

    Every ``StatefulsetError`` raised here names the spec's file (``spec.source``), and the key at
    fault where one is. Logs what it opened at INFO on the ``statefulset`` logger
    (:mod:`statefulset.overview`).
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
        return _open(spec, split)
    except StatefulsetError as exc:
        if str(exc).startswith(f"{spec.source}: "):
            raise
        raise type(exc)(f"{spec.source}: {exc}") from exc  # a shard or cache error: say which spec


def _open(spec: DatasetSpec, split: str) -> SampleStream:
    selected = spec.blend_for(split)
    if selected is None:
        if spec.data_path is not None:
            raise spec.error("split", f"the {split} split is empty (split {spec.split!r} gives it no share)")
        raise spec.error(split, f"the {split} split is empty: the spec has no {split}: section")
    blend, num_samples = selected
    live = [(prefix, weight) for prefix, weight in blend if weight is None or weight > 0]
    weighted = live[0][1] is not None
    per_split = spec.data_path is None
    if per_split:
        bookends: tuple[float, float] = (0.0, 1.0)
    else:
        bookends = split_matrix(parse_split(spec.split))[SPLITS.index(split)]
    cache = IndexCache(spec.path_to_cache)
    memo = os.path.join(spec.path_to_cache, "digests") if spec.path_to_cache else None
    datasets, ranges, digests = [], [], []
    data_key = spec.data_key(split)
    for prefix, _ in live:
        with spec.blame(data_key):
            dataset = IndexedDataset(prefix)
        lo_hi = split_range(bookends, len(dataset))
        if lo_hi is None or lo_hi[1] <= lo_hi[0]:
            if per_split:
                raise spec.error(data_key, f"{prefix} holds no sequences")
            raise spec.error(
                "split", f"{prefix}: the {split} split of split {spec.split!r} holds no sequences of its {len(dataset)}"
            )
        datasets.append(dataset)
        ranges.append(lo_hi)
        with spec.blame(data_key):
            digests.append(shard_digest(prefix, memo))
    identity = {
        "packing": spec.packing,
        "split": split,
        "split_ratios": None if per_split else spec.split,
        "seq_length": spec.seq_length,
        "seed": spec.seed,
        "num_samples": num_samples if spec.packing == "megatron" else None,
    }
    sources_text = json.dumps(
        [
            {"idx_digest": d, "sequences": list(r), "weight": w}
            for d, r, (_, w) in zip(digests, ranges, live, strict=True)
        ]
    )
    identity["data"] = hashlib.blake2b(sources_text.encode(), digest_size=12).hexdigest()
    if spec.packing == "native":
        with spec.blame("seq_length"):
            sources = [
                WindowSource(ds, r, spec.seq_length, derive_key(spec.seed, i, SPLITS.index(split)))
                for i, (ds, r) in enumerate(zip(datasets, ranges, strict=True))
            ]
        weights = [float(w) for _, w in live] if weighted else [float(s.windows) for s in sources]
        return NativeStream(spec, split, identity, sources, weights)

    def gpt(i: int, samples: int | None) -> tuple[GPTSource, dict[str, Any]]:
        ds, (lo, hi) = datasets[i], ranges[i]
        begin, end = ds.token_span(lo, hi)
        warn_if_sample_exceeds_split(ds.path_prefix, split, end - begin, spec.seq_length, EXTRA)
        description = {
            "kind": "GPTDataset",
            "megatron_core": "0.16",
            "idx_digest": digests[i],
            "sequences": [lo, hi],
            "seed": spec.seed,
            "seq_length": spec.seq_length,
            "num_samples": samples,
            "extra_token": EXTRA,
            "drop_last_partial": True,
        }

        def build() -> dict[str, numpy.ndarray]:
            with spec.blame(data_key):
                indices = build_gpt_indices(
                    ds.sequence_lengths,
                    numpy.arange(lo, hi, dtype=numpy.int32),
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

        try:
            with spec.blame("path_to_cache"):
                arrays = cache.get_or_build("GPTDataset", description, build)
        except (MemoryError, ValueError, OverflowError) as exc:  # numpy's refusals of a huge index
            raise spec.error(
                num_samples_key, f"cannot build the {split} index of {ds.path_prefix} for {samples} samples: {exc}"
            ) from exc
        return GPTSource(ds, arrays, spec.seq_length, (lo, hi), samples), description

    num_samples_key = spec.num_samples_key(split)
    if len(live) == 1 and (not weighted or per_split):
        # megatron-core builds a lone GPTDataset here, with no surplus and no blend.
        stream = MegatronStream(spec, split, identity, [gpt(0, num_samples)[0]], None)
        if len(stream) == 0 and split == "train":
            raise _no_sample(spec)
        return stream
    if weighted and num_samples is None:
        if split == "train":
            raise spec.error(
                num_samples_key,
                "a weighted blend with packing: megatron needs num_samples "
                "(megatron-core sizes each part of the blend from it); set it, or use packing: native",
            )
        weighted = False  # valid/test without a size: every source once, blended by size
    plan = blending.plan_blend([w for _, w in live] if weighted else None, num_samples, count=len(live))
    built = [gpt(i, plan.build_sizes[i]) for i in range(len(live))]
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
        counts = blending.check_budgets(arrays["dataset_index"], [len(s) for s in sources], [p for p, _ in live], split)
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
