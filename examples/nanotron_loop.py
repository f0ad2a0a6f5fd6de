"""A Nanotron-style training loop on 4 CPU ranks (PP2 x DP2), checkpointed, restarted, checked bit for bit.

What it shows, with no arguments and no GPU:

- ``build_nanotron_dataloader`` called the same way on every rank. The first stage reads the
  shards and yields ``input_ids``/``input_mask``; the last stage gets ``label_ids``/``label_mask``
  from it over a point-to-point link; each holds ``TensorPointer``s for what it does not own.
- Nanotron's step: ``batch = (next(dataloader) for _ in range(n_micro_batches_per_batch))``,
  consumed lazily by an all-forward-all-backward schedule whose activations and gradients go
  between the stages with ``isend``/``recv``; gradients accumulate over the micro-batches and are
  averaged over the DP group before the optimizer step.
- Nanotron's checkpoint: model + optimizer per stage, and ``consumed_train_samples`` in the
  metadata written by rank 0 only. The restart rebuilds the loader from that one integer.

The script runs the job uninterrupted (saving a checkpoint on the way), then restarts from the
checkpoint in fresh processes and checks that the resumed steps' losses and sample ids equal the
uninterrupted run's exactly. It prints a one-line verdict and exits non-zero on a mismatch.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from statefulset import ParallelLayout, create_parallel_groups
from statefulset.integrations.nanotron.batch import TensorPointer
from statefulset.integrations.nanotron.dataloader import build_nanotron_dataloader
from statefulset.tools.demo import demo_spec

WORLD, PP = 4, 2
MICRO_BATCH_SIZE = 2
N_MICRO_BATCHES = 3  # Nanotron's tokens.batch_accumulation_per_replica
STEPS, CHECKPOINT_STEP = 6, 3
SEQ, VOCAB, HIDDEN = 32, 257, 32  # the demo corpus is byte-tokenised: 256 bytes + end-of-document


def make_stage(pp_rank: int) -> torch.nn.Module:
    """The two halves of a tiny language model; the same weights on every DP rank."""
    torch.manual_seed(1000 + pp_rank)
    if pp_rank == 0:
        return torch.nn.Sequential(torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh())
    return torch.nn.Linear(HIDDEN, VOCAB)


def train_step(model, optimizer, dataloader, peer: int, dp_group, record: dict) -> None:
    """One Nanotron step: draw n micro-batches lazily, all forwards, all backwards, DP average, optimizer."""
    pp_rank = dataloader.pp_rank
    batch = (next(dataloader) for _ in range(N_MICRO_BATCHES))  # exactly Nanotron's trainer
    sends, kept, losses = [], [], []
    for micro_batch in batch:  # the engine pulls lazily; the last stage's pull waits for the first stage's
        record["sample_ids"].append(micro_batch.pop("sample_id").tolist())
        if pp_rank == 0:
            assert isinstance(micro_batch["label_ids"], TensorPointer) and micro_batch["label_ids"].group_rank == 1
            hidden = model(micro_batch["input_ids"])
            sends.append(dist.isend(hidden.detach().contiguous(), dst=peer))
            kept.append(hidden)
        else:
            assert isinstance(micro_batch["input_ids"], TensorPointer) and micro_batch["input_ids"].group_rank == 0
            hidden = torch.empty(MICRO_BATCH_SIZE, SEQ, HIDDEN)
            dist.recv(hidden, src=peer)
            hidden.requires_grad_(True)
            logits = model(hidden)
            mask = micro_batch["label_mask"]
            loss = F.cross_entropy(logits[mask], micro_batch["label_ids"][mask]) / N_MICRO_BATCHES
            loss.backward()  # gradients accumulate over the step's micro-batches
            sends.append(dist.isend(hidden.grad.contiguous(), dst=peer))
            losses.append(loss.detach())
    if pp_rank == 0:
        for hidden in kept:
            grad = torch.empty_like(hidden)
            dist.recv(grad, src=peer)
            hidden.backward(grad)
    for work in sends:
        work.wait()
    for param in model.parameters():  # DP gradient average (Nanotron's DDP all-reduce)
        dist.all_reduce(param.grad, group=dp_group)
        param.grad /= dist.get_world_size(dp_group)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if pp_rank == 1:
        step_loss = torch.stack(losses).sum()
        dist.all_reduce(step_loss, group=dp_group)
        record["losses"].append((step_loss / dist.get_world_size(dp_group)).item())


def rank_main(rank: int, world: int, init_file: str, spec: str, workdir: str, resume: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    layout = ParallelLayout(world, pp=PP)  # Nanotron's rank order (TP fastest, then DP, then PP)
    info = layout.rank_info(rank)
    dp_group = create_parallel_groups(layout, ("dp",))["dp"]
    peer = info.pp_group_ranks[1 - info.pp_rank]
    model = make_stage(info.pp_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    checkpoint = os.path.join(workdir, "checkpoint")

    start, consumed = 0, 0
    if resume:  # Nanotron's load: weights and optimizer per stage, consumed_train_samples from the metadata
        with open(os.path.join(checkpoint, "metadata.json"), encoding="utf-8") as f:
            metadata = json.load(f)
        start, consumed = metadata["last_train_step"], metadata["consumed_train_samples"]
        saved = torch.load(os.path.join(checkpoint, f"pp{info.pp_rank}.pt"))
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])

    dataloader = build_nanotron_dataloader(
        spec,
        layout,
        micro_batch_size=MICRO_BATCH_SIZE,
        n_micro_batches_per_batch=N_MICRO_BATCHES,
        consumed_train_samples=consumed,
        num_workers=0 if resume else 1,  # the worker count may change across a restart
        include_sample_id=True,  # for this check only; a model taking **micro_batch wants it off
    )
    record: dict[str, list] = {"losses": [], "sample_ids": []}
    for step in range(start, STEPS):
        train_step(model, optimizer, dataloader, peer, dp_group, record)
        if not resume and step + 1 == CHECKPOINT_STEP:
            if info.dp_rank == 0:  # one copy of each stage's weights, as Nanotron writes them
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                os.makedirs(checkpoint, exist_ok=True)
                torch.save(state, os.path.join(checkpoint, f"pp{info.pp_rank}.pt"))
            if rank == 0:  # Nanotron's TrainingMetadata, written by world rank 0 only
                metadata = {"last_train_step": step + 1, "consumed_train_samples": dataloader.consumed_train_samples}
                with open(os.path.join(checkpoint, "metadata.json"), "w", encoding="utf-8") as f:
                    json.dump(metadata, f)
            dist.barrier()
    dataloader.flush()
    ids = record["sample_ids"]
    ids_per_step = [ids[i : i + N_MICRO_BATCHES] for i in range(0, len(ids), N_MICRO_BATCHES)]
    result = {"start": start, "losses": record["losses"], "sample_ids": ids_per_step}
    with open(os.path.join(workdir, f"{'resumed' if resume else 'full'}-{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def run(spec: str, workdir: str, resume: bool) -> dict[int, dict]:
    init_file = os.path.join(workdir, f"rendezvous-{'resumed' if resume else 'full'}")
    # fork: the parent has torch imported already, so each rank starts in a fraction of a second.
    mp.start_processes(rank_main, args=(WORLD, init_file, spec, workdir, resume), nprocs=WORLD, start_method="fork")
    out = {}
    for rank in range(WORLD):
        with open(os.path.join(workdir, f"{'resumed' if resume else 'full'}-{rank}.json"), encoding="utf-8") as f:
            out[rank] = json.load(f)
    return out


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="statefulset-nanotron-") as workdir:
        spec = demo_spec(os.path.join(workdir, "corpus"), documents=400, seq_length=SEQ)
        full = run(spec, workdir, resume=False)
        resumed = run(spec, workdir, resume=True)
        layout = ParallelLayout(WORLD, pp=PP)
        problems = []
        for rank in range(WORLD):
            info = layout.rank_info(rank)
            if resumed[rank]["sample_ids"] != full[rank]["sample_ids"][CHECKPOINT_STEP:]:
                problems.append(f"rank {rank} (pp {info.pp_rank}, dp {info.dp_rank}): sample ids differ")
            if resumed[rank]["losses"] != full[rank]["losses"][CHECKPOINT_STEP:]:
                problems.append(
                    f"rank {rank}: losses differ {resumed[rank]['losses']} vs {full[rank]['losses'][CHECKPOINT_STEP:]}"
                )
            # The stream layout: DP rank r, micro-batch t, row j is global position (t*W + r)*B + j.
            flat = [ids for step in full[rank]["sample_ids"] for ids in step]
            expected = [
                [(t * layout.dp + info.dp_rank) * MICRO_BATCH_SIZE + j for j in range(MICRO_BATCH_SIZE)]
                for t in range(STEPS * N_MICRO_BATCHES)
            ]
            if flat != expected:
                problems.append(f"rank {rank}: sample ids do not follow the stream layout")
        losses = " ".join(f"{loss:.4f}" for loss in full[WORLD - 1]["losses"])
        print(f"losses per step (uninterrupted): {losses}")
        consumed = CHECKPOINT_STEP * MICRO_BATCH_SIZE * N_MICRO_BATCHES * layout.dp
        if problems:
            print("nanotron_loop: MISMATCH: " + "; ".join(problems))
            return 1
        print(
            f"nanotron_loop: OK: PP{PP} x DP{layout.dp}, {STEPS} steps of {N_MICRO_BATCHES} micro-batches; "
            f"restarted at step {CHECKPOINT_STEP} from consumed_train_samples={consumed}, losses and sample ids "
            "equal the uninterrupted run exactly"
        )
        return 0


if __name__ == "__main__":
    sys.exit(main())
