"""Write a Megatron-compatible shard, merge two, and read them back. Runs with no arguments.

python examples/shards_quickstart.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy

from statefulset import IndexedDataset, IndexedDatasetWriter, merge_datasets


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="statefulset-example-") as temporary:
        folder = Path(temporary)
        rng = numpy.random.default_rng(0)
        for part in (1, 2):
            # One document per add_document call; files appear only when the block ends.
            with IndexedDatasetWriter(folder / f"part_{part}", dtype=numpy.uint16) as writer:
                for _ in range(100):
                    writer.add_document(rng.integers(0, 50_000, size=int(rng.integers(10, 200))))
                # A document made of two sequences (e.g. sentences).
                writer.add_document([1, 2, 3, 4, 5], lengths=[2, 3])
        merged = merge_datasets([folder / "part_1", folder / "part_2"], folder / "corpus")
        print(merged)
        print("sequence 100:", merged[100].tolist(), "| document 100:", [s.tolist() for s in merged.document(100)])
        reopened = IndexedDataset(folder / "corpus")
        assert len(reopened) == 2 * 102 and reopened.num_documents == 2 * 101
        print(f"files in {folder}")


if __name__ == "__main__":
    main()
