"""Real multi-process runs for the tests: gloo ranks forked from a fork server that has torch imported.

``spawn(fn, nprocs, tmp_path, *args)`` calls ``fn(rank, nprocs, init_file, *args)`` in each rank;
the rank calls ``init_rank(rank, nprocs, init_file)`` first. Ranks report results by writing files
(``torch.save``) that the test then checks in the pytest process.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import uuid
import warnings
from pathlib import Path

import torch


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


def spawn(fn, nprocs: int, tmp_path: Path, *args) -> None:
    import torch.multiprocessing as mp

    # One fork server imports torch once and forks every rank from it (seconds saved per rank).
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch.distributed", "statefulset"])
    init_file = str(tmp_path / f"rendezvous-{uuid.uuid4().hex}")
    mp.start_processes(fn, args=(nprocs, init_file, *args), nprocs=nprocs, join=True, start_method="forkserver")
