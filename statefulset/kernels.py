"""Compiled index-building kernels, each with an exact pure-Python/NumPy fallback.

``kernels.c`` is plain C loaded with ctypes. It is compiled at first use with the system C
compiler (``$CC``, else ``cc``) and ``-O2 -shared -fPIC -ffp-contract=off``: no fused
multiply-add and no fast-math, so every floating-point expression rounds exactly as in
megatron-core's ``helpers.cpp`` and in the Python fallbacks here.

The shared library is cached in ``$STATEFULSET_KERNEL_DIR`` (default ``~/.cache/statefulset``)
under a name that hashes the source, the compiler command, the flags and the platform, so an
edited source or another compiler builds a new file. Each process compiles to a unique temporary
name and renames it into place, so any number of processes may build at once. When compiling or
loading fails (no compiler, read-only home, ...) or ``STATEFULSET_KERNELS=0`` is set, every
function runs its Python version and the reason is logged once at INFO on the ``statefulset``
logger. The results are identical either way, dtypes included. The environment is read once,
at the first call that needs a kernel.

Every function takes ``native``: ``None`` (default) uses the compiled kernel when available,
``False`` always runs the Python version and ``True`` requires the compiled kernel. Bad input
raises :class:`~statefulset.errors.StatefulsetError` before any C code runs; the C code also
checks array contents it walks through and reports problems through a return code.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import secrets
import shlex
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import numpy

from .errors import StatefulsetError, check_int

__all__ = ["available", "blending_indices", "exhaustive_blending_indices", "sample_index"]

logger = logging.getLogger("statefulset")

_SOURCE = Path(__file__).with_name("kernels.c")
_FLAGS = ("-O2", "-shared", "-fPIC", "-ffp-contract=off")
_ABI = 2
_COMPILE_TIMEOUT = 300

_INT32_MAX = int(numpy.iinfo(numpy.int32).max)
_MAX_EXACT = 2**53  # integers up to here convert to double exactly
_MAX_DATASETS = 32767  # dataset ids are int16

# Return codes of kernels.c.
_BAD_DOCUMENT = 1
_NEGATIVE_LENGTH = 2
_TOKEN_MISMATCH = 3

_lock = threading.Lock()
_state: dict[str, object] = {"loaded": False, "lib": None, "reason": None}


# --------------------------------------------------------------------------- building and loading


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


def _cache_dir() -> Path:
    configured = os.environ.get("STATEFULSET_KERNEL_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "statefulset"


def _library_path(source: bytes, compiler: list[str]) -> Path:
    digest = hashlib.sha256()
    platform_tag = f"{sys.platform}|{platform.machine()}|{sysconfig.get_platform()}"
    for part in (source, "\0".join(compiler).encode(), "\0".join(_FLAGS).encode(), platform_tag.encode()):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return _cache_dir() / f"statefulset-kernels-{digest.hexdigest()[:24]}.so"


def _compile(source: bytes, compiler: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{secrets.token_hex(6)}"
    source_file = target.with_name(f"{target.stem}.{tag}.c")
    temporary = target.with_name(f"{target.stem}.{tag}.tmp")
    try:
        source_file.write_bytes(source)
        run = subprocess.run(
            [*compiler, *_FLAGS, "-o", str(temporary), str(source_file)],
            capture_output=True,
            text=True,
            timeout=_COMPILE_TIMEOUT,
        )
        if run.returncode != 0:
            raise OSError(f"{shlex.join(compiler)} exited with {run.returncode}: {run.stderr.strip()[-2000:]}")
        os.replace(temporary, target)
    finally:
        source_file.unlink(missing_ok=True)
        temporary.unlink(missing_ok=True)


def _declare(lib: ctypes.CDLL) -> None:
    def array(dtype) -> type:
        return numpy.ctypeslib.ndpointer(dtype=dtype, flags="C_CONTIGUOUS")

    i64, i32, p_i64 = ctypes.c_int64, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64)
    lib.sf_sample_index.argtypes = [
        array(numpy.int32), i64, array(numpy.int32), i64, i64, i64, i64, i64, i32, array(None), i32, p_i64
    ]  # fmt: skip
    lib.sf_sample_index.restype = i32
    lib.sf_blending_indices.argtypes = [
        array(numpy.float64), i64, i64, array(numpy.int16), array(numpy.int64), array(numpy.int64)
    ]  # fmt: skip
    lib.sf_blending_indices.restype = i32
    lib.sf_exhaustive_blending_indices.argtypes = [
        array(numpy.int64), i64, array(numpy.int16), array(numpy.int64), array(numpy.int64),
        array(numpy.float64), array(numpy.int32),
    ]  # fmt: skip
    lib.sf_exhaustive_blending_indices.restype = i32
    lib.sf_feistel.argtypes = [array(numpy.int64), i64, i64, i32, array(numpy.uint64), i32, i32, array(numpy.int64)]
    lib.sf_feistel.restype = None
    lib.sf_window_permute.argtypes = [array(numpy.int64), i64, i64, i32, ctypes.c_uint64, i32, array(numpy.int64)]
    lib.sf_window_permute.restype = None


def _open() -> ctypes.CDLL:
    source = _SOURCE.read_bytes()
    compiler = _compiler()
    if not compiler:
        raise OSError("CC is set but empty")
    target = _library_path(source, compiler)
    if not target.exists():
        _compile(source, compiler, target)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError:
        # A damaged file (copied in by hand, a full disk ...): build it once more.
        _compile(source, compiler, target)
        lib = ctypes.CDLL(str(target))
    lib.sf_abi_version.restype = ctypes.c_int32
    version = lib.sf_abi_version()
    if version != _ABI:
        raise OSError(f"{target} has kernel ABI {version}, expected {_ABI}")
    _declare(lib)
    logger.debug("compiled kernels loaded from %s", target)
    return lib


def _library() -> ctypes.CDLL | None:
    if _state["loaded"]:
        return _state["lib"]  # type: ignore[return-value]
    with _lock:
        if not _state["loaded"]:
            lib, reason = None, None
            if os.environ.get("STATEFULSET_KERNELS", "").strip().lower() in ("0", "false", "no", "off"):
                reason = "disabled by STATEFULSET_KERNELS"
            else:
                try:
                    lib = _open()
                except Exception as error:  # no compiler, read-only cache, bad CC, ...
                    reason = f"{type(error).__name__}: {error}"
            if lib is None:
                logger.info("compiled kernels unavailable (%s); using the Python implementations", reason)
            _state.update(lib=lib, reason=reason, loaded=True)
    return _state["lib"]  # type: ignore[return-value]


def _reset() -> None:
    """Forget the loaded library so that the next call looks at the environment again (tests)."""
    with _lock:
        _state.update(loaded=False, lib=None, reason=None)


def available() -> bool:
    """Whether the compiled kernels are in use (compiles them on first call)."""
    return _library() is not None


def _pick(native: bool | None) -> ctypes.CDLL | None:
    if native is False:
        return None
    lib = _library()
    if lib is None and native:
        raise StatefulsetError(f"compiled kernels requested but unavailable: {_state['reason']}")
    return lib


# --------------------------------------------------------------------------- argument checks


def _integer_array(name: str, value: object) -> numpy.ndarray:
    array = numpy.asarray(value)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise StatefulsetError(f"{name} must be a 1-D integer array, got {array.dtype} with shape {array.shape}")
    return array


# --------------------------------------------------------------------------- sample index


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

    Equal, values and dtype, to :func:`statefulset.sampling.build_sample_index_numpy`. The
    compiled kernel walks ``document_index`` once with O(1) extra memory besides the result.
    ``document_index`` must hold exactly ``epochs × tokens_per_epoch`` tokens.
    """
    lengths = _integer_array("sequence_lengths", sequence_lengths)
    documents = _integer_array("document_index", document_index)
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
        lib = _pick(native)
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
        from .sampling import build_sample_index_numpy

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


# --------------------------------------------------------------------------- blending


def _weights(weights: object) -> numpy.ndarray:
    try:
        array = numpy.asarray(weights, dtype=numpy.float64)
    except (TypeError, ValueError) as error:
        raise StatefulsetError(f"weights must be numbers: {error}") from None
    if array.ndim != 1 or not 1 <= array.size <= _MAX_DATASETS:
        raise StatefulsetError(f"weights must be a 1-D array of 1 to {_MAX_DATASETS} numbers, got shape {array.shape}")
    if not numpy.isfinite(array).all() or (array < 0).any():
        raise StatefulsetError(f"weights must be finite and non-negative, got {array.tolist()[:10]}")
    return numpy.ascontiguousarray(array)


def _blending_python(weights: list[float], size: int) -> tuple[list[int], list[int]]:
    counts = [0] * len(weights)
    ids = [0] * size
    samples = [0] * size
    rest = range(1, len(weights))
    for i in range(size):
        x = max(float(i), 1.0)
        best = 0
        best_error = weights[0] * x - float(counts[0])
        for d in rest:
            error = weights[d] * x - float(counts[d])
            if error > best_error:
                best_error = error
                best = d
        ids[i] = best
        samples[i] = counts[best]
        counts[best] += 1
    return ids, samples


def blending_indices(
    weights: numpy.ndarray, size: int, *, native: bool | None = None
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """megatron-core's ``build_blending_indices``: (dataset_index int16[size], dataset_sample_index int64[size]).

    Sample ``i`` goes to the dataset ``d`` with the largest ``weights[d] * max(i, 1) - count[d]``
    (the lowest ``d`` on ties), and its sample index is ``count[d]`` before the increment. The
    weights are used as given (not normalised).
    """
    array = _weights(weights)
    size = check_int("size", size, 0)
    lib = _pick(native)
    if lib is None:
        ids, samples = _blending_python(array.tolist(), size)
        return numpy.array(ids, dtype=numpy.int16), numpy.array(samples, dtype=numpy.int64)
    dataset_index = numpy.empty(size, dtype=numpy.int16)
    dataset_sample_index = numpy.empty(size, dtype=numpy.int64)
    counts = numpy.zeros(array.size, dtype=numpy.int64)
    code = lib.sf_blending_indices(array, array.size, size, dataset_index, dataset_sample_index, counts)
    if code != 0:
        raise StatefulsetError(f"blending kernel failed with code {code}")
    return dataset_index, dataset_sample_index


def _exhaustive_python(sizes: list[int]) -> tuple[list[int], list[int]]:
    total = sum(sizes)
    weights = [float(s) / float(total) for s in sizes] if total else []
    active = [d for d, s in enumerate(sizes) if s > 0]
    counts = [0] * len(sizes)
    ids: list[int] = []
    samples: list[int] = []
    i = 0
    while active:
        x = max(float(i), 1.0)
        best_slot = 0
        best = active[0]
        best_error = weights[best] * x - float(counts[best])
        for slot in range(1, len(active)):
            d = active[slot]
            error = weights[d] * x - float(counts[d])
            if error > best_error:
                best_error = error
                best = d
                best_slot = slot
        ids.append(best)
        samples.append(counts[best])
        counts[best] += 1
        if counts[best] == sizes[best]:
            del active[best_slot]
        i += 1
    return ids, samples


def exhaustive_blending_indices(
    sizes: numpy.ndarray, *, native: bool | None = None
) -> tuple[numpy.ndarray, numpy.ndarray]:
    """megatron-core's ``build_exhaustive_blending_indices``: exactly ``sizes[d]`` samples from dataset ``d``.

    The greedy rule of :func:`blending_indices` with weights ``sizes[d] / sum(sizes)``, over the
    datasets that still have samples left. Returns int16 and int64 arrays of length
    ``sum(sizes)``. Datasets of size zero are never picked: megatron-core would pick one and run
    past the end of its arrays; for positive sizes the result is megatron-core's.
    """
    array = _integer_array("sizes", sizes)
    if array.size > _MAX_DATASETS:
        raise StatefulsetError(f"at most {_MAX_DATASETS} datasets, got {array.size}")
    values = [int(v) for v in array.tolist()]
    if any(v < 0 for v in values):
        raise StatefulsetError(f"sizes must be non-negative, got {values[:10]}")
    total = sum(values)
    if total >= _MAX_EXACT:
        raise StatefulsetError(f"sum(sizes) = {total} is too large")
    lib = _pick(native)
    if lib is None:
        ids, samples = _exhaustive_python(values)
        return numpy.array(ids, dtype=numpy.int16), numpy.array(samples, dtype=numpy.int64)
    k = array.size
    sizes64 = numpy.ascontiguousarray(array, dtype=numpy.int64)
    dataset_index = numpy.empty(total, dtype=numpy.int16)
    dataset_sample_index = numpy.empty(total, dtype=numpy.int64)
    counts = numpy.zeros(k, dtype=numpy.int64)
    weights = numpy.empty(k, dtype=numpy.float64)
    active = numpy.empty(k, dtype=numpy.int32)
    code = lib.sf_exhaustive_blending_indices(sizes64, k, dataset_index, dataset_sample_index, counts, weights, active)
    if code != 0:
        raise StatefulsetError(f"exhaustive blending kernel failed with code {code}")
    return dataset_index, dataset_sample_index


def feistel(x: numpy.ndarray, n: int, half: int, keys: numpy.ndarray, inverse: bool = False) -> numpy.ndarray | None:
    """:class:`~statefulset.permutation.KeyedPermutation`'s rounds with cycle walking, compiled.

    ``x``: int64 values already checked to lie in ``[0, n)``. Returns None when the kernels are
    unavailable, so the caller runs its numpy version.
    """
    lib = _library()
    if lib is None:
        return None
    flat = numpy.ascontiguousarray(x, dtype=numpy.int64).reshape(-1)
    out = numpy.empty_like(flat)
    lib.sf_feistel(flat, flat.size, n, half, keys, keys.size, int(inverse), out)
    return out.reshape(numpy.shape(x))


def window_permute(local: numpy.ndarray, windows: int, half: int, key: int, rounds: int) -> numpy.ndarray | None:
    """Permuted window of each non-negative ``local`` sample (see native.WindowSource), or None without kernels."""
    lib = _library()
    if lib is None:
        return None
    flat = numpy.ascontiguousarray(local, dtype=numpy.int64).reshape(-1)
    out = numpy.empty_like(flat)
    lib.sf_window_permute(flat, flat.size, windows, half, key, rounds, out)
    return out
