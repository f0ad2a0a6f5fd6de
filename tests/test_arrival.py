"""save_state_global / restore_state_global called on only some ranks: a named error within the bound, not a hang.

Real gloo process groups (tests/ranks.py); a rank that skips the call stays alive, as in a job
whose checkpoint hook runs on some ranks only. Each rank writes what happened to a file.
"""

from __future__ import annotations

import re
import time

import numpy
import pytest
import torch
from ranks import init_rank, spawn

from statefulset import IndexedDatasetWriter, StatefulsetError, WorkerConfig, get_savable_loader, get_train_dataset

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

BOUND = 3.0  # collective_timeout in these tests, seconds


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("corpus")
    with IndexedDatasetWriter(root / "a") as w:
        for i in range(40):
            w.add_document(numpy.arange(i, i + 30) % 500)
    return {"data_path": str(root / "a"), "seq_length": 8, "packing": "native"}


def _loader(spec: dict, dp_rank: int, dp_size: int, group=None, timeout=BOUND):
    wc = WorkerConfig(rank=dp_rank, world_size=dp_size, num_workers=0, data_parallel_group=group)
    return get_savable_loader(get_train_dataset(spec, batch_size=2, worker_config=wc), collective_timeout=timeout)


def _outcome(call) -> dict:
    started = time.monotonic()
    try:
        result = call()
        return {"error": None, "result": result, "seconds": time.monotonic() - started}
    except StatefulsetError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - started}


def assert_named_within_bound(outcome: dict, call: str, dp_ranks: list, global_ranks: list) -> None:
    assert outcome["error"] is not None, outcome
    assert (
        f"{call}: DP rank(s) {dp_ranks} (global rank(s) {global_ranks}) of the data_parallel_group did not call "
        f"{call} within 3 s" in outcome["error"]
    )
    assert BOUND <= outcome["seconds"] < BOUND + 15  # bounded: nowhere near the group's 120 s timeout


def _wait_for_peers(out: str, ranks) -> None:
    """The rank that skipped the call stays alive until the others have reported (bounded)."""
    import os

    deadline = time.monotonic() + 120
    while not all(os.path.exists(f"{out}/{r}.pt") for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)


def _save_on_some_ranks(rank: int, world: int, init_file: str, out: str, spec: dict) -> None:
    init_rank(rank, world, init_file)
    loader = _loader(spec, rank, world)
    next(iter(loader))
    if rank == world - 1:  # the last rank "forgets" the collective
        _wait_for_peers(out, range(world - 1))
        return
    outcome = _outcome(lambda: loader.save_state_global(global_dst_rank=0))
    torch.save(outcome, f"{out}/{rank}.pt")


def test_save_state_global_on_some_ranks_names_the_missing_ones(tmp_path, spec):
    spawn(_save_on_some_ranks, 3, tmp_path, str(tmp_path), spec)
    for rank in (0, 1):
        assert_named_within_bound(torch.load(tmp_path / f"{rank}.pt"), "save_state_global", [2], [2])


def _restore_in_a_dp_group(rank: int, world: int, init_file: str, out: str, spec: dict) -> None:
    init_rank(rank, world, init_file)
    import torch.distributed as dist

    # Global ranks 1 and 2 form a DP group (DP ranks 0 and 1); rank 0 is alone, like another PP stage.
    groups = [dist.new_group([0]), dist.new_group([1, 2])]
    if rank == 0:
        _wait_for_peers(out, [2])
        return
    dp_rank = rank - 1
    loader = _loader(spec, dp_rank, 2, groups[1])
    if dp_rank == 0:  # the source rank skips the restore
        saved = [_loader(spec, r, 2, groups[1]).save_state_rank() for r in range(2)]
        assert saved
        _wait_for_peers(out, [2])
        return
    torch.save(_outcome(lambda: loader.restore_state_global(None, src_rank=0)), f"{out}/{rank}.pt")


def test_restore_state_global_in_a_dp_group_names_dp_and_global_ranks(tmp_path, spec):
    spawn(_restore_in_a_dp_group, 3, tmp_path, str(tmp_path), spec)
    assert_named_within_bound(torch.load(tmp_path / "2.pt"), "restore_state_global", [0], [1])


def _save_everywhere(rank: int, world: int, init_file: str, out: str, spec: dict, dst_ranks: list) -> None:
    init_rank(rank, world, init_file)
    loader = _loader(spec, rank, world)
    outcomes = []
    for _ in range(4):  # repeated calls: the meeting keys of earlier calls are reused correctly
        next(iter(loader))
        outcomes.append(_outcome(lambda: loader.save_state_global(global_dst_rank=dst_ranks[rank])))
        if outcomes[-1]["error"]:
            break
    torch.save(outcomes, f"{out}/{rank}.pt")


def test_every_rank_calling_gathers_as_before(tmp_path, spec):
    spawn(_save_everywhere, 2, tmp_path, str(tmp_path), spec, [0, 0])
    on_zero, on_one = torch.load(tmp_path / "0.pt"), torch.load(tmp_path / "1.pt")
    assert [o["error"] for o in on_zero + on_one] == [None] * 8
    assert [o["result"] for o in on_one] == [None] * 4
    assert [[s["batches"] for s in o["result"]] for o in on_zero] == [[1, 1], [2, 2], [3, 3], [4, 4]]


def test_ranks_that_disagree_on_the_destination_are_named(tmp_path, spec):
    spawn(_save_everywhere, 2, tmp_path, str(tmp_path), spec, [0, 1])
    for rank in (0, 1):
        (outcome,) = torch.load(tmp_path / f"{rank}.pt")
        assert re.search(
            r"save_state_global: the DP ranks passed different arguments \(DP rank (\d) passed "
            r"'global_dst_rank=\1', another rank 'global_dst_rank=(?!\1)\d'\)",
            outcome["error"],
        ), outcome["error"]


def test_collective_timeout_is_checked(spec):
    for bad in (0, -1, "5", True):
        with pytest.raises(StatefulsetError, match="collective_timeout: timeout must be a positive number"):
            _loader(spec, 0, 1, timeout=bad)
    assert _loader(spec, 0, 1, timeout=None).collective_timeout is None


def _datamodule_state_on_one_rank(rank: int, world: int, init_file: str, out: str, spec: dict) -> None:
    init_rank(rank, world, init_file)
    from statefulset.integrations.lightning.datamodule import StatefulsetDataModule

    dm = StatefulsetDataModule(
        spec, micro_batch_size=2, num_workers=0, dp_rank=rank, dp_size=world, collective_timeout=BOUND
    )
    next(iter(dm.train_dataloader()))
    if rank == 1:  # a checkpoint hook that runs on rank 0 only
        _wait_for_peers(out, [0])
        return
    torch.save(_outcome(dm.state_dict), f"{out}/{rank}.pt")


def test_datamodule_state_dict_on_one_rank_names_the_other(tmp_path, spec):
    pytest.importorskip("lightning")
    spawn(_datamodule_state_on_one_rank, 2, tmp_path, str(tmp_path), spec)
    assert_named_within_bound(torch.load(tmp_path / "0.pt"), "StatefulsetDataModule.state_dict", [1], [1])
