"""Cold start at scale: a 100B-token corpus opened by fresh processes, against megatron-core.

The corpus is synthetic and sparse: a real ``.idx`` for 50,000,000 documents of geometric
lengths (mean 2,000 tokens; 100.0B tokens; ~1 GB of index) and a ``.bin`` of the matching size
made with ``truncate`` (no blocks on disk: every figure here is about the index, which is what
start-up reads). One sample is read at the end of each open (zeros, from the sparse file).

Each row runs in a fresh process with a fresh home (``XDG_CACHE_HOME``), sharing the spec's
``path_to_cache``. That is a new node's view of the caches, but not of the machine: the process
runs on the same host, with the same local disk, and by default with a warm page cache (the
script has just written or read the index). The ``cold page cache`` rows evict the corpus and
cache files first (``posix_fadvise(POSIX_FADV_DONTNEED)`` on each, after ``fsync``), which is
closer to a new node reading a local disk; a new node on a network filesystem is not measured.

- ``ours, unprepared``: the first open on a node (full check, digest, indices built or found);
- ``ours, prepare``: ``statefulset prepare`` (native: check and digest; megatron: plus indices);
- ``ours, after prepare``: a fresh process's open, warm and cold page cache: the target is
  < 100 ms and < 64 MB of RSS growth;
- ``megatron-core``: ``BlendedMegatronDatasetBuilder(GPTDataset, ...)`` with the same
  ``path_to_cache``: first build, then a cached open in a fresh process;
- ``six at once``: six unprepared processes opening together: CPU seconds against one.

Run: ``python benchmarks/bench_scale.py [--docs 50000000] [--out DIR]`` (about 5 minutes, 2 GB
of disk for the index and caches). ``--quick`` (2,000,000 documents, results to
``benchmarks/out/quick/``) is a smoke version.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchenv import environment, git_state  # noqa: E402
from provenance import write_results  # noqa: E402

SEQ = 2048
MEAN = 2000


def write_corpus(prefix: str, docs: int) -> int:
    """A real index for ``docs`` documents and a sparse .bin; returns the token count."""
    from statefulset.shards import idx_format

    if os.path.exists(prefix + ".idx"):
        return os.path.getsize(prefix + ".bin") // 2
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    rng = numpy.random.default_rng(7)
    lengths = rng.geometric(1.0 / MEAN, size=docs).astype(numpy.int32)
    pointers = numpy.zeros(docs, dtype=numpy.int64)
    numpy.cumsum(lengths[:-1].astype(numpy.int64) * 2, out=pointers[1:])
    tokens = int(lengths.sum(dtype=numpy.int64))
    header = idx_format._HEADER.pack(idx_format.MAGIC, 1, idx_format.dtype_code(numpy.uint16), docs, docs + 1)
    with open(prefix + ".idx.tmp", "wb") as f:
        f.write(header)
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(numpy.arange(docs + 1, dtype=numpy.int64).tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.truncate(tokens * 2)
    os.replace(prefix + ".idx.tmp", prefix + ".idx")
    past = time.time() - 3600  # settled, as a corpus written long before the run
    for ext in (".idx", ".bin"):
        os.utime(prefix + ext, (past, past))
    return tokens


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def child(job: dict) -> dict:
    """One measurement in this (fresh) process."""
    import statefulset  # noqa: F401  imports are not part of the open

    if job["kind"] == "megatron-core":
        from megatron.core.datasets import gpt_dataset
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
    rss0, cpu0, t0 = _rss_mb(), time.process_time(), time.perf_counter()
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if job["kind"] == "ours":
        from statefulset.streams.opening import open_stream

        stream = open_stream(job["spec"])
        sample = stream.gather(numpy.array([len(stream) // 2 if not stream.unbounded else 12345]))
    elif job["kind"] == "prepare":
        from statefulset.tools.prepare import prepare

        report = prepare(job["spec"], show_progress=False)
        sample = numpy.zeros(1)
        print(report.text(), file=sys.stderr)
    else:
        config = gpt_dataset.GPTDatasetConfig(
            random_seed=1234, sequence_length=SEQ, blend=([job["prefix"]], None), split="100,0,0",
            tokenizer=NullTokenizer(50257), reset_position_ids=False, reset_attention_mask=False,
            eod_mask_loss=False, path_to_cache=job["cache"],
        )  # fmt: skip
        dataset = BlendedMegatronDatasetBuilder(gpt_dataset.GPTDataset, [None, None, None], lambda: True, config)
        train = dataset.build()[0]
        sample = train[len(train) // 2]["tokens"].numpy()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "seconds": seconds,
        "cpu_s": cpu,
        "rss_growth_mb": _rss_mb() - rss0,
        "peak_growth_mb": peak - peak0,
        "sample_sum": float(numpy.asarray(sample).sum()),
    }


def evict(*folders_or_files: str) -> int:
    """Drop these files (folders: every file under them) from the page cache; returns the files evicted.

    ``fsync`` first, since only clean pages can be dropped; ``POSIX_FADV_DONTNEED`` then drops them
    for every process on the host, without touching other files (unlike ``drop_caches``).
    """
    paths = []
    for top in folders_or_files:
        if os.path.isdir(top):
            paths += [os.path.join(d, f) for d, _, files in os.walk(top) for f in files]
        elif os.path.exists(top):
            paths.append(top)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(paths)


def _run(job: dict, home: str, count: int = 1) -> list[dict]:
    env = {**os.environ, "XDG_CACHE_HOME": home}
    start = [subprocess.Popen([sys.executable, __file__, "--child", json.dumps(job)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(count)]  # fmt: skip
    out = []
    for p in start:
        stdout, stderr = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"{job} failed:\n{stderr[-3000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=50_000_000)
    parser.add_argument("--out", default=os.path.join(HERE, "out", "scale"))
    parser.add_argument("--quick", action="store_true", help="2,000,000 documents (smoke run)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.docs = min(args.docs, 2_000_000)
        args.out = os.path.join(HERE, "out", "quick", "scale")
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    prefix = os.path.join(args.out, "corpus", "c")
    tokens = write_corpus(prefix, args.docs)
    print(f"corpus: {args.docs:,} documents, {tokens:,} tokens, .idx {os.path.getsize(prefix + '.idx'):,} B")
    rows: dict[str, dict] = {}
    fresh = 0

    def home() -> str:
        nonlocal fresh
        fresh += 1
        return os.path.join(args.out, "homes", str(fresh))

    for packing in ("native", "megatron"):
        cache = os.path.join(args.out, f"cache-{packing}")
        shutil.rmtree(cache, ignore_errors=True)
        spec_path = os.path.join(args.out, f"{packing}.yaml")
        with open(spec_path, "w") as f:
            json.dump({"data_path": prefix, "seq_length": SEQ, "split": "100,0,0", "packing": packing,
                       "path_to_cache": cache}, f)  # fmt: skip
        job = {"kind": "ours", "spec": spec_path}
        rows[f"ours {packing}: unprepared open, fresh process"] = _run(job, home())[0]
        shutil.rmtree(cache, ignore_errors=True)
        rows[f"ours {packing}: prepare"] = _run({"kind": "prepare", "spec": spec_path}, home())[0]
        rows[f"ours {packing}: open after prepare, fresh process, warm page cache"] = _run(job, home())[0]
        evict(prefix + ".idx", prefix + ".bin", cache)
        rows[f"ours {packing}: open after prepare, fresh process, cold page cache"] = _run(job, home())[0]
        shutil.rmtree(cache, ignore_errors=True)
        one = _run(job, home())[0]
        shutil.rmtree(cache, ignore_errors=True)
        six = _run(job, home(), count=6)
        rows[f"ours {packing}: six unprepared at once (per process)"] = {
            "seconds": max(r["seconds"] for r in six),
            "cpu_s": sum(r["cpu_s"] for r in six) / 6,
            "rss_growth_mb": max(r["rss_growth_mb"] for r in six),
            "peak_growth_mb": max(r["peak_growth_mb"] for r in six),
            "cpu_total_over_one": sum(r["cpu_s"] for r in six) / one["cpu_s"],
        }
    mcache = os.path.join(args.out, "cache-megatron-core")
    shutil.rmtree(mcache, ignore_errors=True)
    job = {"kind": "megatron-core", "prefix": prefix, "cache": mcache}
    rows["megatron-core: first build"] = _run(job, home())[0]
    rows["megatron-core: cached open, fresh process, warm page cache"] = _run(job, home())[0]
    evict(prefix + ".idx", mcache)
    rows["megatron-core: cached open, fresh process, cold page cache"] = _run(job, home())[0]
    report = {"environment": environment(), "git": git_state(), "docs": args.docs, "tokens": tokens, "rows": rows}
    write_results("bench_scale", report, extra=("megatron-core",), quick=args.quick)
    print("| Case | wall, s | CPU, s | RSS growth, MB | peak RSS growth, MB |\n|---|---|---|---|---|")
    for name, r in rows.items():
        extra = f" (six: {r['cpu_total_over_one']:.2f}× the CPU of one)" if "cpu_total_over_one" in r else ""
        print(
            f"| {name}{extra} | {r['seconds']:.3f} | {r['cpu_s']:.3f} | {r['rss_growth_mb']:.0f} | "
            f"{r['peak_growth_mb']:.0f} |"
        )


if __name__ == "__main__":
    main()
