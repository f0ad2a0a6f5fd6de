"""megatron-core's GPTDataset sample index, compiled (one pass, O(1) extra memory) or vectorised NumPy.

Both give the same array, values and dtype; :func:`sample_index` checks its input before any C
code runs and falls back to :func:`build_sample_index_numpy` when the kernels are unavailable.
"""

from __future__ import annotations

import ctypes

import numpy

from statefulset.errors import StatefulsetError, check_int, check_int_array
from statefulset.index import compiled

_INT32_MAX = int(numpy.iinfo(numpy.int32).max)
_MAX_EXACT = 2**53  # integers up to here convert to double exactly

# Return codes of kernels.c.
_BAD_DOCUMENT = 1
_NEGATIVE_LENGTH = 2
_TOKEN_MISMATCH = 3


def build_sample_index_numpy(
    sequence_lengths: numpy.ndarray,
    document_index: numpy.ndarray,
    seq_length: int,
    epochs: int,
    tokens_per_epoch: int,
    drop_last_partial: bool = True,
    extra: int = 1,
) -> numpy.ndarray:
    """The vectorised NumPy version of :func:`build_sample_index`: the fallback, O(len(document_index)) memory."""
    total = epochs * tokens_per_epoch - extra
    # Without drop_last, megatron computes this ceil in single precision; so do we.
    n = total // seq_length if drop_last_partial else int(numpy.ceil(numpy.float32(total) / numpy.float32(seq_length)))
    lengths = numpy.asarray(sequence_lengths)[document_index].astype(numpy.int64)
    starts = numpy.zeros(lengths.size + 1, dtype=numpy.int64)
    numpy.cumsum(lengths, out=starts[1:])
    widest = max(document_index.shape[0], int(numpy.asarray(sequence_lengths).max(initial=0)))
    dtype = numpy.int32 if widest <= _INT32_MAX else numpy.int64
    sample = numpy.empty((n + 1, 2), dtype=dtype)
    positions = numpy.arange(n + 1, dtype=numpy.int64) * seq_length
    # Sample k ends (and k+1 starts) in the sequence holding its last token, position k·S+x-1.
    probe = positions + (extra - 1)
    probe[0] = 0
    rows = numpy.searchsorted(starts, probe, side="right") - 1
    rows = numpy.minimum(rows, lengths.size - 1)
    sample[:, 0] = rows
    sample[:, 1] = positions - starts[rows]
    # megatron-core starts sample 0 at (0, 0) even when document_index opens with empty sequences.
    sample[0] = 0
    if not drop_last_partial and n * seq_length > total:
        last = lengths.size - 1
        sample[n] = (last, lengths[last] - extra)
    return sample


def _num_samples(total: int, seq_length: int, drop_last_partial: bool) -> int:
    if drop_last_partial:
        return total // seq_length
    # megatron-core computes this ceil in single precision (helpers.cpp); so does the NumPy version.
    return int(numpy.ceil(numpy.float32(total) / numpy.float32(seq_length)))


def _first_bad_document(document_index: numpy.ndarray, num_lengths: int) -> int | None:
    if document_index.min() >= 0 and document_index.max() < num_lengths:
        return None
    return int(numpy.flatnonzero((document_index < 0) | (document_index >= num_lengths))[0])


def _bad_document(document_index: numpy.ndarray, position: int, num_lengths: int) -> StatefulsetError:
    value = int(document_index[position])
    return StatefulsetError(f"document_index[{position}] = {value} is outside the sequence ids [0, {num_lengths})")


def _token_mismatch(found: int, epochs: int, tokens_per_epoch: int) -> StatefulsetError:
    return StatefulsetError(
        f"document_index holds {found} tokens, but epochs × tokens_per_epoch = {epochs} × {tokens_per_epoch}"
        f" = {epochs * tokens_per_epoch}"
    )


def sample_index(
    sequence_lengths: numpy.ndarray,
    document_index: numpy.ndarray,
    seq_length: int,
    epochs: int,
    tokens_per_epoch: int,
    drop_last_partial: bool = True,
    extra: int = 1,
    *,
    native: bool | None = None,
) -> numpy.ndarray:
    """GPTDataset's sample index, shape ``[n+1, 2]``, int32 unless a value may not fit.

    Equal, values and dtype, to :func:`build_sample_index_numpy`. The
    compiled kernel walks ``document_index`` once with O(1) extra memory besides the result.
    ``document_index`` must hold exactly ``epochs × tokens_per_epoch`` tokens.
    """
    lengths = check_int_array("sequence_lengths", sequence_lengths)
    documents = check_int_array("document_index", document_index)
    seq_length = check_int("seq_length", seq_length, 1, high=_INT32_MAX)
    epochs = check_int("epochs", epochs, 1, high=_INT32_MAX)
    tokens_per_epoch = check_int("tokens_per_epoch", tokens_per_epoch, 1)
    extra = check_int("extra", extra, 0, high=1)
    drop_last_partial = bool(drop_last_partial)
    expected = epochs * tokens_per_epoch
    if expected <= extra or expected >= _MAX_EXACT:
        raise StatefulsetError(
            f"epochs × tokens_per_epoch = {expected} must be in ({extra}, 2**53) with extra = {extra}"
        )
    if documents.size == 0:
        raise StatefulsetError("document_index is empty")
    longest = int(lengths.max(initial=0))
    if lengths.size and int(lengths.min()) < 0:
        first = int(numpy.flatnonzero(lengths < 0)[0])
        raise StatefulsetError(f"sequence_lengths[{first}] = {int(lengths[first])} is negative")
    if expected > documents.size * longest:  # cheap early check before allocating the result
        raise StatefulsetError(
            f"document_index ({documents.size} entries, longest sequence {longest}) cannot hold"
            f" epochs × tokens_per_epoch = {expected} tokens"
        )

    total = expected - extra
    n = _num_samples(total, seq_length, drop_last_partial)
    widest = max(documents.shape[0], longest)
    out_dtype = numpy.int32 if widest <= _INT32_MAX else numpy.int64

    if longest <= _INT32_MAX and lengths.size <= _INT32_MAX:
        lib = compiled.pick(native)
    elif native:
        raise StatefulsetError("the compiled sample index kernel takes sequence lengths and ids that fit in int32")
    else:
        lib = None
    if lib is None:
        bad = _first_bad_document(documents, lengths.size)
        if bad is not None:
            raise _bad_document(documents, bad, lengths.size)
        found = int(lengths[documents].sum(dtype=numpy.int64))
        if found != expected:
            raise _token_mismatch(found, epochs, tokens_per_epoch)
        return build_sample_index_numpy(
            lengths, documents, seq_length, epochs, tokens_per_epoch, drop_last_partial, extra
        )

    if documents.dtype != numpy.int32:
        bad = _first_bad_document(documents, lengths.size)
        if bad is not None:
            raise _bad_document(documents, bad, lengths.size)
    return _sample_index_compiled(
        lib, lengths, documents, seq_length, epochs, tokens_per_epoch, drop_last_partial, extra, n, out_dtype
    )


def _sample_index_compiled(
    lib: ctypes.CDLL,
    lengths: numpy.ndarray,
    documents: numpy.ndarray,
    seq_length: int,
    epochs: int,
    tokens_per_epoch: int,
    drop_last_partial: bool,
    extra: int,
    n: int,
    out_dtype: type,
) -> numpy.ndarray:
    """The kernel call proper, for arguments already checked; out_dtype is int32 or int64."""
    lengths32 = numpy.ascontiguousarray(lengths, dtype=numpy.int32)
    documents32 = numpy.ascontiguousarray(documents, dtype=numpy.int32)
    expected = epochs * tokens_per_epoch
    total = expected - extra
    out = numpy.empty((n + 1, 2), dtype=out_dtype)
    where = ctypes.c_int64(0)
    if out.dtype not in (numpy.int32, numpy.int64):
        raise StatefulsetError(f"the sample index is int32 or int64, not {out.dtype}")
    wide = int(out.dtype == numpy.int64)
    partial = int(not drop_last_partial and n * seq_length > total)
    code = lib.sf_sample_index(
        lengths32, lengths32.size, documents32, documents32.size, seq_length, expected, extra, n, partial, out, wide,
        ctypes.byref(where),
    )  # fmt: skip
    if code == _BAD_DOCUMENT:
        raise _bad_document(documents, where.value, lengths.size)
    if code == _NEGATIVE_LENGTH:  # sample_index checks all lengths first; kept for direct calls
        raise StatefulsetError(f"the sequence at document_index[{where.value}] has a negative length")
    if code == _TOKEN_MISMATCH:
        raise _token_mismatch(where.value, epochs, tokens_per_epoch)
    if code != 0:
        raise StatefulsetError(f"sample index kernel failed with code {code}")
    out[0] = 0  # megatron-core's row 0 is (0, 0) even when document_index opens with empty sequences
    return out
