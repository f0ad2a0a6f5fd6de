"""The fallback build of ``kernels.c``: compiled once into this user's private folder, checked before every load.

Used only when the library the wheel installs (``statefulset/index/_kernels.<abi>.so``, see
``setup.py``) is missing or was built from another ``kernels.c``. The library is compiled with the
system C compiler (``$CC``, else ``cc``) and ``-O2 -shared -fPIC -ffp-contract=off`` into
``$STATEFULSET_KERNEL_DIR``, else ``<user cache>/kernels``:

- the folder is created with mode 0700 and must be a directory owned by this user (the effective
  uid) that neither group nor others may write; any other folder is refused, naming it, so a shared
  folder (a ``path_to_cache``, a project directory) can never hand a process code;
- the library's name hashes the source, the compiler command, the flags and the platform, so an
  edited source or another compiler builds a new file;
- its SHA-256 is recorded beside it (``.sha256``) when it is built, and the file (owned by this
  user, not writable by others) is hashed and compared before each load: a mismatch builds it again.

Each build runs in a temporary folder of its own and renames its result into place, so any number
of processes may build at once.
"""

from __future__ import annotations

import hashlib
import os
import platform
import secrets
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

from statefulset import settings
from statefulset.errors import StatefulsetError

__all__ = ["FLAGS", "check_private", "folder", "library_path", "private_library"]

FLAGS = ("-O2", "-shared", "-fPIC", "-ffp-contract=off")
COMPILE_TIMEOUT = 300.0


def folder() -> Path:
    """Where this user's fallback build lives: ``$STATEFULSET_KERNEL_DIR``, else ``<user cache>/kernels``."""
    configured = settings.KERNEL_DIR.get()
    return Path(configured) if configured else Path(settings.user_cache_dir()) / "kernels"


def check_private(path: Path, uid: int | None = None) -> None:
    """Create ``path`` (0700) if missing; refuse it unless it is a folder of ``uid`` (default: ours) only it writes."""
    uid = os.geteuid() if uid is None else uid
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        found = os.stat(path)
    except OSError as error:
        raise StatefulsetError(f"kernel build folder {path}: cannot create it ({error})") from error
    _refuse_shared(path, found, uid, "folder")
    if not stat.S_ISDIR(found.st_mode):
        raise StatefulsetError(f"kernel build folder {path}: not a folder")


def _refuse_shared(path: Path, found: os.stat_result, uid: int, what: str) -> None:
    if found.st_uid != uid:
        raise StatefulsetError(
            f"kernel build {what} {path} is owned by uid {found.st_uid}, not by this user ({uid}): "
            "code is only loaded from this user's own files (set STATEFULSET_KERNEL_DIR to a private folder)"
        )
    if found.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StatefulsetError(
            f"kernel build {what} {path} is writable by others (mode {stat.S_IMODE(found.st_mode):o}): "
            "code is only loaded from files no one else can change (chmod go-w, or set STATEFULSET_KERNEL_DIR)"
        )


def compiler() -> list[str]:
    """The compiler command, from ``$CC``."""
    command = shlex.split(settings.CC.get())
    if not command:
        raise StatefulsetError("environment variable CC is set but empty: no compiler to build the kernels")
    return command


def library_path(source: bytes, command: list[str]) -> Path:
    """The library's file for this source, compiler, flags and platform."""
    digest = hashlib.sha256()
    platform_tag = f"{sys.platform}|{platform.machine()}|{sysconfig.get_platform()}"
    for part in (source, "\0".join(command).encode(), "\0".join(FLAGS).encode(), platform_tag.encode()):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return folder() / f"statefulset-kernels-{digest.hexdigest()[:24]}.so"


def _record(library: Path) -> Path:
    return library.with_suffix(".sha256")


def _verified(library: Path, uid: int) -> bool:
    """Whether ``library`` is this user's, unwritable by others, and hashes to its record."""
    try:
        recorded = _record(library).read_text().strip()
        with open(library, "rb") as file:
            _refuse_shared(library, os.fstat(file.fileno()), uid, "file")
            content = file.read()
    except FileNotFoundError:
        return False
    return hashlib.sha256(content).hexdigest() == recorded


def _compile(source: bytes, source_digest: str, command: list[str], target: Path) -> None:
    """Build into a folder of this process, then rename the library and its record into place."""
    work = target.parent / f".build-{os.getpid()}-{secrets.token_hex(6)}"
    work.mkdir(mode=0o700)
    try:
        (work / "kernels.c").write_bytes(source)
        run = subprocess.run(
            [*command, *FLAGS, f'-DSF_SOURCE_SHA256="{source_digest}"', "-o", "kernels.so", "kernels.c"],
            cwd=work,  # relative names: the same bytes whichever process builds
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT,
        )
        if run.returncode != 0:
            raise OSError(f"{shlex.join(command)} exited with {run.returncode}: {run.stderr.strip()[-2000:]}")
        built = work / "kernels.so"
        os.chmod(built, 0o700)
        (work / "record").write_text(hashlib.sha256(built.read_bytes()).hexdigest() + "\n")
        os.replace(built, target)
        os.replace(work / "record", _record(target))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def private_library(source: bytes, source_digest: str, warn) -> Path:
    """The path of a checked library built from ``source`` in this user's folder, built now if needed.

    ``warn(message)`` hears about a library that failed its check (it is built again).
    """
    uid = os.geteuid()
    command = compiler()
    target = library_path(source, command)
    check_private(target.parent, uid)
    if target.exists() and not _verified(target, uid):
        warn(f"the kernel library {target} does not match the SHA-256 recorded when it was built: building it again")
    elif target.exists():
        return target
    _compile(source, source_digest, command, target)
    if not _verified(target, uid):
        raise StatefulsetError(f"kernel library {target} changed while it was being built (another build?)")
    return target
