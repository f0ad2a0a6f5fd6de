"""OLMo-core's best-fit packing on given document lengths: the anchor of bench_packing.py.

Runs under a separate environment holding ``ai2-olmo-core`` (never the project's): it builds the
``(start, end)`` document indices OLMo-core's ``NumpyPackedFSLDataset`` feeds to
``olmo_core.data.utils.InstancePacker.pack_documents`` (after its long-document strategy,
``truncate`` by default: tokens past ``max_sequence_length`` are dropped; ``fragment`` cuts them
into pieces), packs them with best-fit decreasing over the whole source, and reports instances,
padding and dropped tokens as JSON.

    python anchor_olmo_packing.py LENGTHS.npy CAPACITY STRATEGY OUT.json
"""

from __future__ import annotations

import json
import sys
import time
from importlib.metadata import version

import numpy
from olmo_core.data.utils import InstancePacker


def main() -> None:
    lengths_path, capacity, strategy, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    lengths = numpy.load(lengths_path).astype(numpy.int64)
    ends = numpy.cumsum(lengths)
    starts = ends - lengths
    pieces, dropped, fitting = [], 0, []
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        if end == start:
            continue
        if end - start <= capacity:
            fitting.append(len(pieces))
            pieces.append((start, end))
        elif strategy == "truncate":  # iter_document_indices_with_max_sequence_length's two strategies
            pieces.append((start, start + capacity))
            dropped += end - start - capacity
        else:
            pieces += [(s, min(end, s + capacity)) for s in range(start, end, capacity)]
    indices = numpy.array(pieces, dtype=numpy.uint64).reshape(-1, 2)
    began = time.perf_counter()
    instances, _, total_tokens = InstancePacker(capacity).pack_documents(indices)
    seconds = time.perf_counter() - began
    slots = len(instances) * capacity
    # Read from the packer's output: a fitting document is cut when its piece is not in exactly one instance.
    placed = numpy.bincount(numpy.fromiter((i for inst in instances for i in inst), dtype=numpy.int64),
                            minlength=len(pieces))  # fmt: skip
    fitting_cut = int((placed[numpy.asarray(fitting, dtype=numpy.int64)] != 1).sum())
    result = {
        "olmo_core_version": version("ai2-olmo-core"),
        "routine": "olmo_core.data.utils.InstancePacker.pack_documents",
        "strategy": strategy,
        "instances": len(instances),
        "token_slots": slots,
        "tokens_kept": int(total_tokens),
        "padding_fraction": (slots - int(total_tokens)) / slots,
        "tokens_dropped": dropped,
        "fitting_documents": len(fitting),
        "fitting_documents_cut": fitting_cut,
        "documents_cut": int(((lengths > capacity) & (strategy == "fragment")).sum()),
        "seconds": seconds,
    }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
