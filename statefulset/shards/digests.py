"""A shard's content digest: what a cache key or a state fingerprint names instead of a path.

The digest covers the ``.idx`` (every derived index depends on sequence lengths only, and those
live there), so a re-tokenised corpus never reuses stale indices, and a corpus moved elsewhere
(another folder, object storage) keeps its digests.
"""

from __future__ import annotations

import hashlib

from statefulset.errors import StatefulsetError
from statefulset.shards.facts import once

_DIGEST_CHUNK = 1 << 20  # constant memory: hashing a shard never holds more than this


def _hash_file(path: str) -> str:
    digest = hashlib.blake2b(digest_size=16)
    if "://" in path:
        import fsspec

        opener = fsspec.open(path, "rb")
    else:
        opener = open(path, "rb")  # noqa: SIM115 - closed by the with below
    with opener as f:
        while chunk := f.read(_DIGEST_CHUNK):
            digest.update(chunk)
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
