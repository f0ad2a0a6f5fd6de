"""``statefulset prepare SPEC``: do once, before a large run, what every rank would otherwise do at start-up.

For every shard of the spec: the full index check, the content digest of its ``.idx`` and the full
digest of its ``.bin`` (:mod:`statefulset.shards.digests`), remembered under
``path_to_cache/facts`` for the exact file versions read; for every split the spec builds: its
stream opened once, which builds (or finds) the megatron indices in ``path_to_cache``. Every
result is keyed by content and file version, written atomically, and shared by lock with any
process doing the same at the same time, so running it twice, or while ranks start, is safe:
the second run finds everything and says so.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from statefulset.errors import StatefulsetError
from statefulset.index.cache import builds as cache_builds
from statefulset.shards import facts
from statefulset.shards.digests import bin_full_digest, shard_digest
from statefulset.shards.reader import IndexedDataset
from statefulset.spec.model import DatasetSpec, load_spec
from statefulset.spec.splits import SPLITS
from statefulset.streams.opening import cache_folder, open_stream


@dataclass
class PrepareReport:
    spec: str
    cache: str
    shards: int = 0
    checked: int = 0  # shards this run checked in full (the rest were known)
    digested: int = 0
    bins_hashed: int = 0  # .bin files this run hashed in full
    splits: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def text(self) -> str:
        lines = [
            f"{self.spec}: prepared in {self.cache}",
            f"  shards: {self.shards} ({self.checked} checked in full, {self.digested} hashed, "
            f"{self.bins_hashed} .bin hashed in full, the rest already known) "
            f"in {self.seconds.get('shards', 0.0):.2f} s",
        ]
        for split, item in self.splits.items():
            built = ", ".join(f"{n} {k}" for k, n in item["built"].items()) or "nothing built (already cached)"
            lines.append(f"  {split}: {item['samples']} samples, {built}, in {item['seconds']:.2f} s")
        lines.append(f"  total {self.seconds.get('total', 0.0):.2f} s")
        return "\n".join(lines)


def _prefixes(spec: DatasetSpec, splits: list[str]) -> list[str]:
    seen: dict[str, None] = {}
    for split in splits:
        selected = spec.blend_for(split)
        if selected is not None:
            for prefix, weight in selected[0]:
                if weight is None or weight > 0:
                    seen[prefix] = None
    return list(seen)


def prepare(
    spec_path: str | os.PathLike[str], splits: list[str] | None = None, jobs: int = 1, show_progress: bool = True
) -> PrepareReport:
    """Check, hash and index everything ``spec_path`` needs; see the module docstring."""
    started = time.perf_counter()
    spec = load_spec(spec_path)
    wanted = splits or [s for s in SPLITS if spec.blend_for(s) is not None]
    for split in wanted:
        if split not in SPLITS:
            raise StatefulsetError(f"--splits: {split!r} is not one of {', '.join(SPLITS)}")
        if spec.blend_for(split) is None:
            raise StatefulsetError(f"{spec.source}: the spec builds no {split} split")
    if jobs < 1:
        raise StatefulsetError(f"--jobs must be at least 1, got {jobs}")
    cache = cache_folder(spec)
    memo = os.path.join(cache, "facts")
    report = PrepareReport(spec=spec.source, cache=cache)
    prefixes = _prefixes(spec, wanted)
    report.shards = len(prefixes)
    before = dict(facts.computed)

    def one(prefix: str) -> None:
        with spec.blame(spec.data_key(wanted[0])):
            dataset = IndexedDataset(prefix, storage_options=spec.storage_options, facts_dir=memo)
            shard_digest(prefix, memo)
            bin_full_digest(dataset, memo)

    t = time.perf_counter()
    bar = tqdm(total=len(prefixes), desc="shards", unit="shard", disable=not show_progress)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for _ in pool.map(one, prefixes):
            bar.update(1)
    bar.close()
    report.seconds["shards"] = time.perf_counter() - t
    report.checked = facts.computed.get("verified", 0) - before.get("verified", 0)
    report.digested = facts.computed.get("digest", 0) - before.get("digest", 0)
    report.bins_hashed = facts.computed.get("bin-digest", 0) - before.get("bin-digest", 0)
    for split in wanted:
        t, built_before = time.perf_counter(), dict(cache_builds)
        stream = open_stream(spec, split)
        built = {k: n - built_before.get(k, 0) for k, n in cache_builds.items() if n > built_before.get(k, 0)}
        samples = f"unbounded (packing {stream.packing})" if stream.unbounded else f"{len(stream):,}"
        report.splits[split] = {"samples": samples, "built": built, "seconds": time.perf_counter() - t}
    report.seconds["total"] = time.perf_counter() - started
    return report
