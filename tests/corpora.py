"""Small corpora for the tests: indexed datasets of random documents, one a named source.

``write_sources(root, {"web": 150, "code": 200}, seed=7)`` writes ``root/web`` and ``root/code`` (150
and 200 documents of 4 to 49 random uint16 tokens, drawn in that order from one generator seeded
7) and returns their prefixes. ``document(rng, source, index)`` makes each document instead, for
tests that need tokens they can recognise.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy

from statefulset import IndexedDatasetWriter

Document = Callable[[numpy.random.Generator, int, int], numpy.ndarray]


def write_sources(
    root: Path,
    documents: dict[str, int],
    seed: int,
    longest: int = 50,
    document: Document | None = None,
    dtype: type = numpy.uint16,
) -> list[str]:
    """One indexed dataset a source under ``root``, ``documents[name]`` documents each; their prefixes in order.
    A random document has ``4 .. longest - 1`` tokens below 60,000."""
    rng = numpy.random.default_rng(seed)
    prefixes = []
    for s, (name, count) in enumerate(documents.items()):
        prefixes.append(str(root / name))
        with IndexedDatasetWriter(prefixes[-1], dtype) as w:
            for d in range(count):
                if document is None:
                    w.add_document(rng.integers(0, 60000, int(rng.integers(4, longest))))
                else:
                    w.add_document(document(rng, s, d))
    return prefixes


def geometric_spec(root: Path, seed: int, documents: int, mean: int, seq_length: int) -> dict:
    """A native-packed spec over one dataset ``root/a`` of ``documents`` documents of geometric
    lengths of ``mean`` (uint16 tokens below 65,000), drawn from one generator seeded ``seed``."""
    rng = numpy.random.default_rng(seed)
    with IndexedDatasetWriter(root / "a", dtype=numpy.uint16) as w:
        for _ in range(documents):
            w.add_document(rng.integers(0, 65000, int(rng.geometric(1 / mean))))
    return {
        "data_path": str(root / "a"),
        "seq_length": seq_length,
        "packing": "native",
        "path_to_cache": str(root / "c"),
    }
