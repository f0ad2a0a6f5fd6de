"""The campaign's session and scheduler.

A session starts one moto server (shared by every case; each case uses its own keys and, for
faults, its own proxy), writes the shared shards once and uploads them, then runs cases ``jobs``
at a time. Each case is a process forked from a fork server that has torch and statefulset
imported (milliseconds instead of seconds per case); it leads its own process group, and the
runner kills that group when the case outlives its hard timeout (a hang) or when the case is done
(processes left behind are counted as strays).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
from multiprocessing.connection import wait

from campaign import draw, procs
from campaign.corpus import build_shards
from campaign.known import known
from campaign.outcome import FINDINGS, HANG, UNNAMED, VERDICTS
from campaign.s3 import TESTS, client, ensure_bucket, upload_copy

BUCKET = "campaign"


class Session:
    def __init__(self, root: str, jobs: int = 2, timeout: float = 150.0, keep_findings: bool = True) -> None:
        self.root, self.jobs, self.timeout, self.keep = root, jobs, timeout, keep_findings
        self._stack = contextlib.ExitStack()
        self.keep_also: tuple[str, ...] = ()  # other verdicts whose case folders stay (debugging)

    def __enter__(self) -> Session:
        if TESTS not in sys.path:
            sys.path.insert(0, TESTS)
        from s3_servers import moto_server

        os.makedirs(self.root, exist_ok=True)
        os.environ.setdefault("XDG_CACHE_HOME", os.path.join(self.root, "xdg-cache"))
        server = self._stack.enter_context(moto_server())
        self.endpoint = server.endpoint
        self.shards = build_shards(os.path.join(self.root, "shards"))
        s3 = client(self.endpoint)
        ensure_bucket(s3, BUCKET)
        upload_copy(s3, BUCKET, self.shards, "shared")
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(["campaign.child"])
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def env(self, seed: int) -> dict:
        return {
            "work": os.path.join(self.root, "cases", str(seed)),
            "shards": self.shards,
            "endpoint": self.endpoint,
            "bucket": BUCKET,
            "bound": self.timeout,
        }

    def _start(self, case: dict):
        from campaign.child import run_case

        env = self.env(case["seed"])
        shutil.rmtree(env["work"], ignore_errors=True)
        os.makedirs(env["work"])
        result_path = os.path.join(env["work"], "result.json")
        proc = self.ctx.Process(target=run_case, args=(case, env, result_path), daemon=False)
        proc.start()
        return proc, time.monotonic() + self.timeout, result_path, time.monotonic()

    def _finish(self, case: dict, proc, result_path: str, started: float, timed_out: bool) -> dict:
        members = procs.group_members(proc.pid) if proc.pid else []
        if timed_out:
            detail = "; ".join(f"{p}: {procs.cmdline(p)[:100]}" for p in members[:8])
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.join(30)
            result = {"verdict": HANG, "detail": f"no result within {self.timeout:g} s; processes: {detail}"}
        else:
            proc.join(30)
            try:
                with open(result_path) as f:
                    result = json.load(f)
            except (OSError, ValueError):
                result = {
                    "verdict": UNNAMED,
                    "detail": f"the case process ended with exit code {proc.exitcode} and no result",
                }
            # A fork server the case started ends on its own once the case is gone: give it a moment.
            strays = procs.wait_gone([p for p in procs.group_members(proc.pid) if p != proc.pid], 5)
            if strays:
                result["strays"] = len(strays)
                procs.kill_all(strays)
        result.setdefault("seconds", round(time.monotonic() - started, 2))
        result["seed"] = case["seed"]
        entry = known(case, result) if result["verdict"] in FINDINGS else None
        if entry is not None:
            result["known"] = entry.item
        if result["verdict"] not in FINDINGS + self.keep_also or not self.keep:
            shutil.rmtree(os.path.dirname(result_path), ignore_errors=True)
        return result

    def run(self, cases: list[dict], progress=None, stop=None) -> list[dict]:
        """Results in the order of ``cases``; ``stop()`` true: start no more (those not run are left out)."""
        pending, running, results = list(cases), {}, []
        try:
            self._loop(pending, running, results, progress, stop)
        finally:  # interrupted: the running cases go too (multiprocessing would wait for them at exit)
            for _, proc, *_ in running.values():
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
        order = {c["seed"]: i for i, c in enumerate(cases)}
        return sorted(results, key=lambda r: order[r["seed"]])

    def _loop(self, pending: list, running: dict, results: list, progress, stop) -> None:
        while pending or running:
            if stop is not None and stop():
                pending.clear()
            while pending and len(running) < self.jobs:
                case = pending.pop(0)
                running[case["seed"]] = (case, *self._start(case))
            sentinels = {entry[1].sentinel: seed for seed, entry in running.items()}
            ready = wait(list(sentinels), timeout=0.5)
            now = time.monotonic()
            for seed in list(running):
                case, proc, deadline, result_path, started = running[seed]
                if proc.sentinel in ready or now > deadline:
                    del running[seed]
                    result = self._finish(case, proc, result_path, started, proc.sentinel not in ready)
                    results.append(result)
                    if progress is not None:
                        progress(case, result)


def run_seeds(seeds, root: str, jobs: int = 2, timeout: float = 150.0, long_form: bool = False, progress=None):
    cases = [draw(seed, long_form) for seed in seeds]
    with Session(root, jobs, timeout) as session:
        return cases, session.run(cases, progress)


def tally(cases: list[dict], results: list[dict]) -> dict:
    counts = dict.fromkeys(VERDICTS, 0)
    by_kind: dict[str, dict[str, int]] = {}
    for case, result in zip(cases, results, strict=True):
        counts[result["verdict"]] += 1
        row = by_kind.setdefault(case["kind"], dict.fromkeys(VERDICTS, 0))
        row[result["verdict"]] += 1
    return {"cases": len(results), **counts, "by_kind": by_kind}
