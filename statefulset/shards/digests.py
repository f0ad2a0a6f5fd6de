"""A shard's content digest: what a cache key, a stage's source key or a state names instead of a path.

A shard's identity covers both files (CONTRACT §14):

- its ``.idx``, hashed in full (every derived index depends on sequence lengths, and those live
  there), once per file version (:mod:`statefulset.shards.facts`);
- its ``.bin``: the size and a keyed sample of :data:`SAMPLE_BLOCKS` blocks of
  :data:`SAMPLE_BLOCK` bytes (plus the first and the last), at positions derived from a fixed key
  and the size. Fixed-length, pre-chunked corpora have byte-identical ``.idx`` files; their
  ``.bin`` samples tell them apart. The sample is read at every open (a few hundred KiB, whatever
  the corpus size; for object storage once per object version), so it is the same whether or not
  ``statefulset prepare`` ran: prepared and unprepared ranks agree on every identity.

``statefulset prepare`` also hashes each local ``.bin`` in full (:func:`bin_full_digest`) and
records the digest, with the sample it saw, for that file version. An open that finds the record
compares its own sample with it: a ``.bin`` rewritten in place under the same size, mtime and
inode (``rsync --inplace --times``) is then refused, naming the file, instead of being trusted.

A corpus moved elsewhere (another folder, object storage) keeps its digests: no path enters them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from statefulset.errors import StatefulsetError
from statefulset.shards import facts
from statefulset.shards.facts import once

_DIGEST_CHUNK = 1 << 20  # constant memory: hashing a shard never holds more than this
SAMPLE_BLOCKS = 64
SAMPLE_BLOCK = 4096
_SAMPLE_KEY = b"statefulset .bin sample v1"


@dataclass(frozen=True)
class ShardDigest:
    """A shard's ``idx`` digest (the whole file) and ``bin`` digest (size and keyed sample)."""

    idx: str
    bin: str

    @property
    def content(self) -> str:
        """The shard's identity: both files."""
        return hashlib.blake2b(f"{self.idx}:{self.bin}".encode(), digest_size=16).hexdigest()


def _hash_file(path: str) -> str:
    digest = hashlib.blake2b(digest_size=16)
    if "://" in path:
        import fsspec

        with fsspec.open(path, "rb") as f:
            while chunk := f.read(_DIGEST_CHUNK):
                digest.update(chunk)
        return digest.hexdigest()
    # One reused buffer: a new bytes object per read would be fresh pages to fault in and zero each time.
    block = bytearray(_DIGEST_CHUNK)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while count := f.readinto(block):
            digest.update(view[:count])
    return digest.hexdigest()


def shard_digest(prefix: str, memo_dir: str | None = None) -> str:
    """Content digest of ``prefix.idx``, hashed once per file version (:mod:`statefulset.shards.facts`).

    Concurrent callers share the work: one hashes, the others wait for its result.
    """
    path = prefix + ".idx"

    def digest() -> str:
        try:
            return _hash_file(path)
        except OSError as exc:
            raise StatefulsetError(f"{path}: cannot read to identify the shard: {exc}") from exc

    return str(once("digest", (path,), digest, "hashing this index", memo_dir))


def sample_ranges(size: int) -> tuple[list[int], list[int]]:
    """(offsets, sizes) of the blocks a ``.bin`` of ``size`` bytes is sampled at: a pure function of the size."""
    blocks = -(-size // SAMPLE_BLOCK)
    if blocks <= SAMPLE_BLOCKS + 2:
        picked = set(range(blocks))
    else:
        picked = {0, blocks - 1}
        for i in range(SAMPLE_BLOCKS):
            h = hashlib.blake2b(_SAMPLE_KEY + size.to_bytes(8, "little") + i.to_bytes(4, "little"), digest_size=8)
            picked.add(int.from_bytes(h.digest(), "little") % blocks)
    offsets = [b * SAMPLE_BLOCK for b in sorted(picked)]
    return offsets, [min(SAMPLE_BLOCK, size - o) for o in offsets]


def bin_sample(bin_file: Any) -> str:
    """The ``.bin`` part of a shard's identity: its size and the keyed sample of its blocks.

    ``bin_file``: a :class:`statefulset.shards.storage.ShardFile` (local: a few hundred KiB read
    with positional reads; remote: one batched, concurrent ranged read).
    """
    offsets, sizes = sample_ranges(bin_file.size)
    digest = hashlib.blake2b(_SAMPLE_KEY + bin_file.size.to_bytes(8, "little"), digest_size=16)
    # Read without starting obstore's runtime: the trainer that opens a dataset forks its DataLoader
    # workers afterwards, and a worker forked from a process running it cannot use obstore.
    for block in bin_file.read_ranges(offsets, sizes, fork_safe=True):
        digest.update(block)
    return digest.hexdigest()


def _remote_sample(bin_file: Any, memo_dir: str | None) -> str:
    """A remote ``.bin``'s sample, remembered per object version (URL, ETag, size) in ``memo_dir``."""
    remote = bin_file.remote
    folder = memo_dir or facts.memo_dir()
    name = hashlib.blake2b(f"bin-sample\0{remote.url}\0{remote.ukey}".encode(), digest_size=16).hexdigest()
    path = os.path.join(folder, f"{name}.json")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if isinstance(saved, dict) and saved.get("version") == remote.ukey and isinstance(saved.get("sample"), str):
            return str(saved["sample"])
    except (OSError, ValueError):
        pass
    sample = bin_sample(bin_file)
    facts.write_json(path, {"url": remote.url, "version": remote.ukey, "sample": sample})
    return sample


def identify(dataset: Any, memo_dir: str | None, idx_digest: str | None = None) -> ShardDigest:
    """The digest of an opened :class:`~statefulset.shards.reader.IndexedDataset` (both of its files).

    ``idx_digest``: its ``.idx``'s :func:`shard_digest` where the caller has it already
    (:mod:`statefulset.shards.identifying` hashes it in a thread).

    The ``.idx`` is hashed by path, so the file there must still be the version the dataset mapped
    (a file renamed over it in between is refused, naming it: the digest would be another file's).

    Where ``statefulset prepare`` recorded the ``.bin``'s full digest for this file version, the
    sample read now must match the one recorded with it; otherwise the file was rewritten in place
    (same size, mtime and inode) and is refused, naming it.
    """
    prefix = dataset.path_prefix
    idx = idx_digest or dataset.known_digest or shard_digest(prefix, memo_dir)
    # The digest was taken by path: the file there must still be the one this dataset mapped.
    dataset.check_index_unchanged()
    bin_file = dataset.bin_file
    if bin_file.is_local:
        sample = bin_sample(bin_file)
        recorded = facts.recall("bin-digest", bin_file.path, directory=memo_dir)
        if isinstance(recorded, dict) and recorded.get("sample") != sample:
            raise StatefulsetError(
                f"{bin_file.path}: its content differs from what `statefulset prepare` hashed for this file version "
                "(same size, mtime and inode): the file was rewritten in place; run `statefulset prepare` again"
            )
    else:
        sample = _remote_sample(bin_file, memo_dir)
    return ShardDigest(idx, sample)


def bin_full_digest(dataset: Any, memo_dir: str | None) -> str | None:
    """``statefulset prepare``: the full digest of a local ``.bin``, hashed once per file version.

    Recorded in the facts with the keyed sample (:func:`identify` checks it at every open).
    None for a ``.bin`` on object storage, whose version (ETag) the store pins.
    """
    bin_file = dataset.bin_file
    if not bin_file.is_local:
        return None
    path = bin_file.path

    def digest() -> dict[str, str]:
        try:
            return {"blake2b": _hash_file(path), "sample": bin_sample(bin_file)}
        except OSError as exc:
            raise StatefulsetError(f"{path}: cannot read to hash the shard's tokens: {exc}") from exc

    return str(once("bin-digest", (path,), digest, "hashing this .bin in full", memo_dir)["blake2b"])


# -- naming the shard a state was saved on --------------------------------------------------------
_CHECKS_BUDGET = 512  # hex digits per state for all sources (a state travels in a 4 KiB slot)
_CHECK_WIDTH = 4


def shard_checks(described: list[str], bins: list[str]) -> str:
    """Per source, a few hex digits of its description (``.idx``, range, weight) and of its ``.bin``.

    A state carries them (``identity.shards``) so that a refused restore names the shards that
    changed. The width shrinks with the source count to keep states small ("" past 256 sources).
    """
    width = min(_CHECK_WIDTH, _CHECKS_BUDGET // (2 * len(bins))) if bins else 0
    return "".join(d[:width] + b[:width] for d, b in zip(described, bins, strict=True)) if width else ""


def changed_shards(saved: Any, current: Any, prefixes: list[str]) -> str:
    """Which shards differ between two :func:`shard_checks` strings, in words ("" when it cannot tell)."""
    n = len(prefixes)
    if not n or not isinstance(saved, str) or not isinstance(current, str) or len(saved) != len(current):
        return ""
    width = len(current) // (2 * n)
    if not width or len(current) != 2 * n * width:
        return ""
    bins, others = [], []
    for i, prefix in enumerate(prefixes):
        at = 2 * width * i
        if saved[at + width : at + 2 * width] != current[at + width : at + 2 * width]:
            bins.append(prefix + ".bin")
        elif saved[at : at + width] != current[at : at + width]:
            others.append(prefix)
    said = []
    if bins:
        said.append(f"{_listed(bins)} hold(s) other tokens than when the state was saved (re-tokenised or replaced)")
    if others:
        said.append(f"{_listed(others)}: other .idx content, split range or weight")
    return "; ".join(said)


def _listed(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
