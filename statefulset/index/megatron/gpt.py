"""megatron-core 0.16's GPTDataset sample order, reproduced exactly and vectorised.

Three arrays, built from one ``numpy.random.RandomState(seed)`` in this order:

- ``document_index`` (int32): the split's sequence ids tiled once per epoch and shuffled
  jointly (the first E-1 epochs jointly and the last one on its own when the final epoch is
  "separate", i.e. less than 80% of it is needed);
- ``sample_index`` ([n+1, 2]): for stream position k·S of the concatenated shuffled sequences,
  the position in ``document_index`` and the token offset there;
- ``shuffle_index``: a permutation of the n samples (the partial final epoch shuffled apart
  and kept last).

Sample ``p`` is tokens ``[k·S, (k+1)·S + 1)`` of that stream with ``k = shuffle_index[p]``.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy

from statefulset.errors import StatefulsetError
from statefulset.index import compiled
from statefulset.index.megatron.sample_index import sample_index

_INT32_MAX = numpy.iinfo(numpy.int32).max
_FINAL_EPOCH_THRESHOLD = 0.80
logger = logging.getLogger("statefulset")
# (prefix, split, seq_length) already warned about in this process: workers and reopens stay quiet.
_WARNED: set[tuple[str, str, int]] = set()


def warn_if_sample_exceeds_split(prefix: str, split: str, tokens: int, seq_length: int, extra: int = 1) -> None:
    """Log a warning when one sample needs more tokens than the whole split holds.

    megatron-core allows it: the token stream is the split's documents epoch after epoch, so such a
    sample wraps around into the next epoch's (reshuffled) documents. That stays, for exactness,
    but it is rarely what was meant.
    """
    if tokens >= seq_length + extra or (prefix, split, seq_length) in _WARNED:
        return
    _WARNED.add((prefix, split, seq_length))
    logger.warning(
        "statefulset: %s: the %s split holds %d tokens, fewer than one sample of seq_length %d + %d: "
        "as in megatron-core, every sample wraps around into the next epoch's documents and repeats them",
        prefix,
        split,
        tokens,
        seq_length,
        extra,
    )


def num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int | None, extra: int = 1) -> int:
    """The fewest whole epochs that hold ``num_samples`` samples (1 when unset)."""
    if num_samples is None:
        return 1
    requested = num_samples * seq_length + extra
    return max(1, -(-requested // tokens_per_epoch))


@dataclass(frozen=True)
class EpochPlan:
    epochs: int
    separate_final_epoch: bool
    samples_before_final_epoch: int  # only meaningful when separate_final_epoch


def plan_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int | None, extra: int = 1) -> EpochPlan:
    epochs = num_epochs(tokens_per_epoch, seq_length, num_samples, extra)
    if epochs == 1:
        return EpochPlan(1, False, 0)
    before = ((epochs - 1) * tokens_per_epoch - extra) // seq_length
    from_final = num_samples - before
    per_epoch = (tokens_per_epoch - extra) // seq_length
    separate = from_final < int(_FINAL_EPOCH_THRESHOLD * per_epoch)
    return EpochPlan(epochs, separate, before)


def build_document_index(
    sequence_ids: numpy.ndarray | range, epochs: int, rng: numpy.random.RandomState, separate_final_epoch: bool
) -> numpy.ndarray:
    """``sequence_ids`` tiled ``epochs`` times and shuffled; a ``range`` (a split's ids) is made int32 once."""
    if separate_final_epoch and epochs > 1:
        first = build_document_index(sequence_ids, epochs - 1, rng, False)
        last = build_document_index(sequence_ids, 1, rng, False)
        return numpy.concatenate((first, last))
    if isinstance(sequence_ids, range):
        ids = numpy.arange(sequence_ids.start, sequence_ids.stop, sequence_ids.step, dtype=numpy.int32)
        index = ids if epochs == 1 else numpy.tile(ids, epochs)  # a fresh array either way: shuffled in place
    else:
        index = numpy.tile(numpy.asarray(sequence_ids, dtype=numpy.int32), epochs)
    legacy_shuffle(rng, index)
    return index


def legacy_shuffle(rng: numpy.random.RandomState, array: numpy.ndarray) -> None:
    """``rng.shuffle(array)``: the same draws, the same order, the same state left in ``rng``.

    A 1-D, C-contiguous, writable integer array of 4- or 8-byte items (at most 2^32 of them: numpy
    draws larger positions on another path) is shuffled by the compiled
    kernel (``sf_legacy_shuffle``: numpy's MT19937 and legacy bounded draws, the swaps 2-3x faster
    than numpy's loop, which moves each item with a generic ``memcpy``); anything else, or without
    the kernels, by ``rng.shuffle`` itself.
    """
    lib = compiled.library()
    fits = array.ndim == 1 and array.dtype.kind in "iu" and array.dtype.itemsize in (4, 8) and array.size <= 1 << 32
    state = rng.get_state() if lib is not None and fits and array.flags.c_contiguous and array.flags.writeable else None
    if state is None or state[0] != "MT19937":
        rng.shuffle(array)
        return
    name, key, position, has_gauss, gauss = state
    key = numpy.array(key, dtype=numpy.uint32)
    where = ctypes.c_int64(int(position))
    code = lib.sf_legacy_shuffle(key, ctypes.byref(where), array.ctypes.data, array.size, array.dtype.itemsize)
    if code:
        raise StatefulsetError(f"internal: sf_legacy_shuffle refused its arguments (code {code})")
    rng.set_state((name, key, where.value, has_gauss, gauss))


def build_sample_index(
    sequence_lengths: numpy.ndarray,
    document_index: numpy.ndarray,
    seq_length: int,
    epochs: int,
    tokens_per_epoch: int,
    drop_last_partial: bool = True,
    extra: int = 1,
) -> numpy.ndarray:
    """Row k: (position in document_index, offset) where sample k starts; rows n+1.

    Runs the compiled single-pass kernel (:mod:`statefulset.index.megatron.sample_index`) when it is available and
    :func:`build_sample_index_numpy` otherwise; both give the same array, dtype included.
    """
    return sample_index(
        sequence_lengths, document_index, seq_length, epochs, tokens_per_epoch, drop_last_partial, extra
    )


def build_shuffle_index(num_samples: int, total_size: int, rng: numpy.random.RandomState) -> numpy.ndarray:
    dtype = numpy.uint32 if total_size < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
    first = numpy.arange(num_samples, dtype=dtype)
    legacy_shuffle(rng, first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, dtype=dtype)
    legacy_shuffle(rng, last)
    return numpy.concatenate((first, last))


@dataclass(frozen=True)
class GPTIndices:
    document_index: numpy.ndarray
    sample_index: numpy.ndarray
    shuffle_index: numpy.ndarray

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1


def _tokens_in(sequence_lengths: numpy.ndarray, sequence_ids: numpy.ndarray | range) -> int:
    """Tokens in the given sequences. A split is a contiguous id range: summing a slice of the
    lengths is ~6x faster than gathering them (1M sequences: ~1 ms against ~6-8 ms); given as a
    ``range``, it needs no pass to find that out."""
    ids = sequence_ids
    if isinstance(ids, range) and ids.step == 1 and 0 <= ids.start <= ids.stop <= sequence_lengths.shape[0]:
        return int(sequence_lengths[ids.start : ids.stop].sum(dtype=numpy.int64))
    ids = numpy.asarray(ids)
    if ids.ndim == 1 and ids.size > 1 and int(ids[-1]) - int(ids[0]) == ids.size - 1 and (numpy.diff(ids) == 1).all():
        first = int(ids[0])
        if first >= 0 and first + ids.size <= sequence_lengths.shape[0]:
            return int(sequence_lengths[first : first + ids.size].sum(dtype=numpy.int64))
    return int(sequence_lengths[ids].sum(dtype=numpy.int64))


def build_gpt_indices(
    sequence_lengths: numpy.ndarray,
    sequence_ids: numpy.ndarray | range,
    seq_length: int,
    seed: int,
    num_samples: int | None,
    drop_last_partial: bool = True,
    extra: int = 1,
    where: str = "dataset",
) -> GPTIndices:
    """All three arrays for one split of one shard, as megatron-core builds them."""
    if seq_length < 2:
        raise StatefulsetError(f"{where}: seq_length must be at least 2, got {seq_length}")
    tokens_per_epoch = _tokens_in(numpy.asarray(sequence_lengths), sequence_ids)
    if tokens_per_epoch <= extra:
        raise StatefulsetError(
            f"{where}: the split holds {tokens_per_epoch} tokens, too few for even one sample of {seq_length}"
        )
    plan = plan_epochs(tokens_per_epoch, seq_length, num_samples, extra)
    rng = numpy.random.RandomState(seed)
    document_index = build_document_index(sequence_ids, plan.epochs, rng, plan.separate_final_epoch)
    sample_index = build_sample_index(
        sequence_lengths, document_index, seq_length, plan.epochs, tokens_per_epoch, drop_last_partial, extra
    )
    n = sample_index.shape[0] - 1
    first = plan.samples_before_final_epoch if plan.separate_final_epoch else n
    shuffle_index = build_shuffle_index(first, n, rng)
    return GPTIndices(document_index, sample_index, shuffle_index)
