"""``preprocess --workers 2``: our pool (tools/worker_pool.py) against loky's ProcessPoolExecutor.

The workload is the one that deadlocked 5cf6a81's pool (issue 24 §1): two JSON-lines files of
~2.2 MB (2,500 lines of 5-400 words), the second gzipped, with ``--append-eod`` and default 1 MiB
units; ``--scale N`` repeats each file's lines N times. Each executor runs the same
``preprocess()`` (same reading, tokenising, writing); only ``ordered_map`` is replaced, by an
equivalent on ``loky.ProcessPoolExecutor`` (a fresh executor per run, as one CLI run starts one;
results in input order; at most ``workers * depth`` tasks in flight; each wait bounded by
``STATEFULSET_TASK_TIMEOUT``), with loky's own start method (fork+exec: each worker imports
statefulset afresh) and with ``fork`` (as our pool starts workers). ``--workers 1`` (no pool) is
the anchor. Every output is checked byte-equal to the anchor's.

    pip install --target /tmp/lokylib loky   # never into the project's venv: loky is not a dependency
    PYTHONPATH=$PWD:/tmp/lokylib python benchmarks/bench_worker_pool.py --runs 5 --scale 1 --scale 8
"""

from __future__ import annotations

import argparse
import filecmp
import functools
import gzip
import json
import os
import random
import sys
import tempfile
import time
from collections import deque

HERE = os.path.dirname(os.path.abspath(__file__))
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

WORDS = ["lorem", "ipsum", "dolor", "sit", "amet", "déjà", "vu", "naïve", "consectetur", "tokens", "of", "the"]


def corpus(folder: str, scale: int) -> list[str]:
    paths = []
    for name, seed in (("a.jsonl", 0), ("b.jsonl.gz", 1)):
        r = random.Random(seed)
        lines = [json.dumps({"text": " ".join(r.choices(WORDS, k=r.randint(5, 400)))}) + "\n" for _ in range(2500)]
        text = "".join(lines) * scale
        path = os.path.join(folder, name)
        with gzip.open(path, "wt", encoding="utf-8") if name.endswith(".gz") else open(path, "w") as f:
            f.write(text)
        paths.append(path)
    return paths


def loky_ordered_map(function, items, *, workers, initializer, initargs=(), depth=2, describe=repr, start="loky"):
    """``worker_pool.ordered_map``'s contract on loky: input order, bounded in flight, bounded waits."""
    import warnings

    from loky import ProcessPoolExecutor
    from loky.backend.context import get_context

    from statefulset.tools.worker_pool import no_news_limit

    limit = no_news_limit()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # loky warns that fork is unsafe with threads: measured anyway
        context = get_context(start)
    executor = ProcessPoolExecutor(max_workers=workers, initializer=initializer, initargs=initargs, context=context)
    try:
        window: deque = deque()
        source = iter(items)
        for item in source:
            window.append((item, executor.submit(function, item)))
            if len(window) >= workers * depth:
                item, future = window.popleft()
                yield item, future.result(timeout=limit)
        while window:
            item, future = window.popleft()
            yield item, future.result(timeout=limit)
    finally:
        executor.shutdown(wait=True, kill_workers=True)


def one_run(executor: str, paths: list[str], prefix: str) -> float:
    """Seconds of one ``preprocess()`` with ``executor``."""
    from statefulset.tools import preprocess as module
    from statefulset.tools import worker_pool

    if executor.startswith("loky"):
        start = "fork" if "fork" in executor else "loky"
        module.ordered_map = functools.partial(loky_ordered_map, start=start)
    else:
        module.ordered_map = worker_pool.ordered_map
    start = time.perf_counter()
    module.preprocess(paths, prefix, append_eod=True, workers=1 if executor == "one process" else 2,
                      show_progress=False)  # fmt: skip
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--scale", type=int, action="append")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "bench_worker_pool.json"))
    parser.add_argument("--quick", action="store_true", help="smoke run (1 run at scale 1); to benchmarks/out/quick")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.scale = 1, [1]
        args.out = os.path.join(HERE, "out", "quick", "bench_worker_pool.json")
    import loky
    from benchenv import environment, git_state, load_average, spread

    env = {**environment(), "loky": loky.__version__}
    rows = []
    executors = ("one process", "statefulset pool", "loky", "loky, fork start")
    for scale in args.scale or [1]:
        with tempfile.TemporaryDirectory() as folder:
            paths = corpus(folder, scale)
            mib = sum(os.path.getsize(p) for p in paths) / 2**20
            seconds: dict[str, list[float]] = {e: [] for e in executors}
            for run in range(args.runs):  # interleaved, so a busy spell on the machine hits every executor
                for number, executor in enumerate(executors):
                    prefix = os.path.join(folder, f"executor{number}_run{run}")
                    seconds[executor].append(one_run(executor, paths, prefix))
                    same = all(filecmp.cmp(f"{folder}/executor0_run0_text_document{e}", f"{prefix}_text_document{e}",
                                           shallow=False) for e in (".bin", ".idx"))  # fmt: skip
                    assert same, f"{executor}: output differs from one process's"
        for executor in executors:
            rows.append({"scale": scale, "input_mib_on_disk": round(mib, 2), "executor": executor,
                         "seconds": seconds[executor], **spread(seconds[executor])})  # fmt: skip
            print(f"scale {scale} ({mib:.1f} MiB): {executor:17s} median {rows[-1]['median']:.3f} s "
                  f"[{rows[-1]['min']:.3f} .. {rows[-1]['max']:.3f}]")  # fmt: skip
    result = {"environment": env, "git": git_state(), "load_average_after": load_average(), "runs": args.runs,
              "workers": 2, "rows": rows}  # fmt: skip
    from provenance import write_results

    write_results("bench_worker_pool", result, extra=("loky",), path=args.out, quick=args.quick)


if __name__ == "__main__":
    main()
