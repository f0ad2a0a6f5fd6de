"""Where derived indices live: a content-keyed, crash-safe, concurrency-safe cache of numpy arrays.

megatron-core keys its cache by the prefix *string*, so a re-tokenised corpus silently reuses
stale indices, and it relies on "global rank 0 builds, everyone waits at a barrier", which breaks
without a shared filesystem. Here:

- the key hashes everything the arrays depend on, including each shard's *content* digest (of
  its ``.idx``, which the indices depend on, and of its ``.bin``: a corpus re-tokenised into
  byte-identical ``.idx`` files is other data, :mod:`statefulset.shards.digests`);
- every process may build: an ``flock`` makes concurrent builders on one filesystem wait for
  the first, and on separate filesystems (one per node) each node builds its own copy; a waiter
  logs what it waits for and gives up after ``STATEFULSET_CACHE_WAIT`` seconds (default 3600);
- an entry appears atomically (a folder written under a temporary name, then renamed), so a
  crash mid-build leaves nothing that looks complete; the next build of that entry, holding its
  lock, removes the temporary folder a killed builder left.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy

from statefulset import settings
from statefulset.errors import StatefulsetError
from statefulset.shards.locks import exclusive

logger = logging.getLogger("statefulset")

CACHE_VERSION = 1
# Entries this process built (not loaded), by kind: what tests and logs use to see who built.
builds: dict[str, int] = {}


def description_key(description: dict[str, Any]) -> str:
    text = json.dumps({"cache_version": CACHE_VERSION, **description}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


# -- the array cache ------------------------------------------------------------------------------
def _temp_prefix(path: str) -> str:
    return ".tmp-" + os.path.basename(path) + "-"


def _remove_stale_temps(path: str) -> None:
    """Remove what killed builders of entry ``path`` left; only called with the entry's lock held,
    so no live process is writing any of them (every builder of the entry takes that lock)."""
    parent, prefix = os.path.dirname(path), _temp_prefix(path)
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            if name.startswith(prefix):
                logger.info("statefulset: removing %s, left by an index build that was killed", name)
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


class IndexCache:
    """Arrays keyed by a description; ``root=None`` keeps everything in memory."""

    def __init__(self, root: str | None) -> None:
        self.root = root

    def entry_path(self, kind: str, description: dict[str, Any]) -> str | None:
        if self.root is None:
            return None
        return os.path.join(self.root, f"{kind}-{description_key(description)}")

    def get_or_build(
        self, kind: str, description: dict[str, Any], build: Callable[[], dict[str, numpy.ndarray]]
    ) -> dict[str, numpy.ndarray]:
        """The cached arrays (memory-mapped) or, on a miss, ``build()``'s, stored for next time."""
        path = self.entry_path(kind, description)
        if path is None:
            return _timed_build(kind, build, "in memory (no path_to_cache)")
        started = time.perf_counter()
        found = self._load(path, description)
        if found is not None:
            logger.debug("statefulset: loaded %s indices from %s in %.3f s", kind, path, time.perf_counter() - started)
            return found
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            logger.warning("statefulset: cannot create cache folder %s (%s); building in memory", self.root, exc)
            return build()
        with exclusive(path + ".lock", path, "building this index") as held:
            found = self._load(path, description)  # another process may have finished while we waited
            if found is not None:
                return found
            if held:
                _remove_stale_temps(path)
            arrays = _timed_build(kind, build, f"into {path}")
            try:
                self._store(path, description, arrays)
            except OSError as exc:
                logger.warning("statefulset: cannot write cache entry %s (%s); using it from memory", path, exc)
                return arrays
        loaded = self._load(path, description)
        return arrays if loaded is None else loaded

    @staticmethod
    def _load(path: str, description: dict[str, Any]) -> dict[str, numpy.ndarray] | None:
        manifest = os.path.join(path, "description.json")
        if not os.path.exists(manifest):
            return None
        try:
            with open(manifest, encoding="utf-8") as f:
                saved = json.load(f)
            arrays = {name: numpy.load(os.path.join(path, name + ".npy"), mmap_mode="r") for name in saved["arrays"]}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StatefulsetError(f"{path}: cache entry is damaged ({exc}); delete the folder to rebuild it") from exc
        if saved.get("description") != json.loads(json.dumps(description)):
            raise StatefulsetError(f"{path}: cache entry describes other data (hash collision?); delete it")
        for name, shape in saved["arrays"].items():
            if list(arrays[name].shape) != shape:
                raise StatefulsetError(f"{path}/{name}.npy: shape {arrays[name].shape}, expected {tuple(shape)}")
        return arrays

    @staticmethod
    def _store(path: str, description: dict[str, Any], arrays: dict[str, numpy.ndarray]) -> None:
        parent = os.path.dirname(path)
        tmp = _make_folder(parent, _temp_prefix(path))
        try:
            with contextlib.ExitStack() as opened:
                files = []
                for name, array in arrays.items():
                    f = opened.enter_context(open(os.path.join(tmp, name + ".npy"), "wb"))
                    numpy.save(f, numpy.ascontiguousarray(array), allow_pickle=False)
                    files.append(f)
                manifest = {
                    "description": description,
                    "arrays": {name: list(array.shape) for name, array in arrays.items()},
                }
                text = opened.enter_context(open(os.path.join(tmp, "description.json"), "w", encoding="utf-8"))
                json.dump(manifest, text, indent=2, sort_keys=True)
                for f in [*files, text]:
                    f.flush()
                _fsync_all([f.fileno() for f in [*files, text]], path)
            try:
                os.rename(tmp, path)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # someone else's complete entry won the race
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _fsync_all(fds: list[int], entry: str) -> None:
    """``fsync`` every file of an entry before it is renamed into place, side by side (one thread each
    but the first): their journal commits overlap instead of following one another (an entry's four
    files: ~15 -> ~7 ms here). Raises the first failure, as one ``fsync`` after the other did."""
    failed: list[OSError] = []

    def sync(fd: int) -> None:
        try:
            os.fsync(fd)
        except OSError as exc:
            failed.append(exc)

    threads = [threading.Thread(target=sync, args=(fd,), name="statefulset-fsync", daemon=True) for fd in fds[1:]]
    for thread in threads:
        thread.start()
    if fds:
        sync(fds[0])
    bound = settings.CACHE_WAIT.get()
    for thread in threads:
        thread.join(bound)
        if thread.is_alive():
            raise OSError(f"{entry}: a file of the entry was not on disk after {bound:g} s (STATEFULSET_CACHE_WAIT)")
    if failed:
        raise failed[0]


def _timed_build(kind: str, build: Callable[[], dict[str, numpy.ndarray]], where: str) -> dict[str, numpy.ndarray]:
    started = time.perf_counter()
    arrays = build()
    builds[kind] = builds.get(kind, 0) + 1
    logger.info("statefulset: built %s indices %s in %.2f s", kind, where, time.perf_counter() - started)
    return arrays


def _make_folder(parent: str, prefix: str) -> str:
    """A new folder ``<parent>/<prefix><random>`` with the mode any folder the user makes gets
    (0777 less the umask, applied by the kernel): unlike ``tempfile.mkdtemp`` (0700), the entry
    it becomes is readable by whoever may read the cache. The umask is never changed, not even
    for an instant: other threads create files meanwhile."""
    for _ in range(100):  # 64 random bits: a second try is already unheard of
        tmp = os.path.join(parent, prefix + secrets.token_hex(8))
        try:
            os.mkdir(tmp, 0o777)
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{parent}: 100 random folder names {prefix}* all exist")
