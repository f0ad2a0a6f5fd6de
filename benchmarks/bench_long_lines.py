"""One JSON line spanning many read blocks: ``--executor ray``'s range reader against Python's readline.

A task of ``--executor ray`` reads its byte range of a JSON-lines file in ``--chunk-bytes`` blocks
(``statefulset.tools.part_tasks.span_chunks``); a line longer than a block spans many of them. The
anchor is the plain ``readline`` loop over the same file (one buffered pass, what a one-process
reader does). Run it with ``PYTHONPATH`` at another checkout to time that checkout's reader.

    python benchmarks/bench_long_lines.py [--line-mib 128] [--runs 3]

The readers run in turn, ``--runs`` rounds: each time is the median (min, max), each ratio to
``readline`` the median of the per-round ratios.
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
    parser.add_argument("--runs", type=int, default=3, help="alternating rounds of every reader (median and spread)")
    parser.add_argument("--quick", action="store_true", help="smoke run (an 8 MiB line); to benchmarks/out/quick")
    args = parser.parse_args()
    if args.runs < 3:
        parser.error("--runs: a figure needs at least 3 rounds")
    if args.quick:
        args.line_mib = 8
        args.out = os.path.join(HERE, "out", "quick", "bench_long_lines.json")

    from benchenv import environment, git_state
    from provenance import summary

    import statefulset
    from statefulset.tools.part_tasks import span_chunks

    def readline(path: str, size: int) -> int:
        with open(path, "rb") as f:
            return sum(1 for _ in iter(f.readline, b""))

    def spans(block: int):
        return lambda path, size: sum(len(piece.lines) for piece in span_chunks(path, 0, size, block))

    readers = {
        "readline (anchor)": readline,
        **{f"span_chunks, {b >> 10} KiB blocks": spans(b) for b in (1 << 20, 64 << 10)},
    }
    runs: dict[str, list[float]] = {name: [] for name in readers}
    lines: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "long.jsonl")
        with open(path, "wb") as f:
            f.write(b'{"text": "' + b"a" * (args.line_mib << 20) + b'"}\n{"text": "b"}\n')
        size = os.path.getsize(path)
        for _ in range(args.runs):  # alternating: a change in the machine's load falls on every reader
            for name, read in readers.items():
                start = time.perf_counter()
                lines[name] = read(path, size)
                runs[name].append(time.perf_counter() - start)
    anchor = runs["readline (anchor)"]
    rows = {name: {"seconds": summary(r), "lines": lines[name],
                   "over_readline": summary([a / b for a, b in zip(r, anchor, strict=True)])}
            for name, r in runs.items()}  # fmt: skip
    where = os.path.dirname(os.path.dirname(os.path.abspath(statefulset.__file__)))
    result = {"environment": environment(), "git": git_state(), "statefulset_from": where, "line_mib": args.line_mib,
              "rows": rows}  # fmt: skip
    if where == os.path.dirname(HERE):
        from provenance import write_results

        write_results("bench_long_lines", result, path=args.out, quick=args.quick)
    print(f"one {args.line_mib} MiB JSON line, statefulset from {where}\n")
    print("| reader | s | vs readline |")
    print("|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['seconds']['median']:.2f} | {row['over_readline']['median']:.1f}x |")


if __name__ == "__main__":
    main()
