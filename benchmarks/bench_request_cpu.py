"""CPU per ranged GET: the S3 clients (s3fs, obstore) and the loopback server, measured apart.

The object-storage design rests on these figures (docs/object-storage.md): how much CPU a client
spends per ranged GET decides how many requests one loader core can issue, and on a loopback
server the server's own CPU per request shares the same cores.

One object of 64 MiB on a loopback S3 server (s3rver when it is installed, else moto's server;
the results name which). Each client runs in a fresh process and issues ``--requests`` ranged
GETs of one sample (2,049 uint16 tokens, 4,098 bytes) at random offsets, one at a time, so that
CPU time is per request and not hidden by concurrency. Measured per request:

- client CPU: user + system time of the client process (all its threads) over the GETs;
- server CPU: user + system time of the server process and its children over the same span;
- wall time.

The clients alternate (s3fs, obstore, s3fs, ...) for ``--rounds`` rounds (at least 3): median
and spread. Run::

    S3RVER_BIN=/path/to/node_modules/.bin/s3rver python benchmarks/bench_request_cpu.py
    python benchmarks/bench_request_cpu.py --quick   # 50 requests, results to benchmarks/out/quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from provenance import summary, write_results  # noqa: E402

BUCKET, KEY = "bench", "object.bin"
OBJECT_BYTES = 64 << 20
SAMPLE_BYTES = 2049 * 2
CLIENTS = ("s3fs", "obstore")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _tree_cpu_s(pid: int) -> float:
    """User + system seconds of ``pid`` and its live descendants (the server may be a wrapper)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return total


def child(job: dict) -> dict:
    """Issue the GETs with one client; CPU and wall time of the GETs alone (set-up excluded)."""
    import numpy

    rng = numpy.random.default_rng(job["seed"])
    starts = (rng.integers(0, OBJECT_BYTES - SAMPLE_BYTES, job["requests"]) // 2 * 2).tolist()
    if job["client"] == "s3fs":
        import s3fs

        fs = s3fs.S3FileSystem(key=job["key"], secret=job["secret"], client_kwargs={"endpoint_url": job["endpoint"]})
        path = f"{BUCKET}/{KEY}"

        def get(start: int) -> bytes:
            return fs.cat_file(path, start=start, end=start + SAMPLE_BYTES)
    else:
        import obstore
        from obstore.store import S3Store

        store = S3Store(BUCKET, endpoint=job["endpoint"], access_key_id=job["key"], secret_access_key=job["secret"],
                        region="us-east-1", client_options={"allow_http": True})  # fmt: skip

        def get(start: int) -> bytes:
            return bytes(obstore.get_range(store, KEY, start=start, length=SAMPLE_BYTES))

    for start in starts[:10]:  # connections open, imports done
        assert len(get(start)) == SAMPLE_BYTES
    cpu0, wall0 = _cpu_s(), time.perf_counter()
    for start in starts:
        get(start)
    return {"client_cpu_s": _cpu_s() - cpu0, "wall_s": time.perf_counter() - wall0}


def measure(server, client: str, requests: int, seed: int) -> dict:
    job = {"client": client, "requests": requests, "seed": seed, "endpoint": server.endpoint, "key": server.key,
           "secret": server.secret}  # fmt: skip
    before = _tree_cpu_s(server.proc.pid)
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], capture_output=True, text=True,
                          timeout=1800, check=False)  # fmt: skip
    server_cpu = _tree_cpu_s(server.proc.pid) - before
    if done.returncode != 0:
        raise RuntimeError(f"{client}: the client process failed:\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # The server's CPU over the child's whole life includes its 10 warm-up GETs; count them in.
    return {
        "client_cpu_ms": 1e3 * got["client_cpu_s"] / requests,
        "server_cpu_ms": 1e3 * server_cpu / (requests + 10),
        "wall_ms": 1e3 * got["wall_s"] / requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3200, help="ranged GETs per client process")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (median and spread)")
    parser.add_argument("--quick", action="store_true", help="50 requests per process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from s3_servers import moto_server, s3rver_command, s3rver_server, upload

    if args.quick:
        args.requests = 50
    rounds = max(3, args.rounds)
    runs: dict[str, list[dict]] = {c: [] for c in CLIENTS}
    with tempfile.TemporaryDirectory() as scratch:
        data = os.path.join(scratch, "object.bin")
        with open(data, "wb") as f:
            f.write(os.urandom(OBJECT_BYTES))
        use_s3rver = s3rver_command() is not None
        serving = s3rver_server(os.path.join(scratch, "s3")) if use_s3rver else moto_server()
        with serving as server:
            upload(server, BUCKET, {KEY: data})
            for r in range(rounds):
                for client in CLIENTS:
                    runs[client].append(measure(server, client, args.requests, seed=r))
                    print(client, json.dumps(runs[client][-1]), flush=True)
    table = {c: {k: summary([run[k] for run in rs]) for k in rs[0]} for c, rs in runs.items()}
    result = {"server": "s3rver" if use_s3rver else "moto", "requests_per_process": args.requests,
              "sample_bytes": SAMPLE_BYTES, "rounds": rounds, "per_request": table}  # fmt: skip
    write_results("bench_request_cpu", result, extra=("s3fs", "obstore", "boto3", "moto"), quick=args.quick)
    print(markdown(result))


def markdown(result: dict) -> str:
    rows = [
        f"| client (server: {result['server']}) | client CPU per GET, ms | server CPU per GET, ms | wall per GET, ms |",
        "|---|---|---|---|",
    ]
    for client, r in result["per_request"].items():
        cells = [f"{r[k]['median']:.2f} ({r[k]['min']:.2f}–{r[k]['max']:.2f})" for k in ("client_cpu_ms",
                 "server_cpu_ms", "wall_ms")]  # fmt: skip
        rows.append(f"| {client} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
