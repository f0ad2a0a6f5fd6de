"""The loader in a torch.distributed.checkpoint (DCP) checkpoint beside a DDP model and its optimizer.

Runs with no arguments on CPU. It starts 4 gloo ranks (in a real job torchrun starts them), trains a
tiny DDP language model for 5 steps, saves ``{"model", "optim", "loader"}`` with ``dcp.save``,
trains 4 more steps (the uninterrupted run), then builds a fresh model, optimizer and loader (with
another worker count), ``dcp.load``-s the checkpoint and trains the same 4 steps again.

Exact continuation means: every rank sees the same sample ids in the same order as the
uninterrupted run, and the final weights agree with it (to float rounding: restoring AdamW into a
fresh DDP model changes the last bit of some updates even with identical batches).

The loader's ``state_dict()`` keys each DP rank's state as ``dp_rank_<r>``, because DCP keeps only
one copy of a non-tensor key; the checkpoint's metadata is read back to show all four are there.
Prints one verdict line; exits 1 on a mismatch.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from statefulset import WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.tools.demo import demo_spec

BATCH = 4
SAVE_AT, AFTER = 5, 4


def _setup(num_workers: int, spec: str):
    torch.manual_seed(1234 + num_workers)  # a fresh job starts from other weights: the checkpoint restores them
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Embedding(257, 16), torch.nn.Linear(16, 257)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wc = WorkerConfig(rank=dist.get_rank(), world_size=dist.get_world_size(), num_workers=num_workers)
    loader = get_savable_loader(get_train_dataset(spec, batch_size=BATCH, worker_config=wc))
    return model, optimizer, loader


def _train(model, optimizer, loader, steps: int) -> list[list[int]]:
    seen = []
    for _ in range(steps):
        batch = next(loader)
        seen.append(batch["sample_id"].tolist())
        x, y = batch["text"][:, :-1], batch["text"][:, 1:]
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()  # DDP averages the gradients over the 4 ranks
        optimizer.step()
    return seen


def rank_main(rank: int, world: int, rendezvous: str, spec: str, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    checkpoint = os.path.join(folder, "checkpoint")

    model, optimizer, loader = _setup(num_workers=1, spec=spec)
    _train(model, optimizer, loader, SAVE_AT)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "loader": loader}, checkpoint_id=checkpoint)
    uninterrupted = _train(model, optimizer, loader, AFTER)

    model2, optimizer2, loader2 = _setup(num_workers=2, spec=spec)
    model_sd, optim_sd = get_state_dict(model2, optimizer2)
    state = {"model": model_sd, "optim": optim_sd, "loader": loader2}
    dcp.load(state, checkpoint_id=checkpoint)  # the loader restores itself (Stateful); tensors load in place
    set_state_dict(model2, optimizer2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = _train(model2, optimizer2, loader2, AFTER)

    pairs = zip(model.state_dict().values(), model2.state_dict().values(), strict=True)
    weight_diff = max((a - b).abs().max().item() for a, b in pairs)
    record = {"uninterrupted": uninterrupted, "resumed": resumed, "weight_diff": weight_diff}
    torch.save(record, os.path.join(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()


def main() -> int:
    spec = demo_spec()  # the built-in corpus; written once, before any rank starts
    with tempfile.TemporaryDirectory(prefix="statefulset-dcp-") as folder:
        world = 4
        mp.start_processes(
            rank_main,
            args=(world, os.path.join(folder, "rendezvous"), spec, folder),
            nprocs=world,
            join=True,
            start_method="fork",
        )
        records = [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(world)]
        keys = dcp.FileSystemReader(os.path.join(folder, "checkpoint")).read_metadata().state_dict_metadata
        saved = sorted({k.split(".")[1] for k in keys if k.startswith("loader.dp_rank_")})
        layout = [
            [[(t * world + r) * BATCH + j for j in range(BATCH)] for t in range(SAVE_AT, SAVE_AT + AFTER)]
            for r in range(world)
        ]
        ids_ok = all(rec["resumed"] == rec["uninterrupted"] == layout[r] for r, rec in enumerate(records))
        # Not bit-identical: a fresh DDP model with a loaded AdamW state ends up ~3e-8 away from the
        # uninterrupted one even when both are fed the same in-memory batches (no loader, no DCP
        # involved); the sample ids are the exact check of the data.
        weight_diff = max(rec["weight_diff"] for rec in records)
        weights_ok = weight_diff <= 1e-6
        keys_ok = saved == [f"dp_rank_{r}" for r in range(world)]
        ok = ids_ok and weights_ok and keys_ok
        print(
            f"dcp_checkpoint: {'OK' if ok else 'MISMATCH'}: {world} gloo ranks saved model + AdamW + loader with DCP "
            f"after {SAVE_AT} steps (loader keys kept: {', '.join(saved)}); resumed with 2 workers instead of 1: "
            f"next {AFTER} batches {'identical' if ids_ok else 'DIFFER'} on every rank (rank 0 from sample "
            f"{records[0]['resumed'][0][0]}), final weights within {weight_diff:.0e} of the uninterrupted run's"
        )
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
