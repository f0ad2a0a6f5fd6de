"""Preprocessing cases: mixed plain/gzip/Parquet inputs with tiny and huge lines, 1/2/4 workers,
local or S3 (through a fault proxy), signals to workers and to the main process. The output must
be the bytes ``--workers 1`` writes for the same inputs, or the CLI must end with its named error."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import time

from campaign import procs
from campaign.corpus import draw_records, write_input
from campaign.outcome import Mismatch, Orphans

PP_FAULTS = {
    "none": 30,
    "kill_worker": 10,
    "stop_worker_cont": 6,
    "stop_worker": 6,
    "kill_main": 10,
    "stop_main_cont": 5,
    "s3_503": 6,
    "s3_drop": 5,
    "s3_stall": 3,
}


class Hung(Exception):
    """The preprocess run outlived its bound."""


def draw_preprocess(rng: random.Random, long_form: bool) -> dict:
    storage = rng.choice(("local", "local", "s3", "s3-out", "s3-proxy"))
    if long_form and storage != "local" and rng.random() < 0.5:
        storage = "local"  # S3 cases cost ~10 CPU seconds (moto, aiobotocore): fewer of them in the long form
    faults = [f for f, w in PP_FAULTS.items() for _ in range(w) if not f.startswith("s3_") or storage == "s3-proxy"]
    files = []
    for _ in range(rng.randint(1, 12 if long_form else 6)):
        files.append(
            {
                "kind": rng.choice(("plain", "gzip", "parquet")),
                "records": rng.randint(0, 150),
                "huge_rate": rng.choice((0.0, 0.0, 0.0, 0.01)),
                "row_group": rng.choice((1, 7, 64)),
            }
        )
    if rng.random() < (0.08 if long_form else 0.03):  # the size of issue 24's deadlock: ~2 MB of lines, gzip
        files.append({"kind": "gzip", "records": 2500, "huge_rate": 0.0, "row_group": 64, "big": True})
    return {
        "kind": "preprocess",
        "files": files,
        "keys": rng.choice((["text"], ["text"], ["text", "title"])),
        "append_eod": rng.random() < 0.7,
        "workers": rng.choice((1, 2, 2, 4)),
        "chunk_bytes": rng.choice((4096, 65536, 1 << 20)),
        "storage": storage,
        "fault": rng.choice(faults),
        "fault_delay": rng.uniform(0.0, 0.6),
    }


def _inputs(case: dict, folder: str) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(case["seed"])
    paths = []
    for i, f in enumerate(case["files"]):
        if f.get("big"):
            words = ("word", "ünï", "shard", "tokens", "x")
            records = [
                {"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 400))), "title": "t"}
                for _ in range(f["records"])
            ]
        else:
            records = draw_records(rng, f["records"], f["huge_rate"])
        paths.append(write_input(os.path.join(folder, f"in_{i:02d}"), records, f["kind"], f["row_group"]))
    return paths


def _cli(argv: list[str], env: dict[str, str], err: str) -> None:
    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.dup2(fd, 1)
    os.environ.update(env)
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks for stacks before it calls a hang
    from statefulset.tools.cli import main

    try:
        rc = main(argv)
    except BaseException:
        import traceback

        traceback.print_exc()
        rc = 1
    os._exit(rc)


def run_cli(argv: list[str], env: dict[str, str], err: str, case: dict | None, bound: float) -> tuple[int, list[int]]:
    """The CLI in a forked process with the case's fault; its exit code and the workers it had."""
    proc = multiprocessing.get_context("fork").Process(target=_cli, args=(argv, env, err))
    proc.start()
    fault = case["fault"] if case else "none"
    seen: set[int] = set()
    first_seen, done = None, fault in ("none",) or fault.startswith("s3_")
    deadline = time.monotonic() + bound
    while proc.is_alive():
        workers = [p for p in procs.descendants(proc.pid) if "resource_tracker" not in procs.cmdline(p)]
        seen.update(workers)
        now = time.monotonic()
        if not done and (workers or fault.endswith("_main")) and first_seen is None:
            first_seen = now
        if not done and first_seen is not None and now - first_seen >= case["fault_delay"]:
            done = _apply(fault, proc.pid, workers, case)
        if now > deadline:
            detail = {p: procs.cmdline(p)[:80] for p in procs.descendants(proc.pid)}
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(2)
            with open(err, errors="replace") as f:
                stacks = f.read()[-3000:]
            raise Hung(f"preprocess still running after {bound:g} s (fault {fault}); processes {detail}; {stacks}")
        time.sleep(0.01)
    proc.join()
    if case is not None:
        case["landed"] = done if fault != "none" else True
    return proc.exitcode, sorted(seen)


def _apply(fault: str, main: int, workers: list[int], case: dict) -> bool:
    if fault.endswith("_main"):
        target = main
    elif workers:
        target = random.Random(case["seed"]).choice(workers)
    else:
        return False
    # The target may end between the look at /proc and the signal (a run that just finished): the
    # fault then did not land, which is not the code under test's doing (seed 55 of the short form).
    try:
        os.kill(target, signal.SIGKILL if fault.startswith("kill") else signal.SIGSTOP)
    except ProcessLookupError:
        return False
    if fault.startswith("kill"):
        return True
    if fault.endswith("_cont"):
        time.sleep(random.Random(case["seed"]).uniform(0.5, 2.5))
        with contextlib.suppress(ProcessLookupError):  # ended while stopped: its exit is judged as any
            os.kill(target, signal.SIGCONT)
    case.setdefault("stopped", []).append(target)
    return True


def _read_output(prefix: str, keys: list[str], s3, bucket: str) -> dict[str, bytes]:
    out = {}
    for key in keys:
        for ext in (".bin", ".idx"):
            name = f"{prefix}_{key}_document{ext}"
            if name.startswith("s3://"):
                try:
                    out[name.rsplit("/", 1)[1]] = s3.get_object(Bucket=bucket, Key=name.split("/", 3)[3])["Body"].read()
                except s3.exceptions.NoSuchKey:
                    out[name.rsplit("/", 1)[1]] = None
            else:
                out[os.path.basename(name)] = _read_local(name)
    return out


def _read_local(path: str) -> bytes | None:
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def _compare(got: dict, want: dict, what: str) -> None:
    for name, data in want.items():
        if got.get(name) != data:
            size = None if got.get(name) is None else len(got[name])
            raise Mismatch(f"{what}: {name} differs from --workers 1 ({size} bytes, expected {len(data)})")


def _locations(case: dict, env: dict, inputs: list[str]):
    """The case's inputs and output as the CLI sees them, its environment, the S3 client, a proxy."""
    from campaign.s3 import CaseProxy, client, env_for, put_file

    work = env["work"]
    if case["storage"] == "local":
        return inputs, os.path.join(work, "out", "c"), {}, None, None
    s3 = client(env["endpoint"])
    base = f"s3://{env['bucket']}/cases/{case['seed']}"
    urls = []
    for path in inputs:
        key = f"cases/{case['seed']}/in/{os.path.basename(path)}"
        put_file(s3, path, env["bucket"], key)
        urls.append(f"s3://{env['bucket']}/{key}")
    output = os.path.join(work, "out", "c") if case["storage"] == "s3" else f"{base}/out/c"
    proxy = CaseProxy(env["endpoint"]) if case["storage"] == "s3-proxy" else None
    variables = env_for(proxy.endpoint if proxy else env["endpoint"])
    variables["STATEFULSET_STORAGE_RETRIES"] = "4"
    variables["STATEFULSET_STORAGE_RETRY_SECONDS"] = "30"
    # A stalled request is cut (and retried) after 10 s, as the loading cases' read_timeout 5 does,
    # not after the default 60 s: an s3_stall case waited a minute per stalled request.
    variables["STATEFULSET_STORAGE_CALL_SECONDS"] = "10"
    return urls, output, variables, s3, proxy


def run_preprocess(case: dict, env: dict) -> dict:
    from statefulset import StatefulsetError
    from statefulset.tools.preprocess import preprocess

    work = env["work"]
    inputs = _inputs(case, os.path.join(work, "in"))
    for folder in ("ref", "out", "rerun"):
        os.makedirs(os.path.join(work, folder), exist_ok=True)
    keys, eod = case["keys"], case["append_eod"]
    ref_prefix = os.path.join(work, "ref", "c")
    try:
        preprocess(inputs, ref_prefix, json_keys=keys, append_eod=eod, workers=1, show_progress=False)
        want = _read_output(ref_prefix, keys, None, "")
    except StatefulsetError as exc:
        want = exc
    urls, output, variables, s3, proxy = _locations(case, env, inputs)
    if case["fault"] == "stop_worker":
        variables["STATEFULSET_TASK_TIMEOUT"] = "6"
    argv = [
        "preprocess",
        "--input",
        *urls,
        "--output-prefix",
        output,
        "--json-keys",
        *keys,
        "--quiet",
        "--workers",
        str(case["workers"]),
        "--chunk-bytes",
        str(case["chunk_bytes"]),
    ] + (["--append-eod"] if eod else [])
    try:
        if proxy is not None and case["fault"].startswith("s3_"):
            kind = {"s3_503": "fail503", "s3_drop": "drop", "s3_stall": "stall"}[case["fault"]]
            proxy.set(**{kind: random.Random(case["seed"]).randint(1, 8 if kind == "fail503" else 2)})
            case["landed"] = True
        err = os.path.join(work, "stderr")
        rc, seen = run_cli(argv, variables, err, case, env["bound"] - 30)
        left = procs.wait_gone(seen, 15)
        procs.kill_all(left)
        if left:
            raise Orphans(
                f"{len(left)} worker process(es) outlived the preprocess main (exit {rc}, fault {case['fault']})"
            )
        if rc == -signal.SIGKILL and case["fault"] == "kill_main":
            _check_partial(output, keys, want, s3, env["bucket"])
            argv[argv.index(output)] = output  # the same arguments again: a user's rerun
            rc, _ = run_cli(argv, variables, err, None, env["bound"] - 30)
        return _verdict(rc, err, output, keys, want, s3, env["bucket"], case)
    finally:
        procs.kill_all(case.get("stopped", []))
        if proxy is not None:
            proxy.close()


def _check_partial(output: str, keys: list[str], want, s3, bucket: str) -> None:
    """After the main process was killed: an output .idx that exists must belong to the full, right output."""
    got = _read_output(output, keys, s3, bucket)
    for name, data in got.items():
        if name.endswith(".idx") and data is not None and (isinstance(want, Exception) or data != want[name]):
            raise Mismatch(f"{name}: a killed run left an .idx that differs from --workers 1")


def _verdict(rc: int, err: str, output: str, keys: list[str], want, s3, bucket: str, case: dict) -> dict:
    from statefulset import StatefulsetError

    with open(err, errors="replace") as f:
        text = f.read()
    if rc == 0:
        if isinstance(want, Exception):
            raise Mismatch(f"--workers 1 refused the inputs ({want}), this run succeeded")
        _compare(_read_output(output, keys, s3, bucket), want, f"--workers {case['workers']}")
        return {"landed": case.get("landed", False)}
    if rc == 2 and "statefulset preprocess: error:" in text:
        raise StatefulsetError(text.strip().splitlines()[-1][:500])
    raise RuntimeError(f"preprocess exited {rc}: {text.strip()[-1500:]}")
