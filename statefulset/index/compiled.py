"""The compiled kernels of ``kernels.c``: finding, checking and loading the library, for both index kinds.

``kernels.c`` is plain C called through ctypes. Where the library comes from, in this order:

1. **Installed** (the normal case): ``statefulset/index/_kernels.<abi>.so``, compiled by
   ``pip install`` (``setup.py``, also for ``pip install -e .``) and shipped in the wheel. It sits
   beside the package's Python files and is trusted as they are; no compiler is needed at job
   start. It records the SHA-256 of the ``kernels.c`` it was built from, and one built from another
   source (an editable checkout edited since its last build) is not used.
2. **Private build** (fallback, logged as a WARNING): :mod:`statefulset.index.private_build`
   compiles ``kernels.c`` once into this user's own folder (0700, owned by this user, writable by
   nobody else, else refused) and checks the library's recorded SHA-256 before loading it.
3. **Python**: without either (no compiler, a refused folder, a broken library) or with
   ``STATEFULSET_KERNELS=0``, :func:`library` returns None and every caller runs its Python
   version: the same results, dtypes included, 10–100x slower. That is logged once, as a WARNING
   (INFO when the kernels were turned off on purpose).

The extension module's own functions (``kernels_module.c``, called as Python functions: the compiled
``loader.metrics()`` read) come only from the installed module, checked against its source the same
way (:func:`module_function`); without it their callers run in Python, with a WARNING.

No library is ever loaded from ``path_to_cache`` or any other folder that other users or jobs can
write (CONTRACT §14). Both builds use ``-ffp-contract=off`` and no fast-math: no fused
multiply-add, so every floating-point expression rounds exactly as in megatron-core's
``helpers.cpp`` and in the Python fallbacks. The environment is read once, at the first call
that needs a kernel.

The callers (:mod:`statefulset.index.megatron.sample_index`, :mod:`statefulset.index.megatron.blend`,
:mod:`statefulset.index.native.permutation`, :mod:`statefulset.index.native.windows`) take
``native``: ``None`` (default) uses the compiled kernel when available, ``False`` always runs the
Python version and ``True`` requires the compiled kernel (:func:`pick`). Bad input raises
:class:`~statefulset.errors.StatefulsetError` before any C code runs; the C code also checks
array contents it walks through and reports problems through a return code.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import threading
from pathlib import Path
from typing import Any

import numpy

from statefulset import settings
from statefulset.errors import StatefulsetError
from statefulset.index import private_build

__all__ = ["available", "library", "module_function", "origin", "pick", "reason"]

logger = logging.getLogger("statefulset")

_SOURCE = Path(__file__).with_name("kernels.c")
_MODULE_SOURCE = Path(__file__).with_name("kernels_module.c")  # the extension module's own functions
_INSTALLED = f"{__name__.rpartition('.')[0]}._kernels"  # the extension module setup.py builds
_ABI = 11
_REBUILD = "pip install . (or pip install -e . / python setup.py build_ext --inplace in a checkout)"

_lock = threading.Lock()
_state: dict[str, object] = {"loaded": False, "lib": None, "reason": None, "origin": None}
_scratch = threading.local()  # scratch(): each thread's block of kernel arguments
_functions: dict[str, object] = {}  # module_function(): each name's function (None: unavailable, logged once)


def _new_lock_in_child() -> None:
    # A fork copies only the forking thread: a DataLoader forked by one trainer thread while another
    # thread was loading the kernels (two ranks of a torchft replica group as threads, each building
    # its first batch) would keep the lock held forever, and its workers' first batch would hang.
    # The child loads the kernels itself if the parent had not finished.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


# --------------------------------------------------------------------------- finding and loading


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
    lib.sf_feistel.restype = i32
    # Per batch (native windows): raw addresses, as below.
    lib.sf_window_permute.argtypes = [ctypes.c_void_p, i64, i64, i32, ctypes.c_uint64, i32, ctypes.c_void_p]
    lib.sf_window_permute.restype = i32
    lib.sf_bestfit_counts.argtypes = [array(numpy.int64), i64, i64, i64, array(numpy.int64)]
    lib.sf_bestfit_counts.restype = i64
    lib.sf_bestfit_window.argtypes = [array(numpy.int64), i64, i64, array(numpy.int64)]
    lib.sf_bestfit_window.restype = i64
    lib.sf_bestfit_entries.argtypes = [array(numpy.int64), i64, i64, array(numpy.uint32), array(numpy.uint32)]
    lib.sf_bestfit_entries.restype = i64
    # Called once per batch on small arrays: raw addresses (the callers pass C-contiguous arrays of
    # the right dtypes, see address()), since ndpointer's checks cost ~10 µs per argument (and
    # even reading an array's address costs ~1.7 µs, so callers pass as few as they can).
    ptr = ctypes.c_void_p
    lib.sf_document_fields.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr]
    lib.sf_document_fields.restype = i64
    lib.sf_document_fields_batches.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr]
    lib.sf_document_fields_batches.restype = i64
    lib.sf_window_pieces.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr]
    lib.sf_window_pieces.restype = i64
    lib.sf_gather_masked.argtypes = [ptr, ptr, ptr]
    lib.sf_gather_masked.restype = i64
    lib.sf_fim_rows.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64]
    lib.sf_fim_rows.restype = i64
    lib.sf_gather_batch.argtypes = [ptr, ptr, ptr, ptr, ptr]
    lib.sf_gather_batch.restype = i64
    lib.sf_narrow_tokens.argtypes = [ptr, i64, ptr, i32]
    lib.sf_narrow_tokens.restype = i64
    lib.sf_legacy_shuffle.argtypes = [array(numpy.uint32), p_i64, ptr, i64, i64]
    lib.sf_legacy_shuffle.restype = i32


def _load(path: Path, source_digest: str | None) -> ctypes.CDLL:
    """Open ``path`` and check its ABI and (when the source is here) the source it was built from."""
    lib = ctypes.CDLL(str(path))
    lib.sf_abi_version.restype = ctypes.c_int32
    version = lib.sf_abi_version()
    if version != _ABI:
        raise OSError(f"{path} has kernel ABI {version}, expected {_ABI}")
    lib.sf_source_sha256.restype = ctypes.c_char_p
    built_from = lib.sf_source_sha256().decode()
    if source_digest is not None and built_from != source_digest:
        raise OSError(f"{path} was built from another kernels.c (SHA-256 {built_from[:12] or 'unknown'}...)")
    _declare(lib)
    return lib


def _installed() -> Path | None:
    """The library the package was installed with, or None."""
    try:
        found = importlib.util.find_spec(_INSTALLED)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found is not None and found.origin else None


def _open() -> tuple[ctypes.CDLL, Path]:
    """The installed library, else a checked private build (with a WARNING); raises when neither works."""
    source = _SOURCE.read_bytes() if _SOURCE.exists() else None
    source_digest = hashlib.sha256(source).hexdigest() if source is not None else None
    installed = _installed()
    if installed is not None:
        try:
            return _load(installed, source_digest), installed
        except (OSError, AttributeError) as error:  # AttributeError: a symbol is missing
            why = f"the installed kernels are not usable ({error})"
    else:
        why = f"the kernels were not installed with the package ({_INSTALLED} not found)"
    if source is None:
        raise OSError(f"{why}, and {_SOURCE} is missing: nothing to build; reinstall with {_REBUILD}")
    try:
        path = private_build.private_library(source, source_digest, logger.warning)
        lib = _load(path, source_digest)
    except Exception as error:
        raise StatefulsetError(f"{why}, and the private build failed ({type(error).__name__}: {error})") from error
    logger.warning("%s: using a private build in %s; to build them at install time, %s", why, path.parent, _REBUILD)
    return lib, path


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None when they are unavailable (the reason is logged once)."""
    if _state["loaded"]:
        return _state["lib"]  # type: ignore[return-value]
    with _lock:
        if not _state["loaded"]:
            lib, path, why = None, None, None
            if not settings.KERNELS.get():
                why = "turned off by STATEFULSET_KERNELS"
                logger.info("compiled kernels unavailable (%s); using the Python implementations", why)
            else:
                try:
                    lib, path = _open()
                except Exception as error:  # no compiler, a refused folder, a broken library, ...
                    why = f"{type(error).__name__}: {error}"
                    logger.warning(
                        "compiled kernels unavailable (%s); using the Python implementations "
                        "(the same results, 10-100x slower)",
                        why,
                    )
            _state.update(lib=lib, reason=why, origin=path, loaded=True)
    return _state["lib"]  # type: ignore[return-value]


def origin() -> Path | None:
    """The file of the kernels in use (installed or private build), or None (loads them first)."""
    library()
    return _state["origin"]  # type: ignore[return-value]


def reason() -> str | None:
    """Why the kernels are unavailable, or None (loads them first)."""
    library()
    return _state["reason"]  # type: ignore[return-value]


def _reset() -> None:
    """Forget the loaded library so that the next call looks at the environment again (tests)."""
    with _lock:
        _state.update(loaded=False, lib=None, reason=None, origin=None)
        _functions.clear()


def address(array: numpy.ndarray, dtype: type) -> int:
    """The data address of ``array`` for a kernel taking a raw pointer: C-contiguous and of ``dtype``, or refused."""
    if array.dtype != dtype or not array.flags.c_contiguous:
        raise StatefulsetError(f"internal: a kernel needs a C-contiguous {numpy.dtype(dtype)} array, got {array.dtype}")
    found = writable_address(array)  # ~0.4 µs; read-only arrays (memory maps) take ~1.4 µs
    return found if found is not None else array.ctypes.data


def writable_address(array: numpy.ndarray) -> int | None:
    """The data address of a writable C-contiguous ``array`` (None for any other), for a kernel that
    writes into it: ~0.4 µs, where ``array.ctypes.data`` costs ~1.4 µs per batch."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except (TypeError, ValueError, BufferError):  # read-only, not contiguous, or empty
        return None


def scratch(size: int) -> tuple[numpy.ndarray, int]:
    """This thread's int64 block of at least ``size`` values and its address, for per-batch kernel
    arguments: written in place instead of a new array whose address must be read each time. Each
    thread has its own, so concurrent batches never share one; valid until this thread's next call."""
    found = getattr(_scratch, "block", None)
    if found is None or found[0].size < size:
        block = numpy.empty(max(size, 2 * (0 if found is None else found[0].size), 256), dtype=numpy.int64)
        found = _scratch.block = (block, block.ctypes.data)
    return found


def available() -> bool:
    """Whether the compiled kernels are in use (compiles them on first call)."""
    return library() is not None


def pick(native: bool | None) -> ctypes.CDLL | None:
    """The library for a caller's ``native`` switch: None for False, required for True."""
    if native is False:
        return None
    lib = library()
    if lib is None and native:
        raise StatefulsetError(f"compiled kernels requested but unavailable: {_state['reason']}")
    return lib


def module_function(name: str) -> Any:
    """``name`` from the installed extension module's own functions (``kernels_module.c``: called as
    Python functions, not through ctypes), or None, logged once as a WARNING (INFO when the kernels
    were turned off): not installed, built from another ``kernels_module.c`` (an edited checkout not
    rebuilt: its recorded SHA-256 differs), or without ``name``. There is no private build of them:
    the caller runs its Python version, with the same results."""
    if name in _functions:
        return _functions[name]
    found, why = None, None
    if not settings.KERNELS.get():
        why = "turned off by STATEFULSET_KERNELS"
    else:
        try:
            module = importlib.import_module(_INSTALLED)
            built_from = getattr(module, "source_sha256", "")
            if _MODULE_SOURCE.exists() and built_from != hashlib.sha256(_MODULE_SOURCE.read_bytes()).hexdigest():
                why = f"{module.__file__} was built from another kernels_module.c (SHA-256 {built_from[:12] or '?'}...)"
            elif not callable(getattr(module, name, None)):
                why = f"{module.__file__} has no {name}"
            else:
                found = getattr(module, name)
        except ImportError as error:
            why = f"{_INSTALLED} is not importable ({error})"
    if found is None:
        level = logging.INFO if why == "turned off by STATEFULSET_KERNELS" else logging.WARNING
        logger.log(
            level,
            "compiled %s unavailable (%s); using its Python version (the same results, slower); to build it, %s",
            name,
            why,
            _REBUILD,
        )
    _functions[name] = found
    return found
