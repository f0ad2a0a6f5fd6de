"""One JSON line spanning many read blocks: ``--executor ray``'s range reader against Python's readline.

A task of ``--executor ray`` reads its byte range of a JSON-lines file in ``--chunk-bytes`` blocks
(``statefulset.tools.part_tasks.span_chunks``); a line longer than a block spans many of them. The
anchor is the plain ``readline`` loop over the same file (one buffered pass, what a one-process
reader does). Run it with ``PYTHONPATH`` at another checkout to time that checkout's reader.

    python benchmarks/bench_long_lines.py [--line-mib 128]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--line-mib", type=int, default=128)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "bench_long_lines.json"))
    parser.add_argument("--quick", action="store_true", help="smoke run (an 8 MiB line); to benchmarks/out/quick")
    args = parser.parse_args()
    if args.quick:
        args.line_mib = 8
        args.out = os.path.join(HERE, "out", "quick", "bench_long_lines.json")

    from benchenv import environment, git_state

    import statefulset
    from statefulset.tools.part_tasks import span_chunks

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "long.jsonl")
        with open(path, "wb") as f:
            f.write(b'{"text": "' + b"a" * (args.line_mib << 20) + b'"}\n{"text": "b"}\n')
        size = os.path.getsize(path)
        start = time.perf_counter()
        with open(path, "rb") as f:
            lines = sum(1 for _ in iter(f.readline, b""))
        rows = {"readline (anchor)": {"seconds": time.perf_counter() - start, "lines": lines}}
        for block in (1 << 20, 64 << 10):
            start = time.perf_counter()
            lines = sum(len(piece.lines) for piece in span_chunks(path, 0, size, block))
            rows[f"span_chunks, {block >> 10} KiB blocks"] = {"seconds": time.perf_counter() - start, "lines": lines}
    where = os.path.dirname(os.path.dirname(os.path.abspath(statefulset.__file__)))
    result = {"environment": environment(), "git": git_state(), "statefulset_from": where, "rows": rows}
    if where == os.path.dirname(HERE):
        from provenance import write_results

        write_results("bench_long_lines", result, path=args.out, quick=args.quick)
    print(f"one {args.line_mib} MiB JSON line, statefulset from {where}\n")
    print("| reader | s | vs readline |")
    print("|---|---|---|")
    anchor = rows["readline (anchor)"]["seconds"]
    for name, row in rows.items():
        print(f"| {name} | {row['seconds']:.2f} | {row['seconds'] / anchor:.1f}x |")


if __name__ == "__main__":
    main()
