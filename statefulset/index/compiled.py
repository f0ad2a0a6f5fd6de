"""The compiled kernels of ``kernels.c``: building, loading and the library handle, for both index kinds.

``kernels.c`` is plain C loaded with ctypes. It is compiled at first use with the system C
compiler (``$CC``, else ``cc``) and ``-O2 -shared -fPIC -ffp-contract=off``: no fused
multiply-add and no fast-math, so every floating-point expression rounds exactly as in
megatron-core's ``helpers.cpp`` and in the Python fallbacks beside each caller.

The shared library is cached in ``$STATEFULSET_KERNEL_DIR`` (default ``$XDG_CACHE_HOME/statefulset``, else
``~/.cache/statefulset``)
under a name that hashes the source, the compiler command, the flags and the platform, so an
edited source or another compiler builds a new file. Each process compiles to a unique temporary
name and renames it into place, so any number of processes may build at once. When compiling or
loading fails (no compiler, read-only home, ...) or ``STATEFULSET_KERNELS=0`` is set,
:func:`library` returns None, every caller runs its Python version and the reason is logged once
at INFO on the ``statefulset`` logger. The results are identical either way, dtypes included.
The environment is read once, at the first call that needs a kernel.

A fresh node would compile once (~0.2 s of a C compiler) before its first native sample. So a
stream's cache folder is also a place to share the library (:func:`share_from`, called when a
stream opens with its ``path_to_cache``): a library found there is loaded as it is (its name
pins the source, compiler, flags and platform), and one compiled here is copied there for the
next node. ``statefulset prepare`` compiles it there ahead of time.

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

from statefulset import settings
from statefulset.errors import StatefulsetError

__all__ = ["available", "library", "pick"]

logger = logging.getLogger("statefulset")

_SOURCE = Path(__file__).with_name("kernels.c")
_FLAGS = ("-O2", "-shared", "-fPIC", "-ffp-contract=off")
_ABI = 3
_COMPILE_TIMEOUT = 300


_lock = threading.Lock()
_state: dict[str, object] = {"loaded": False, "lib": None, "reason": None}
_shared: list[Path] = []  # folders other nodes see: path_to_cache/kernels


def share_from(folder: str | os.PathLike[str]) -> None:
    """Look for (and leave) the compiled library in ``folder`` too; a no-op once it is loaded."""
    path = Path(folder)
    if path not in _shared:
        _shared.append(path)


# --------------------------------------------------------------------------- building and loading


def _compiler() -> list[str]:
    return shlex.split(settings.CC.get())


def _cache_dir() -> Path:
    configured = settings.KERNEL_DIR.get()
    return Path(configured) if configured else Path(settings.user_cache_dir())


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


def _publish(built: Path, there: Path) -> None:
    """Copy the library where other nodes look (best effort: a read-only folder just stays empty)."""
    try:
        there.parent.mkdir(parents=True, exist_ok=True)
        temporary = there.with_name(f"{there.stem}.{os.getpid()}-{secrets.token_hex(6)}.tmp")
        temporary.write_bytes(built.read_bytes())
        os.replace(temporary, there)
    except OSError as error:
        logger.debug("could not share the compiled kernels in %s: %s", there.parent, error)


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
    lib.sf_document_fields.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr]
    lib.sf_document_fields.restype = i64
    lib.sf_window_pieces.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr]
    lib.sf_window_pieces.restype = i64


def _open() -> ctypes.CDLL:
    source = _SOURCE.read_bytes()
    compiler = _compiler()
    if not compiler:
        raise OSError("CC is set but empty")
    target = _library_path(source, compiler)
    shared = next((d / target.name for d in _shared if (d / target.name).exists()), None)
    if shared is not None and not target.exists():
        target = shared  # another node compiled it (or statefulset prepare did)
    if not target.exists():
        _compile(source, compiler, target)
        for folder in _shared:
            _publish(target, folder / target.name)
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


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None when they are unavailable (the reason is logged once)."""
    if _state["loaded"]:
        return _state["lib"]  # type: ignore[return-value]
    with _lock:
        if not _state["loaded"]:
            lib, reason = None, None
            if not settings.KERNELS.get():
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
        _shared.clear()


def address(array: numpy.ndarray, dtype: type) -> int:
    """The data address of ``array`` for a kernel taking a raw pointer: C-contiguous and of ``dtype``, or refused."""
    if array.dtype != dtype or not array.flags.c_contiguous:
        raise StatefulsetError(f"internal: a kernel needs a C-contiguous {numpy.dtype(dtype)} array, got {array.dtype}")
    return array.ctypes.data


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
