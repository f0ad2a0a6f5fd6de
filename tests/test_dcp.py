"""The savable loader inside a torch.distributed.checkpoint (DCP) checkpoint, beside a model, on real gloo ranks.

DCP keeps a single copy of every non-tensor key (torchtitan #291): a loader state stored under a
key that all ranks share would come back as one rank's state on every rank. The loader's
``state_dict()`` keys each DP rank's state as ``dp_rank_<r>``, so every DP rank's state survives
and TP peers (same DP rank, same state) are stored once. These tests read the checkpoint's
metadata to see that, and compare whole resumed streams with the uninterrupted ones.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import init_rank, spawn

from statefulset import (
    ParallelLayout,
    StatefulsetError,
    WorkerConfig,
    create_data_parallel_groups,
    get_savable_loader,
    get_train_dataset,
    open_stream,
)
from statefulset.tools.demo import demo_spec

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

B = 4
BEFORE, AFTER = 5, 4  # micro-batches before the save and after it


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> str:
    return demo_spec(str(tmp_path_factory.mktemp("corpus")), documents=600, seq_length=32)


def _loader(spec: str, dp_rank: int, dp_size: int, num_workers: int, group=None):
    wc = WorkerConfig(rank=dp_rank, world_size=dp_size, num_workers=num_workers, data_parallel_group=group)
    return get_savable_loader(get_train_dataset(spec, batch_size=B, worker_config=wc))


def _take(loader, n: int) -> dict:
    batches = [next(loader) for _ in range(n)]
    return {"ids": [b["sample_id"].tolist() for b in batches], "text": torch.stack([b["text"] for b in batches])}


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(257, 4), torch.nn.Linear(4, 257))


def _train_step(model: torch.nn.Module, optimizer, batch_text: torch.Tensor) -> None:
    """One step of a DDP-style job: gradients averaged over the ranks by hand (gloo all_reduce)."""
    x, y = batch_text[:, :-1] % 257, batch_text[:, 1:] % 257
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    optimizer.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    optimizer.step()


def _save_and_resume(rank, world, init_file, spec, out, layout_tp):
    """Train BEFORE steps, DCP-save model + loader, train AFTER more; then a fresh model + loader resumes."""
    init_rank(rank, world, init_file)
    torch.manual_seed(0)
    if layout_tp > 1:
        layout = ParallelLayout(world, tp=layout_tp)
        info = layout.rank_info(rank)
        group = create_data_parallel_groups(layout)
        dp_rank, dp_size = info.dp_rank, world // layout_tp
    else:
        group, dp_rank, dp_size = None, rank, world
    ckpt = os.path.join(out, "ckpt")

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = _loader(spec, dp_rank, dp_size, num_workers=1, group=group)
    for _ in range(BEFORE):
        _train_step(model, optimizer, next(loader)["text"])
    # A shared non-tensor key: DCP stores one copy, so most ranks would get another rank's state back.
    naive = {"batches": loader.batches_taken, "rank": rank}
    dcp.save({"model": model.state_dict(), "loader": loader, "naive": naive}, checkpoint_id=ckpt)
    uninterrupted = _take(loader, AFTER)

    fresh_model = _model()  # other initial weights: the checkpoint must bring the trained ones back
    fresh_loader = _loader(spec, dp_rank, dp_size, num_workers=2, group=group)  # another worker count
    state = {"model": fresh_model.state_dict(), "loader": fresh_loader, "naive": {"batches": -1, "rank": -1}}
    dcp.load(state, checkpoint_id=ckpt)
    fresh_model.load_state_dict(state["model"])
    resumed = _take(fresh_loader, AFTER)
    pairs = zip(model.state_dict().values(), fresh_model.state_dict().values(), strict=True)
    same_model = all(torch.equal(a, b) for a, b in pairs)
    torch.save(
        {
            "dp_rank": dp_rank,
            "uninterrupted": uninterrupted,
            "resumed": resumed,
            "same_model": same_model,
            "naive": state["naive"],
        },
        os.path.join(out, f"rank{rank}.pt"),
    )


def _expected_ids(dp_rank: int, dp_size: int, first: int, n: int) -> list[list[int]]:
    return [[(t * dp_size + dp_rank) * B + j for j in range(B)] for t in range(first, first + n)]


def _check(spec: str, out: Path, world: int, dp_size: int) -> list[dict]:
    records = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    stream = open_stream(spec)
    for rec in records:
        expected = _expected_ids(rec["dp_rank"], dp_size, BEFORE, AFTER)
        assert rec["uninterrupted"]["ids"] == expected
        assert rec["resumed"]["ids"] == expected
        assert torch.equal(rec["resumed"]["text"], rec["uninterrupted"]["text"])
        rows = torch.from_numpy(stream.gather(numpy.asarray(expected).reshape(-1)))
        assert torch.equal(rec["resumed"]["text"].reshape(-1, rows.shape[1]), rows)
        assert rec["same_model"]
    keys = dcp.FileSystemReader(str(out / "ckpt")).read_metadata().state_dict_metadata
    saved_ranks = sorted({k.split(".")[1] for k in keys if k.startswith("loader.dp_rank_")})
    assert saved_ranks == [f"dp_rank_{r}" for r in range(dp_size)]
    assert "loader.dp_world_size" in keys
    return records


def test_dcp_dp4_every_rank_resumes_exactly(tmp_path, spec):
    spawn(_save_and_resume, 4, tmp_path, spec, str(tmp_path), 1)
    records = _check(spec, tmp_path, world=4, dp_size=4)
    # The control: under one shared key, every rank got the same single saved copy back.
    assert len({(rec["naive"]["rank"], rec["naive"]["batches"]) for rec in records}) == 1

    # The same checkpoint on 2 DP ranks: the loader refuses, naming both sizes (elastic restores go
    # through save_state_global / restore_state_global, which sees every rank's state).
    spawn(_load_on_other_dp, 2, tmp_path, spec, str(tmp_path))
    for r in range(2):
        assert "saved with data-parallel size 4, this loader has 2" in (tmp_path / f"refused{r}.txt").read_text()


def _load_on_other_dp(rank, world, init_file, spec, out):
    init_rank(rank, world, init_file)
    loader = _loader(spec, rank, world, num_workers=0)
    try:
        dcp.load({"loader": loader}, checkpoint_id=os.path.join(out, "ckpt"))
        message = "loaded"
    except StatefulsetError as exc:
        message = str(exc)
    Path(out, f"refused{rank}.txt").write_text(message)


def test_dcp_tp2_dp2_tp_peers_share_one_saved_state(tmp_path, spec):
    spawn(_save_and_resume, 4, tmp_path, spec, str(tmp_path), 2)
    records = _check(spec, tmp_path, world=4, dp_size=2)
    by_dp: dict[int, list] = {}
    for rec in records:
        by_dp.setdefault(rec["dp_rank"], []).append(rec["resumed"]["ids"])
    assert sorted(by_dp) == [0, 1] and all(a == b for a, b in by_dp.values())  # TP peers: identical data
