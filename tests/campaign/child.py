"""One case, in a process of its own (forked from a fork server that has torch and statefulset
imported): it leads its own process group, so the runner can end it and everything it started."""

from __future__ import annotations

import json
import os
import resource
import time
import traceback

import torch  # noqa: F401

import statefulset
from campaign.loading_run import run_load
from campaign.outcome import HANG, NAMED, PASS, SILENT, UNNAMED, Mismatch, Orphans
from campaign.preprocessing import Hung, run_preprocess

RUN = {"load": run_load, "preprocess": run_preprocess}


def run_case(case: dict, env: dict, result_path: str) -> None:
    os.setpgid(0, 0)
    work = env["work"]
    os.makedirs(work, exist_ok=True)
    log = os.open(os.path.join(work, "case.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ["STATEFULSET_REMOTE_CACHE"] = os.path.join(work, "node-cache")
    os.environ["STATEFULSET_LOCK"] = "file" if case["seed"] % 4 == 0 else "flock"
    if case.get("fault") == "lock_holder_stop":
        os.environ["STATEFULSET_CACHE_WAIT"] = "5"
    started = time.monotonic()
    before = resource.getrusage(resource.RUSAGE_SELF)
    cpu_before = before.ru_utime + before.ru_stime  # what the fork server had spent before the fork
    result: dict = {"detail": ""}
    try:
        result.update(RUN[case["kind"]](case, env))
        result["verdict"] = PASS
    except Mismatch as exc:
        result.update(verdict=SILENT, detail=str(exc))
    except (Orphans, Hung) as exc:
        result.update(verdict=HANG, detail=str(exc))
    except statefulset.StatefulsetError as exc:
        result.update(verdict=NAMED, detail=f"{type(exc).__name__}: {exc}"[:600])
    except BaseException as exc:
        result.update(
            verdict=UNNAMED, detail=f"{type(exc).__name__}: {exc}"[:600] + "\n" + traceback.format_exc()[-2000:]
        )
    result["seconds"] = round(time.monotonic() - started, 2)
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    result["cpu_s"] = round(own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime - cpu_before, 2)
    result.setdefault("landed", case.get("landed", False))
    with open(result_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(result_path + ".tmp", result_path)
    os._exit(0)
