"""TP broadcast and the first → last stage link, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
from ranks import init_rank, spawn

from statefulset import StatefulsetError
from statefulset.parallel.transfer import StageLink, TensorSpec, broadcast_batch

SPECS = (TensorSpec("text", (2, 5), torch.int64), TensorSpec("mask", (2, 4), torch.float32))


def _batch(step: int) -> dict[str, torch.Tensor]:
    return {
        "text": torch.arange(10, dtype=torch.int64).view(2, 5) + 100 * step,
        "mask": torch.full((2, 4), float(step), dtype=torch.float32),
    }


def _ranks(rank: int, world: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    init_rank(rank, world, init_file)
    # Ranks 0,1 form a "TP group"; rank 0 → rank 2 and rank 1 → rank 3 are "pipelines".
    tp = dist.new_group([0, 1])
    dist.new_group([2, 3])
    seen = []
    if rank < 2:
        got = broadcast_batch(_batch(7) if rank == 0 else None, SPECS, src=0, group=tp)
        seen.append(got)
        link = StageLink(rank + 2, SPECS, depth=2)
        for step in range(6):  # more sends than the depth: the oldest are waited for
            link.send(_batch(step + rank))
        link.flush()
        try:
            link.send({"text": torch.zeros(2, 6, dtype=torch.int64), "mask": _batch(0)["mask"]})
        except StatefulsetError as error:
            seen.append(str(error))
    else:
        link = StageLink(rank - 2, SPECS)
        seen.extend(link.recv() for _ in range(6))
    torch.save(seen, f"{out}/{rank}.pt")
    dist.barrier()


def test_broadcast_and_stage_link(tmp_path):
    spawn(_ranks, 4, tmp_path, str(tmp_path))
    for rank in (0, 1):
        seen = torch.load(tmp_path / f"{rank}.pt")
        assert all(torch.equal(seen[0][k], _batch(7)[k]) for k in ("text", "mask"))
        assert "'text' is torch.int64 (2, 6), receivers expect torch.int64 (2, 5)" in seen[1]
    for rank in (2, 3):
        seen = torch.load(tmp_path / f"{rank}.pt")
        for step, got in enumerate(seen):
            expected = _batch(step + rank - 2)
            assert all(torch.equal(got[k], expected[k]) for k in ("text", "mask"))


def test_stage_link_needs_torch_distributed():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("needs a process without a default group")
    with pytest.raises(StatefulsetError, match="not initialised"):
        StageLink(1, SPECS)
