"""Real multi-process runs for the tests: gloo ranks forked from a fork server that has torch imported.

``spawn(fn, nprocs, tmp_path, *args)`` calls ``fn(rank, nprocs, init_file, *args)`` in each rank;
the rank calls ``init_rank(rank, nprocs, init_file)`` first. Ranks report results by writing files
(``torch.save``) that the test then checks in the pytest process. The wait for the ranks is
bounded: ranks still running after ``timeout`` seconds are killed and the test fails.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
import uuid
import warnings
from pathlib import Path

import torch

# The longest a test's ranks may run (the 2 cores may be shared with other jobs): past it, a hang.
JOIN_TIMEOUT = 600.0


def init_rank(rank: int, world: int, init_file: str) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
    # A rank started by the fork server inherits "forkserver" as its start method, and its DataLoader
    # would start a fork server of its own, importing torch afresh for every worker (seconds each).
    # Ranks launched by torchrun on Linux fork their workers; so do these.
    multiprocessing.set_start_method("fork", force=True)
    torch.set_num_threads(1)
    # Gloo's init (and new_group's) returns on a rank before its peers have finished connecting to
    # it; a rank that then exits (a test whose rank refuses at once) made a peer fail with "Gloo
    # connectFullMesh failed ... Connection closed by peer". torch's store barrier after each
    # group's creation keeps every rank in until all are connected (tests/test_ranks.py).
    os.environ["TORCH_DIST_INIT_BARRIER"] = "1"
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),  # generous: other jobs may share the 2 cores
    )


def spawn(fn, nprocs: int, tmp_path: Path, *args, timeout: float = JOIN_TIMEOUT) -> None:
    """Run ``fn`` on ``nprocs`` ranks; fail (and kill them) if they are not all done within ``timeout`` s.

    A rank that raises makes torch stop the others and re-raise here; a rank that hangs (a
    collective one peer never entered) is killed at the deadline, and the test fails naming it.
    """
    import torch.multiprocessing as mp

    # One fork server imports torch once and forks every rank from it (seconds saved per rank).
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch.distributed", "statefulset"])
    init_file = str(tmp_path / f"rendezvous-{uuid.uuid4().hex}")
    context = mp.start_processes(
        fn, args=(nprocs, init_file, *args), nprocs=nprocs, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                alive = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
                raise AssertionError(f"ranks {alive} of {nprocs} still running after {timeout:g} s (a hang): killed")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
