"""Merging parts into one shard on S3: assembled by the store (server-side copy) against download + upload.

``--executor ray`` with an S3 output merges its part ``.bin`` objects into one. Before, the driver
downloaded every part and uploaded the merged file (the corpus through one machine twice, and its
whole size on local disk); now the store copies the parts into a multipart upload
(:mod:`statefulset.shards.object_assembly`). Both run here on the same parts, on the S3 test
server (moto, in memory on loopback: it has no network between client and store, so the time of
the download path is a lower bound of what a real driver NIC gives; the bytes through the driver
and the local disk needed are what carries over).

    python benchmarks/bench_object_assembly.py [--parts 40] [--part-mib 16] [--runs 3]

Both merges run in turn, ``--runs`` rounds: the time is the median (min, max), the ratio the
median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)


def download_and_upload(fs, target: str, sources: list[tuple[str, int]]) -> dict[str, float]:
    """The earlier path: each part downloaded, appended to a local file, the file uploaded."""
    folder = tempfile.mkdtemp(prefix="bench-assembly-")
    try:
        start = time.perf_counter()
        merged = os.path.join(folder, "merged.bin")
        with open(merged, "wb") as out:
            for path, _ in sources:
                local = os.path.join(folder, "part.bin")
                fs.get_file(path, local)
                with open(local, "rb") as f:
                    shutil.copyfileobj(f, out, 8 << 20)
                os.remove(local)
        fs.put_file(merged, target)
        seconds = time.perf_counter() - start
        total = sum(size for _, size in sources)
        return {"seconds": seconds, "through_driver": 2 * total, "local_disk": total}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", type=int, default=40)
    parser.add_argument("--part-mib", type=float, default=16.0)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "bench_object_assembly.json"))
    parser.add_argument("--runs", type=int, default=3, help="alternating rounds of both merges (median and spread)")
    parser.add_argument("--quick", action="store_true", help="smoke run (4 parts of 5 MiB); to benchmarks/out/quick")
    args = parser.parse_args()
    if args.runs < 3 and not args.quick:
        parser.error("--runs: a figure needs at least 3 rounds")
    if args.quick:
        args.parts, args.part_mib, args.runs = 4, 5.0, 1
        args.out = os.path.join(HERE, "out", "quick", "bench_object_assembly.json")

    import s3fs
    from benchenv import environment, git_state, load_average
    from provenance import summary, write_results
    from s3_servers import moto_server, upload

    from statefulset.shards.object_assembly import assemble

    size = int(args.part_mib * 2**20)
    with moto_server() as server:
        upload(server, "bench", {})
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": server.endpoint, "region_name": "us-east-1"},
                               key=server.key, secret=server.secret)  # fmt: skip
        block = os.urandom(size)
        sources = []
        for i in range(args.parts):
            fs.pipe_file(f"bench/parts/part-{i:06d}.bin", block[i:] + block[:i])  # distinct parts
            sources.append((f"bench/parts/part-{i:06d}.bin", size))
        total = size * args.parts

        def by_store() -> dict[str, float]:
            start = time.perf_counter()
            done = assemble(fs, "bench/store.bin", sources, "bench/scratch")
            return {"seconds": time.perf_counter() - start, "through_driver": done.uploaded, "local_disk": 0}

        variants = {"assembled by the store": by_store,
                    "download + upload": lambda: download_and_upload(fs, "bench/driver.bin", sources)}  # fmt: skip
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        for _ in range(args.runs):  # alternating: a change in the machine's load falls on both
            for name, fn in variants.items():
                runs[name].append(fn())
        same = fs.cat_file("bench/store.bin") == fs.cat_file("bench/driver.bin")
    rows = {name: {**rs[-1], "seconds": summary([r["seconds"] for r in rs])} for name, rs in runs.items()}
    time_ratio = summary([a["seconds"] / b["seconds"] for a, b in zip(*runs.values(), strict=True)])
    result = {"environment": environment(), "git": git_state(), "load": load_average(), "parts": args.parts,
              "part_bytes": size, "identical": same, "rows": rows, "store_over_download": time_ratio}  # fmt: skip
    write_results("bench_object_assembly", result, extra=("moto", "s3fs", "boto3"), path=args.out, quick=args.quick)
    print(f"{args.parts} parts of {args.part_mib:g} MiB ({total / 2**20:,.0f} MiB), moto on loopback; "
          f"outputs identical: {same}\n")  # fmt: skip
    print("| merge | s | MiB through the driver | local disk MiB |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        mib = row["through_driver"] / 2**20, row["local_disk"] / 2**20
        print(f"| {name} | {row['seconds']['median']:.2f} | {mib[0]:,.0f} | {mib[1]:,.0f} |")


if __name__ == "__main__":
    main()
