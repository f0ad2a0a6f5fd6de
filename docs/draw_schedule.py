"""Draw docs/img/schedule_shares.png: each source's share over positions for configs/schedule_anneal.yaml.

Run from the repository root after ``statefulset demo`` (the config reads its shards):

    python docs/draw_schedule.py

The shares are read from the stream itself (``stream.locate``: which source serves each position),
in windows of 500 positions, with the cumulative share (``source_positions(p) / p``) beside them.
"""

from __future__ import annotations

import os

import numpy

from statefulset import open_stream

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = os.path.join(os.path.dirname(HERE), "configs", "schedule_anneal.yaml")
END, WINDOW = 40_000, 500


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stream = open_stream(SPEC)
    which, _ = stream.locate(numpy.arange(END))
    names = [os.path.basename(p).removesuffix("_text_document") for p in stream.prefixes]
    fig, (windowed, cumulative) = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
    starts = numpy.arange(0, END, WINDOW)
    for s, name in enumerate(names):
        share = [(which[a : a + WINDOW] == s).mean() for a in starts]
        windowed.step(starts, share, where="post", label=name)
        points = numpy.arange(WINDOW, END + 1, WINDOW)
        cumulative.plot(points, [stream.source_positions(int(p))[stream.prefixes[s]] / p for p in points], label=name)
    for ax, title in ((windowed, f"share in each window of {WINDOW} positions"), (cumulative, "share of [0, p)")):
        for start in stream.starts[1:]:
            ax.axvline(int(start), color="black", linewidth=0.7, linestyle="--")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("global sample position p")
        ax.grid(alpha=0.3)
    windowed.set_ylabel("share of samples")
    windowed.legend(fontsize=8)
    fig.suptitle("configs/schedule_anneal.yaml: three stages (dashed: stage starts)", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "img", "schedule_shares.png"), dpi=120)


if __name__ == "__main__":
    main()
