"""Faults of a loading case: signals to workers, shards damaged or replaced, states damaged, lock
holders killed or stopped while holding, a fault proxy in front of the S3 server."""

from __future__ import annotations

import contextlib
import copy
import glob
import multiprocessing
import os
import random
import signal
import threading
import time

import numpy

from campaign import procs

DAMAGE_BEFORE_OPEN = ("truncate_bin", "truncate_idx", "flip_idx", "retokenised_bin")
REPLACE_MID_RUN = ("replace_rename", "replace_inplace", "replace_object")


def retokenised(data: bytes, itemsize: int) -> bytes:
    """The same size, other tokens: what a re-tokenised corpus with the same lengths looks like."""
    tokens = numpy.frombuffer(data, dtype=numpy.uint16 if itemsize == 2 else numpy.int32).copy()
    tokens ^= 1
    return tokens.tobytes()


def damage_state(state: dict, how: str) -> object:
    bad = copy.deepcopy(state)
    if how == "drop_key":
        bad.pop("identity")
    elif how == "version":
        bad["version"] = 99
    elif how == "format":
        bad["format"] = "megatron.energon"
    elif how == "seed":
        bad["identity"]["seed"] += 1
    elif how == "data":
        bad["identity"]["data"] = "0" * len(str(bad["identity"]["data"]))
    elif how == "negative":
        bad["batches"] = -3
    elif how == "type":
        bad["batches"] = "7"
    elif how == "dp_rank":
        bad["dp_rank"] = bad["dp_size"] + 2
    elif how == "batch_size":
        bad["batch_size"] = 0
    else:
        return b"\x80garbage"
    return bad


def _resume(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGCONT)


def _open_stream_and_exit(spec: dict) -> None:
    from statefulset import open_stream

    open_stream(spec)
    os._exit(0)


class LoadFaults:
    """One case's fault, applied at its moment; ``landed`` says whether it hit something."""

    def __init__(self, case: dict, shards: dict[str, str], s3, proxy) -> None:
        self.case, self.shards, self.s3, self.proxy = case, shards, s3, proxy
        self.kind = case["fault"]
        self.rng = random.Random(case["seed"] * 7 + 1)
        case["landed"] = self.kind == "none"
        self.stopped: list[int] = []
        self.helper = None

    @property
    def landed(self) -> bool:
        return self.case["landed"]

    @landed.setter
    def landed(self, value: bool) -> None:
        self.case["landed"] = value

    # -- which shard -----------------------------------------------------------------------------
    def victim(self) -> str:
        names = [n for n, _ in self.case["sources"]]
        for _, mix in self.case["stages"] or ():
            names += [n for n, _ in mix]
        return sorted(set(names))[0]

    def _itemsize(self) -> int:
        return 4 if self.victim() == "code" else 2

    def _rewrite(self, ext: str, change) -> None:
        location = self.shards[self.victim()] + ext
        if self.s3 is not None:
            key = location.split("/", 3)[3]
            old = self.s3.get_object(Bucket=self.case["bucket"], Key=key)["Body"].read()
            self.s3.put_object(Bucket=self.case["bucket"], Key=key, Body=change(old))
        else:
            with open(location, "rb") as f:
                old = f.read()
            self._write_local(location, change(old))
        self.landed = True

    def _write_local(self, path: str, data: bytes) -> None:
        if self.kind == "replace_inplace":
            with open(path, "r+b") as f:
                f.write(data)
                f.truncate()
        else:
            with open(path + ".new", "wb") as f:
                f.write(data)
            os.replace(path + ".new", path)

    # -- moments ---------------------------------------------------------------------------------
    def before_open(self, phase: int, spec: dict) -> None:
        if phase != self.case["fault_phase"] and not (self.kind.startswith("lock_holder") and phase == 1):
            return
        k = self.kind
        if k == "truncate_bin":
            self._rewrite(".bin", lambda d: d[: max(0, len(d) - 1 - self.rng.randrange(64))])
        elif k == "truncate_idx":
            self._rewrite(".idx", lambda d: d[: self.rng.randrange(len(d))])
        elif k == "flip_idx":
            spot = self.rng.randrange(2048)
            self._rewrite(
                ".idx",
                lambda d: (
                    d[: spot % len(d)]
                    + bytes([d[spot % len(d)] ^ (1 << self.rng.randrange(8))])
                    + d[spot % len(d) + 1 :]
                ),
            )
        elif k == "retokenised_bin" and phase == 2:
            self._rewrite(".bin", lambda d: retokenised(d, self._itemsize()))
        elif k.startswith("lock_holder") and phase == 1:
            self._lock_holder(spec)

    def at_batch(self, phase: int, t: int, before: set[int]) -> None:
        if phase != self.case["fault_phase"] or t != self.case["fault_at"]:
            return
        k = self.kind
        if k in REPLACE_MID_RUN:
            self._rewrite(".bin", lambda d: retokenised(d, self._itemsize()))
        elif k in ("kill_worker", "stop_worker", "stop_worker_cont"):
            self._signal_worker(before)
        elif k.startswith("s3_") and self.proxy is not None:
            amount = self.rng.randint(1, 8 if k == "s3_503" else 3)
            self.proxy.set(**{{"s3_503": "fail503", "s3_drop": "drop", "s3_stall": "stall"}[k]: amount})
            self.landed = True

    def _signal_worker(self, before: set[int]) -> None:
        workers = procs.new_workers(before)
        if not workers:
            return
        pid = self.rng.choice(workers)
        if self.kind == "kill_worker":
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGSTOP)
            self.stopped.append(pid)
            if self.kind == "stop_worker_cont":
                threading.Timer(self.rng.uniform(0.5, 3.0), _resume, (pid,)).start()
        self.landed = True

    def _lock_holder(self, spec: dict) -> None:
        """A process that opens the spec, signalled the moment a lock file appears in a cache folder."""
        folders = [spec["path_to_cache"], os.environ.get("STATEFULSET_REMOTE_CACHE", "")]
        self.helper = multiprocessing.get_context("fork").Process(target=_open_stream_and_exit, args=(spec,))
        self.helper.start()
        deadline = time.monotonic() + 30
        while self.helper.is_alive() and time.monotonic() < deadline:
            if any(glob.glob(os.path.join(f, "**", "*.lock"), recursive=True) for f in folders if f):
                os.kill(self.helper.pid, signal.SIGKILL if self.kind == "lock_holder_kill" else signal.SIGSTOP)
                self.landed = True
                break
            time.sleep(0.001)
        if self.kind == "lock_holder_kill" or not self.landed:
            self.helper.join(30)

    def cleanup(self) -> None:
        procs.kill_all(self.stopped)
        if self.helper is not None and self.helper.is_alive():
            with contextlib.suppress(OSError):
                os.kill(self.helper.pid, signal.SIGKILL)
            self.helper.join(10)
