"""datatrove's ``MegatronDocumentTokenizer`` under its ``LocalPipelineExecutor``: run in datatrove's own venv.

    DATATROVE_PYTHON=/path/to/venv/bin/python  (pip install datatrove tokenizers)
    $DATATROVE_PYTHON benchmarks/anchor_datatrove_tokenize.py IN_FOLDER TOKENIZER_JSON EOS OUT_FOLDER TASKS WORKERS

Reads every ``*.jsonl`` in IN_FOLDER (one task per file when TASKS equals the file count), writes one
``.bin``/``.idx`` per task (datatrove does not merge them), and prints one JSON line: seconds from
before the executor starts to its end, documents and tokens read back from the ``.idx`` headers.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import numpy


def idx_counts(path: str) -> tuple[int, int]:
    """(documents, tokens) of a Megatron ``.idx``: header, then int32 lengths."""
    with open(path, "rb") as f:
        header = f.read(34)
        sequences = int.from_bytes(header[18:26], "little")
        documents = int.from_bytes(header[26:34], "little") - 1
        lengths = numpy.frombuffer(f.read(4 * sequences), numpy.int32)
    return documents, int(lengths.sum())


def main() -> None:
    folder, tokenizer, eos, out, tasks, workers = sys.argv[1:7]
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens.megatron_tokenizer import MegatronDocumentTokenizer

    executor = LocalPipelineExecutor(
        pipeline=[
            JsonlReader(folder, glob_pattern="*.jsonl", text_key="text"),
            MegatronDocumentTokenizer(out, tokenizer_name_or_path=tokenizer, eos_token=eos),
        ],
        tasks=int(tasks),
        workers=int(workers),
        logging_dir=os.path.join(out, "logs"),
    )
    began = time.perf_counter()
    executor.run()
    seconds = time.perf_counter() - began
    documents = tokens = 0
    for path in glob.glob(os.path.join(out, "**", "*.idx"), recursive=True):
        d, t = idx_counts(path)
        documents, tokens = documents + d, tokens + t
    print(json.dumps({"seconds": seconds, "documents": documents, "tokens": tokens}))


if __name__ == "__main__":
    main()
