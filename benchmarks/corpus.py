"""The synthetic corpus shared by the shard benchmarks, generated deterministically in memory.

It is the corpus of the anchor measurements (shared/reference/anchor-megatron-nanotron.md §7.1):
1,000,000 documents with geometric lengths (p=1/500, seed 1234), about 500M uint16 tokens in
[0, 50256), and the EOD token 50256 as the last token of every document. With the default
document count it reproduces the anchor's 499,984,443 tokens exactly.

Run it directly to print the corpus statistics::

    python benchmarks/corpus.py [--docs N]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy

DEFAULT_DOCS = 1_000_000
SEED = 1234
MEAN_LENGTH = 500
VOCAB = 50256
EOD = 50256
DTYPE = numpy.uint16
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def _lengths(rng: numpy.random.Generator, docs: int) -> numpy.ndarray:
    if docs < 1:
        raise ValueError(f"docs must be >= 1, got {docs}")
    return rng.geometric(1.0 / MEAN_LENGTH, size=docs).astype(numpy.int64)


def corpus_lengths(docs: int = DEFAULT_DOCS, seed: int = SEED) -> numpy.ndarray:
    """Only the document lengths of :func:`make_corpus` (cheap: for checking files on disk)."""
    return _lengths(numpy.random.default_rng(seed), docs)


def make_corpus(docs: int = DEFAULT_DOCS, seed: int = SEED) -> tuple[numpy.ndarray, numpy.ndarray]:
    """Return ``(tokens, lengths)``: all documents concatenated (1-D uint16) and tokens per document (int64).

    Lengths are drawn before tokens from one generator, so a given ``docs`` always gives the
    same corpus, and the lengths of the first k documents do not depend on ``docs``.
    """
    rng = numpy.random.default_rng(seed)
    lengths = _lengths(rng, docs)
    # Drawing uint16 directly avoids a 4 GB int64 temporary at full size.
    tokens = rng.integers(0, VOCAB, size=int(lengths.sum()), dtype=DTYPE)
    tokens[numpy.cumsum(lengths) - 1] = EOD
    return tokens, lengths


def add_docs_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--docs`` option every benchmark shares (small values are for smoke tests)."""
    parser.add_argument(
        "--docs",
        type=int,
        default=DEFAULT_DOCS,
        help=f"number of documents in the synthetic corpus (default {DEFAULT_DOCS:,})",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_docs_argument(parser)
    args = parser.parse_args()
    start = time.perf_counter()
    tokens, lengths = make_corpus(args.docs)
    seconds = time.perf_counter() - start
    print(
        f"{lengths.size:,} documents, {tokens.size:,} tokens ({tokens.nbytes:,} B), "
        f"mean length {lengths.mean():.2f}, max {int(lengths.max()):,}, generated in {seconds:.2f} s"
    )


if __name__ == "__main__":
    main()
