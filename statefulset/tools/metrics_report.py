"""``statefulset report METRICS.jsonl|STATE --spec SPEC``: PNG plots of a run's mixture and data wait.

- ``shares.png``: each source's achieved share of the positions ``[0, p)`` against its target
  weight at ``p``, for ``p`` up to the run's place. Exact and from the spec alone
  (``stream.source_positions``, :mod:`statefulset.streams.standing`); the input only says how far
  the run got: the largest ``position`` of the metrics lines, or a saved loader state's place.
- ``data_wait.png`` (metrics lines only): each rank's data wait per step, the seconds its
  ``data_wait_seconds`` grew since its previous line.

A metrics line is a JSON object with ``step``, ``rank`` (default 0) and ``loader.metrics()``'s
keys (docs/observability.md). matplotlib is an optional extra: ``pip install statefulset[plots]``.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from itertools import pairwise
from typing import Any

from statefulset.errors import StatefulsetError

POINTS = 200  # positions sampled for the shares plot


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise StatefulsetError("statefulset report draws with matplotlib: pip install 'statefulset[plots]'") from None
    return plt


def read_lines(path: str) -> list[dict[str, Any]]:
    """The metrics lines of a JSON-lines file, each checked to be an object with a ``step``."""
    lines = []
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
            except json.JSONDecodeError as exc:
                raise StatefulsetError(f"{path}:{number}: not a JSON line ({exc})") from None
            if not isinstance(line, dict) or not isinstance(line.get("step"), int):
                raise StatefulsetError(f"{path}:{number}: a metrics line is a JSON object with an int 'step'")
            lines.append(line)
    if not lines:
        raise StatefulsetError(f"{path}: no metrics lines")
    return lines


def state_position(path: str) -> int:
    """The place of a saved loader state (a rank's state or the list of every rank's)."""
    import torch

    from statefulset.loading.state import check_state

    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:
        raise StatefulsetError(f"{path}: not a saved loader state ({type(exc).__name__}: {exc})") from None
    states = state if isinstance(state, list) else [state]
    if not states:
        raise StatefulsetError(f"{path}: an empty list of loader states")
    s = check_state(states[0], path)
    return int(s["base"] + s["batches"] * s["dp_size"] * s["batch_size"])


def draw_shares(stream: Any, position: int, out: str) -> str:
    """``shares.png``: achieved share (solid) against target weight (dashed) of every source over positions."""
    from statefulset.streams.standing import standing

    if standing(stream, 1) is None:
        raise StatefulsetError("statefulset report: the shares plot needs packing native or bestfit")
    plt = _pyplot()
    xs = sorted({max(1, round(position * (i + 1) / POINTS)) for i in range(POINTS)})
    series: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for x in xs:
        for s in standing(stream, x) or []:
            series[s.prefix][0].append(s.samples / x)
            series[s.prefix][1].append(s.weight)
    fig, ax = plt.subplots(figsize=(9, 5))
    for prefix, (achieved, target) in series.items():
        name = os.path.basename(prefix)
        (line,) = ax.plot(xs, achieved, label=f"{name} achieved")
        ax.plot(xs, target, linestyle="--", color=line.get_color(), label=f"{name} target")
    ax.set(xlabel="global position", ylabel="share of samples", title="achieved share [0, p) vs target weight at p")
    ax.legend(fontsize="small")
    path = os.path.join(out, "shares.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def draw_waits(lines: list[dict[str, Any]], out: str) -> str | None:
    """``data_wait.png``: every rank's data wait per step (growth of ``data_wait_seconds`` between its lines)."""
    by_rank: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for line in lines:
        if "data_wait_seconds" in line:
            by_rank[int(line.get("rank", 0))].append((line["step"], float(line["data_wait_seconds"])))
    if not by_rank:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    for rank, points in sorted(by_rank.items()):
        points.sort()
        steps = [s for s, _ in points[1:]]
        waits = [(w - v) / max(s - t, 1) for (t, v), (s, w) in pairwise(points)]
        ax.plot(steps, waits, label=f"rank {rank}", linewidth=1)
    ax.set(xlabel="step", ylabel="data wait per step (s)", title="data wait per step, by DP rank")
    if len(by_rank) <= 16:
        ax.legend(fontsize="small")
    path = os.path.join(out, "data_wait.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(source: str, spec: str, out: str = ".") -> list[str]:
    """Draw the plots for ``source`` (metrics lines or a saved state) into ``out``; the PNGs written."""
    from statefulset.streams.opening import open_stream

    if not os.path.exists(source):
        raise StatefulsetError(f"{source}: no such file")
    os.makedirs(out, exist_ok=True)
    lines = read_lines(source) if source.endswith((".jsonl", ".json")) else None
    if lines is not None:
        places = [int(line["position"]) for line in lines if "position" in line]
        position = max(places) if places else 0
    else:
        position = state_position(source)
    if position < 1:
        raise StatefulsetError(f"{source}: the run has no position past 0 to plot shares over")
    written = [draw_shares(open_stream(spec, "train"), position, out)]
    if lines is not None:
        waits = draw_waits(lines, out)
        if waits is not None:
            written.append(waits)
    return written
