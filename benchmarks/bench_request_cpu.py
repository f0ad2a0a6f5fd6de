"""CPU per ranged GET: the S3 clients (s3fs, obstore) and the loopback server, measured apart.

The object-storage design rests on these figures (docs/object-storage.md): how much CPU a client
spends per ranged GET decides how many requests one loader core can issue, and on a loopback
server the server's own CPU per request shares the same cores.

One object of 64 MiB on a loopback S3 server (s3rver when it is installed, else moto's server;
the results name which). Each client runs in a fresh process and issues ``--requests`` ranged
GETs of one sample (2,049 uint16 tokens, 4,098 bytes) at random offsets, one at a time, so that
CPU time is per request and not hidden by concurrency. A second section keeps ``INFLIGHT`` GETs in
flight from one asyncio loop, as a loader does (issue 26): obstore's ``get_range_async`` (one future
per GET: the store-capacity loop of ``bench_object_storage.py``), ``get_async`` with ``If-Match``
then ``bytes_async`` (two futures per GET: statefulset's reader until issue 26), and statefulset's
own reader (``RemoteFile.read_ranges`` from ``READ_AHEAD`` threads, batches of ``BATCH`` ranges: the
limit, the counters, the retries and the version pin included). Measured per request:

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
# In flight at once (statefulset's default request limit per process), and statefulset's read-ahead
# threads and ranges per batch (packing: megatron's ~4.5 requests per sample x B=8).
INFLIGHT, READ_AHEAD, BATCH = 32, 8, 36
CONCURRENT = {
    "obstore get_range_async": "range",
    "obstore get_async(If-Match) + bytes_async": "two_futures",
    "statefulset RemoteFile.read_ranges": "ours",
}


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


def _concurrent(job: dict, starts: list[int]) -> dict:
    """``INFLIGHT`` GETs in flight: obstore's calls from one asyncio loop, or statefulset's reader."""
    if job["client"] == "ours":
        return _ours(job, starts)
    import asyncio

    import obstore
    from obstore.store import S3Store

    store = S3Store(BUCKET, endpoint=job["endpoint"], access_key_id=job["key"], secret_access_key=job["secret"],
                    region="us-east-1", client_options={"allow_http": True})  # fmt: skip
    etag = obstore.head(store, KEY)["e_tag"]

    async def get(start: int) -> bytes:
        if job["client"] == "range":
            return bytes(await obstore.get_range_async(store, KEY, start=start, end=start + SAMPLE_BYTES))
        answer = await obstore.get_async(store, KEY, options={"range": (start, start + SAMPLE_BYTES), "if_match": etag})
        return bytes(await answer.bytes_async())

    async def issue(todo: list[int]) -> None:
        queue = iter(todo)

        async def worker() -> None:
            for start in queue:
                await get(start)

        await asyncio.gather(*(worker() for _ in range(INFLIGHT)))

    asyncio.run(issue(starts[:100]))  # connections open
    cpu0, wall0 = _cpu_s(), time.perf_counter()
    asyncio.run(issue(starts))
    return {"client_cpu_s": _cpu_s() - cpu0, "wall_s": time.perf_counter() - wall0, "requests": len(starts)}


def _ours(job: dict, starts: list[int]) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from statefulset.shards.remote import RemoteFile

    os.environ["STATEFULSET_S3_CLIENT"] = "obstore"
    options = {"endpoint_url": job["endpoint"], "key": job["key"], "secret": job["secret"]}
    remote = RemoteFile(f"s3://{BUCKET}/{KEY}", options)
    batches = [sorted(starts[i : i + BATCH]) for i in range(0, len(starts), BATCH)]
    with ThreadPoolExecutor(READ_AHEAD) as pool:
        list(pool.map(lambda b: remote.read_ranges(b, [SAMPLE_BYTES] * len(b)), batches[:4]))  # connections open
        remote.requests = 0
        cpu0, wall0 = _cpu_s(), time.perf_counter()
        list(pool.map(lambda b: remote.read_ranges(b, [SAMPLE_BYTES] * len(b)), batches))
        return {"client_cpu_s": _cpu_s() - cpu0, "wall_s": time.perf_counter() - wall0, "requests": remote.requests}


def child(job: dict) -> dict:
    """Issue the GETs with one client; CPU and wall time of the GETs alone (set-up excluded)."""
    import numpy

    rng = numpy.random.default_rng(job["seed"])
    starts = (rng.integers(0, OBJECT_BYTES - SAMPLE_BYTES, job["requests"]) // 2 * 2).tolist()
    if job.get("concurrent"):
        return _concurrent(job, starts)
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


def measure(server, client: str, requests: int, seed: int, concurrent: bool = False) -> dict:
    job = {"client": client, "requests": requests, "seed": seed, "endpoint": server.endpoint, "key": server.key,
           "secret": server.secret, "concurrent": concurrent}  # fmt: skip
    before = _tree_cpu_s(server.proc.pid)
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], capture_output=True, text=True,
                          timeout=1800, check=False)  # fmt: skip
    server_cpu = _tree_cpu_s(server.proc.pid) - before
    if done.returncode != 0:
        raise RuntimeError(f"{client}: the client process failed:\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # The server's CPU over the child's whole life includes its warm-up GETs; count them in.
    sent = got.get("requests", requests)
    warm = (4 * BATCH if client == "ours" else 100) if concurrent else 10
    return {
        "client_cpu_ms": 1e3 * got["client_cpu_s"] / sent,
        "server_cpu_ms": 1e3 * server_cpu / (sent + warm),
        "wall_ms": 1e3 * got["wall_s"] / sent,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3200, help="ranged GETs per client process")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (median and spread)")
    parser.add_argument("--quick", action="store_true", help="50 requests per process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        os._exit(0)  # obstore's runtime can abort at interpreter exit (SIGABRT) after its async calls
    from s3_servers import moto_server, s3rver_command, s3rver_server, upload

    if args.quick:
        args.requests = 50
    rounds = max(3, args.rounds)
    runs: dict[str, list[dict]] = {c: [] for c in CLIENTS}
    together: dict[str, list[dict]] = {name: [] for name in CONCURRENT}
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
                for name, client in CONCURRENT.items():
                    together[name].append(measure(server, client, args.requests, seed=r, concurrent=True))
                    print(name, json.dumps(together[name][-1]), flush=True)

    def table(measured: dict[str, list[dict]]) -> dict:
        return {c: {k: summary([run[k] for run in rs]) for k in rs[0]} for c, rs in measured.items()}

    result = {"server": "s3rver" if use_s3rver else "moto", "requests_per_process": args.requests,
              "sample_bytes": SAMPLE_BYTES, "rounds": rounds, "per_request": table(runs), "inflight": INFLIGHT,
              "read_ahead": READ_AHEAD, "batch": BATCH, "concurrent": table(together)}  # fmt: skip
    write_results("bench_request_cpu", result, extra=("s3fs", "obstore", "boto3", "moto"), quick=args.quick)
    print(markdown(result))


def markdown(result: dict) -> str:
    out = _table(f"client (server: {result['server']})", result["per_request"])
    if "concurrent" in result:  # runs from before issue 26 have one GET at a time only
        out += (f"\n\n{result['inflight']} GETs in flight from one client process (statefulset's reader: "
                f"{result['read_ahead']} read-ahead threads, batches of {result['batch']} ranges):\n\n")  # fmt: skip
        out += _table(f"client, {result['inflight']} in flight", result["concurrent"])
    return out


def _table(head: str, rows: dict) -> str:
    lines = [f"| {head} | client CPU per GET, ms | server CPU per GET, ms | wall per GET, ms |", "|---|---|---|---|"]
    for client, r in rows.items():
        cells = [f"{r[k]['median']:.2f} ({r[k]['min']:.2f}–{r[k]['max']:.2f})" for k in ("client_cpu_ms",
                 "server_cpu_ms", "wall_ms")]  # fmt: skip
        lines.append(f"| {client} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
