"""``statefulset inspect SPEC.yaml``: what a spec will train on, split by split, before a job starts.

For each split it opens the stream (building and caching megatron indices, as training would)
and reports, per source, the split's sequence range, sequences, documents, tokens, samples per
epoch, the epochs the index was built over for ``num_samples`` (megatron packing) and the
realised blend shares (megatron: counted in the built blend index; native: the weights, exact by
construction). A split that cannot open is reported with its error instead of stopping the rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from statefulset.errors import StatefulsetError
from statefulset.spec.model import DatasetSpec, load_spec
from statefulset.spec.splits import SPLITS
from statefulset.streams.opening import open_stream
from statefulset.streams.overview import SplitOverview, describe


@dataclass
class SplitPreview:
    split: str
    overview: SplitOverview | None = None  # None when the split is empty or failed to open
    problem: str | None = None  # why the split could not open

    def as_dict(self) -> dict[str, Any]:
        if self.overview is not None:
            return self.overview.as_dict()
        return {"split": self.split, "empty": self.problem is None, "problem": self.problem}


@dataclass
class SpecPreview:
    spec: str
    packing: str
    seq_length: int
    seed: int
    split_ratios: str | None  # None for per-split sections (train:/valid:/test:)
    cache: str | None
    splits: list[SplitPreview] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        """Every split the spec gives data to opens."""
        return all(s.problem is None for s in self.splits)

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "packing": self.packing,
            "seq_length": self.seq_length,
            "seed": self.seed,
            "split": self.split_ratios,
            "cache": self.cache,
            "valid": self.valid,
            "splits": {s.split: s.as_dict() for s in self.splits},
        }

    def text(self) -> str:
        ratios = f", split {self.split_ratios}" if self.split_ratios is not None else ", per-split data"
        cache = self.cache if self.cache is not None else "this node's default (path_to_cache is null)"
        if self.packing == "native":  # it still keeps facts about shard versions (facts/) there
            cache += " (facts about shard versions only: packing native builds no index)"
        lines = [
            f"{self.spec}: packing {self.packing}, seq_length {self.seq_length}, seed {self.seed}{ratios}",
            f"  cache: {cache}",
        ]
        for item in self.splits:
            if item.overview is not None:
                lines += ["  " + line for line in item.overview.lines(settings=False)]
            elif item.problem is not None:
                lines.append(f"  {item.split}: CANNOT OPEN: {item.problem}")
            else:
                lines.append(f"  {item.split}: empty")
        return "\n".join(lines)


def preview_spec(path: str | os.PathLike[str], splits: tuple[str, ...] = SPLITS) -> SpecPreview:
    """Open every split of the spec at ``path`` and describe it; a bad spec file raises StatefulsetError."""
    spec: DatasetSpec = load_spec(path)
    preview = SpecPreview(
        os.fspath(path),
        spec.packing,
        spec.seq_length,
        spec.seed,
        spec.split if spec.data_path is not None else None,
        spec.path_to_cache,
    )
    for split in splits:
        if spec.blend_for(split) is None:
            preview.splits.append(SplitPreview(split))
            continue
        try:
            stream = open_stream(spec, split)
        except StatefulsetError as exc:
            preview.splits.append(SplitPreview(split, problem=str(exc)))
            continue
        preview.splits.append(SplitPreview(split, describe(stream)))
    return preview


def is_spec_path(text: str) -> bool:
    """What ``statefulset inspect`` treats as a spec rather than a shard prefix."""
    return text.lower().endswith((".yaml", ".yml"))
