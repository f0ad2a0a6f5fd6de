"""The campaign's inputs: token shards for the loading cases, JSON-lines/gzip/Parquet inputs for preprocessing.

Everything is drawn from a seed, so a case is reproduced from its seed alone. The loading shards
are built once per session (``build_shards``) and shared read-only by every case; a case that
damages or replaces a shard works on its own copy.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil

import numpy

from statefulset import IndexedDatasetWriter

# name -> (dtype, documents, mean document length): small, so a case costs milliseconds of I/O.
SHARDS = {
    "web": (numpy.uint16, 400, 30),
    "code": (numpy.int32, 150, 60),
    "math": (numpy.uint16, 60, 150),
}


def build_shards(root: str, seed: int = 24) -> dict[str, str]:
    """Write the shared shards under ``root``; returns name -> prefix."""
    os.makedirs(root, exist_ok=True)
    rng = numpy.random.default_rng(seed)
    prefixes = {}
    for name, (dtype, documents, mean) in SHARDS.items():
        prefix = os.path.join(root, name)
        with IndexedDatasetWriter(prefix, dtype=dtype) as writer:
            for _ in range(documents):
                # Documents of one or several sequences, some empty, some longer than any seq_length drawn.
                lengths = [int(x) for x in rng.geometric(1 / mean, int(rng.integers(1, 4)))]
                if rng.random() < 0.05:
                    lengths[0] = 0
                writer.add_document(rng.integers(1, 50000, sum(lengths)), lengths)
        prefixes[name] = prefix
    return prefixes


def copy_shards(prefixes: dict[str, str], folder: str) -> dict[str, str]:
    os.makedirs(folder, exist_ok=True)
    copies = {}
    for name, prefix in prefixes.items():
        for ext in (".bin", ".idx"):
            shutil.copyfile(prefix + ext, os.path.join(folder, name + ext))
        copies[name] = os.path.join(folder, name)
    return copies


# -- preprocessing inputs -----------------------------------------------------------------------

_WORDS = ["data", "loader", "token", "ünïcödé", "✓", "shard", "x", "", "naïve", "a\tb", 'quote"d', "日本語"]


def _text(rng: random.Random, size: str) -> str:
    if size == "empty":
        return ""
    if size == "tiny":
        return rng.choice(["a", " ", "\n", "é"])
    if size == "huge":
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20_000, 120_000)))
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 60)))


def draw_records(rng: random.Random, count: int, huge_rate: float) -> list[dict]:
    records = []
    for _ in range(count):
        r = rng.random()
        size = (
            "huge" if r < huge_rate else "empty" if r < 0.05 + huge_rate else "tiny" if r < 0.12 + huge_rate else "text"
        )
        records.append({"text": _text(rng, size), "title": _text(rng, rng.choice(["tiny", "text", "empty"]))})
    return records


def write_input(path: str, records: list[dict], kind: str, row_group: int = 64) -> str:
    """One input file of ``kind`` plain/gzip/parquet; returns its path (with the right suffix)."""
    if kind == "parquet":
        import pyarrow
        import pyarrow.parquet

        path += ".parquet"
        table = pyarrow.Table.from_pylist(
            records, schema=pyarrow.schema([("text", pyarrow.string()), ("title", pyarrow.string())])
        )
        pyarrow.parquet.write_table(table, path, row_group_size=max(1, row_group))
        return path
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    if kind == "gzip":
        path += ".jsonl.gz"
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path += ".jsonl"
        with open(path, "wb") as f:
            f.write(data)
    return path
