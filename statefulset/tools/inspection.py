"""``statefulset inspect``: what a shard holds, and whether every byte of it is consistent."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy

from statefulset.errors import StatefulsetError
from statefulset.shards import idx_format
from statefulset.shards.reader import IndexedDataset

PERCENTILES = (0, 1, 10, 50, 90, 99, 100)
# Exact percentiles need a copy of the lengths; past this many values they come from an
# evenly spaced sample, so inspecting a huge shard stays within a few hundred MB.
_EXACT_LIMIT = 50_000_000


@dataclass
class ShardReport:
    prefix: str
    valid: bool
    problem: str | None = None
    dtype: str | None = None
    multimodal: bool = False
    documents: int = 0
    sequences: int = 0
    tokens: int = 0
    empty_sequences: int = 0
    bin_bytes: int = 0
    idx_bytes: int = 0
    token_min: float | None = None
    token_max: float | None = None
    sequence_length_percentiles: dict[str, float] = field(default_factory=dict)
    document_length_percentiles: dict[str, float] = field(default_factory=dict)
    sampled: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        if not self.valid and self.dtype is None:
            return f"{self.prefix}: INVALID\n  {self.problem}"
        rows = [
            ("dtype", self.dtype),
            ("documents", f"{self.documents:,}"),
            ("sequences", f"{self.sequences:,} ({self.empty_sequences:,} empty)"),
            ("tokens", f"{self.tokens:,}"),
            ("files", f".bin {self.bin_bytes:,} B, .idx {self.idx_bytes:,} B"),
            ("token ids", f"{self.token_min} .. {self.token_max}"),
        ]
        for title, values in (
            ("sequence length", self.sequence_length_percentiles),
            ("document length", self.document_length_percentiles),
        ):
            if values:
                rows.append((title, "  ".join(f"{k}={v:,.0f}" for k, v in values.items())))
        width = max(len(r[0]) for r in rows)
        lines = [f"{self.prefix}" + (" (multimodal)" if self.multimodal else "")]
        lines += [f"  {name:<{width}}  {value}" for name, value in rows]
        if self.sampled:
            lines.append(f"  (percentiles from an evenly spaced sample of {_EXACT_LIMIT:,})")
        lines.append("  valid: yes" if self.valid else f"  valid: NO: {self.problem}")
        return "\n".join(lines)


def _percentiles(values: numpy.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {}
    found = numpy.percentile(values, PERCENTILES)
    names = {0: "min", 100: "max"}
    out = {names.get(p, f"p{p}"): float(v) for p, v in zip(PERCENTILES, found, strict=True)}
    out["mean"] = float(values.mean())
    return out


def _sample(values: numpy.ndarray) -> numpy.ndarray:
    if values.size <= _EXACT_LIMIT:
        return values
    return values[numpy.linspace(0, values.size - 1, _EXACT_LIMIT).astype(numpy.int64)]


def _token_range(ds: IndexedDataset) -> tuple[float | None, float | None]:
    """Smallest and largest token id, read chunk by chunk through the whole ``.bin``."""
    lo = hi = None
    step = idx_format.CHUNK * 4
    for start in range(0, ds.num_tokens, step):
        count = min(step, ds.num_tokens - start)
        chunk = ds.read_range(start, count)
        cmin, cmax = chunk.min().item(), chunk.max().item()
        lo = cmin if lo is None else min(lo, cmin)
        hi = cmax if hi is None else max(hi, cmax)
    return lo, hi


def inspect_shard(prefix: str, *, multimodal: bool = False, vocab_size: int | None = None) -> ShardReport:
    """Statistics of a shard and the result of a full validity check (never raises on bad data)."""
    try:
        ds = IndexedDataset(prefix, multimodal=multimodal, validate=True)
    except StatefulsetError as exc:
        return ShardReport(prefix=os.fspath(prefix), valid=False, problem=str(exc))
    lengths = ds.sequence_lengths
    report = ShardReport(
        prefix=ds.path_prefix,
        valid=True,
        dtype=str(ds.dtype),
        multimodal=multimodal,
        documents=ds.num_documents,
        sequences=len(ds),
        tokens=ds.num_tokens,
        empty_sequences=int(numpy.count_nonzero(lengths == 0)),
        bin_bytes=ds.num_tokens * ds.dtype.itemsize,
        idx_bytes=ds.index_nbytes,
    )
    report.sampled = len(ds) > _EXACT_LIMIT
    report.sequence_length_percentiles = _percentiles(_sample(lengths))
    if len(ds) <= _EXACT_LIMIT:
        ends = numpy.concatenate([[0], numpy.cumsum(lengths, dtype=numpy.int64)])
        report.document_length_percentiles = _percentiles(numpy.diff(ends[ds.document_indices]))
    report.token_min, report.token_max = _token_range(ds)
    outside = report.token_max is not None and (report.token_max >= (vocab_size or 0) or report.token_min < 0)
    if vocab_size is not None and outside:
        report.valid = False
        report.problem = (
            f"{ds.path_prefix}.bin: token ids span {report.token_min}..{report.token_max}, "
            f"outside the vocabulary [0, {vocab_size})"
        )
    return report
