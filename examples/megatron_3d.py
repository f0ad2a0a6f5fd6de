"""Megatron-style 3D training (TP2 x PP2 x DP2 on 8 CPU gloo ranks) that crashes, restarts and matches.

Runs with no arguments. It spawns 8 ranks, each with Megatron's default rank order, and trains a
tiny language model split over 2 pipeline stages:

- stage 0: token + position embeddings (replicated over TP);
- stage 1: a TP-sharded MLP (column-parallel, then row-parallel with a TP all-reduce) and an
  output head, cross-entropy with the loss mask.

Activations go forward and their gradients back with point-to-point sends; gradients are averaged
over the DP group. Data: ``build_megatron_iterators`` on every rank and ``get_batch`` once per
micro-batch, exactly where Megatron-LM calls its own (TP rank 0 of the first stage reads and
broadcasts; the last stage receives its labels from the first stage of its pipeline).

Three runs: an uninterrupted one; one that checkpoints after iteration 4 the way Megatron-LM does
(model and optimizer per TP/PP rank from DP rank 0, ``consumed_train_samples`` in the checkpoint,
one ``train_dataloader_dprankNNN.pt`` per DP rank from TP rank 0 of the first stage) and then dies;
and a restart from that checkpoint in fresh processes. The restarted losses and sample ids must
equal the uninterrupted run's exactly. Prints one verdict line; exits 1 on a mismatch.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from statefulset import ParallelLayout
from statefulset.integrations.megatron.batch import GPTBatchConfig
from statefulset.integrations.megatron.builder import build_megatron_iterators
from statefulset.integrations.megatron.state_files import load_megatron_dataloader_state, save_megatron_dataloader_state
from statefulset.parallel.groups import create_parallel_groups
from statefulset.tools.demo import demo_spec

WORLD, TP, PP = 8, 2, 2
MICRO_BATCH, MICRO_BATCHES, SEQ = 2, 2, 64  # global batch = 2 x 2 DP x 2 micro-batches = 8 samples
ITERATIONS, CRASH_AFTER = 8, 4
VOCAB, HIDDEN, FFN = 257, 32, 64  # byte tokens + EOD 256 (the demo corpus)
ACT_TAG = 7  # our activation sends; the loader's stage link uses its own tag


# -- tensor-parallel building blocks (Megatron's f and g) ------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient over TP (each shard saw all of the input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (sum the row-parallel partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class FirstStage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.positions = torch.nn.Embedding(SEQ, HIDDEN)

    def forward(self, tokens, position_ids):
        return self.tokens(tokens) + self.positions(position_ids)


class LastStage(torch.nn.Module):
    """A TP-sharded MLP block and a (replicated) output head."""

    def __init__(self, tp_group) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.up = torch.nn.Linear(HIDDEN, FFN // TP)  # column-parallel shard
        self.down = torch.nn.Linear(FFN // TP, HIDDEN, bias=False)  # row-parallel shard
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, hidden):
        x = _CopyToTP.apply(hidden, self.tp_group)
        x = _ReduceFromTP.apply(self.down(F.gelu(self.up(x))), self.tp_group)
        return self.head(hidden + x)


def _model(info, groups):
    # Same seed per (TP, PP) rank on every DP rank: DP replicas start equal, TP shards differ.
    torch.manual_seed(1000 + 10 * info.pp_rank + info.tp_rank)
    model = FirstStage() if info.pp_rank == 0 else LastStage(groups["tp"])
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


# -- one training iteration: every micro-batch forward and backward, then the DP all-reduce --------
def _iteration(model, optimizer, data, info, groups):
    last, peer = info.is_last_stage, info.pp_group_ranks[-1 if info.pp_rank == 0 else 0]
    optimizer.zero_grad()
    losses, sample_ids = [], []
    for _ in range(MICRO_BATCHES):
        batch = data.get_batch()  # one call per micro-batch, as Megatron's forward_step
        if not last:
            hidden = model(batch.tokens, batch.position_ids)
            dist.send(hidden.detach().contiguous(), dst=peer, tag=ACT_TAG)
            grad = torch.empty_like(hidden)
            dist.recv(grad, src=peer, tag=ACT_TAG)
            hidden.backward(grad)
            sample_ids.append(batch.sample_id)
        else:
            hidden = torch.empty(MICRO_BATCH, SEQ, HIDDEN)
            dist.recv(hidden, src=peer, tag=ACT_TAG)
            hidden.requires_grad_(True)
            logits = model(hidden)
            losses_per_token = F.cross_entropy(logits.reshape(-1, VOCAB), batch.labels.reshape(-1), reduction="none")
            mask = batch.loss_mask.reshape(-1)
            loss = (losses_per_token * mask).sum() / mask.sum()
            (loss / MICRO_BATCHES).backward()
            dist.send(hidden.grad.contiguous(), dst=peer, tag=ACT_TAG)
            losses.append(loss.detach())
    for param in model.parameters():  # DP gradient all-reduce (average)
        dist.all_reduce(param.grad, group=groups["dp"])
        param.grad /= info.dp_size
    optimizer.step()
    if last:
        loss = torch.stack(losses).mean()
        dist.all_reduce(loss, group=groups["dp"])
        return float(loss) / info.dp_size, []
    return None, [ids.tolist() for ids in sample_ids]


def _rank(rank: int, spec: str, folder: str, phase: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/rendezvous-{phase}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    layout = ParallelLayout(WORLD, tp=TP, pp=PP)  # Megatron's default order tp-cp-ep-dp-pp
    info = layout.rank_info(rank)
    groups = create_parallel_groups(layout, ("dp", "tp", "pp"), backend="gloo")
    batch_config = GPTBatchConfig(eod_token=256, eod_mask_loss=True, reset_position_ids=True)
    ckpt = os.path.join(folder, "checkpoints")
    common = {"micro_batch_size": MICRO_BATCH, "batch_config": batch_config, "num_workers": 0, "groups": groups}
    runs = ("reference", "interrupted") if phase == "first" else ("restart",)
    for run in runs:
        model, optimizer = _model(info, groups)
        start, consumed, state = 0, 0, None
        if run == "restart":
            # What Megatron-LM's load_checkpoint + a train_valid_test_datasets_provider do.
            with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
                start = int(f.read())
            saved = torch.load(_model_file(ckpt, start, info), weights_only=True)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            consumed = saved["args"]["consumed_train_samples"]
            if info.loads_data:  # first stage: this DP rank's loader file
                state = load_megatron_dataloader_state(ckpt, start, info.dp_rank, pipeline_parallel=PP > 1)
        data = build_megatron_iterators(
            spec, layout, rank, consumed_train_samples=consumed, state=state, valid=False, test=False, **common
        )
        record = []
        for iteration in range(start, ITERATIONS):
            loss, ids = _iteration(model, optimizer, data, info, groups)
            consumed += MICRO_BATCH * info.dp_size * MICRO_BATCHES
            record.append((loss, ids))
            if run == "interrupted" and iteration + 1 == CRASH_AFTER:
                _checkpoint(ckpt, iteration + 1, model, optimizer, data, info, consumed, groups)
                break
        data.flush()
        torch.save(record, os.path.join(folder, f"{run}-{rank}.pt"))
    dist.barrier()
    if phase == "first":
        os._exit(0)  # the "crash": no cleanup, no process-group shutdown; everything in memory is gone
    dist.destroy_process_group()


def _model_file(ckpt, iteration, info):
    return os.path.join(ckpt, f"iter_{iteration:07d}", f"mp_rank_{info.tp_rank:02d}_{info.pp_rank:03d}", "model.pt")


def _checkpoint(ckpt, iteration, model, optimizer, data, info, consumed, groups):
    """Megatron-LM's save_checkpoint, reduced: DP rank 0 writes each (TP, PP) shard; loaders per DP rank."""
    if info.dp_rank == 0:
        path = _model_file(ckpt, iteration, info)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        args = {"consumed_train_samples": consumed}
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "args": args}, path)
    if info.saves_state:  # maybe_save_dataloader_state: first stage, TP rank 0, one file per DP rank
        save_megatron_dataloader_state(data.train, ckpt, iteration, info.dp_rank, pipeline_parallel=PP > 1)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def _gather(folder, run):
    """Per iteration: the global loss (last stage) and the sample ids of every DP rank (first stage, TP 0)."""
    layout = ParallelLayout(WORLD, tp=TP, pp=PP)
    records = {rank: torch.load(os.path.join(folder, f"{run}-{rank}.pt")) for rank in range(WORLD)}
    losses = [loss for loss, _ in records[layout.groups("pp")[0][-1]]]
    ids = {}
    for rank, record in records.items():
        info = layout.rank_info(rank)
        if info.saves_state:
            ids[info.dp_rank] = [step_ids for _, step_ids in record]
    return losses, ids


def main() -> int:
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="statefulset-megatron3d-") as folder:
        spec = demo_spec(os.path.join(folder, "corpus"), seq_length=SEQ)
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        for phase in ("first", "restart"):
            mp.start_processes(_rank, args=(spec, folder, phase), nprocs=WORLD, join=True, start_method=method)
        ref_losses, ref_ids = _gather(folder, "reference")
        cut_losses, _ = _gather(folder, "interrupted")
        new_losses, new_ids = _gather(folder, "restart")
        ok = (
            len(ref_losses) == ITERATIONS
            and cut_losses == ref_losses[:CRASH_AFTER]
            and new_losses == ref_losses[CRASH_AFTER:]
            and all(new_ids[dp] == ref_ids[dp][CRASH_AFTER:] for dp in ref_ids)
            and ref_losses[-1] < ref_losses[0]
        )
        samples = sum(len(ids) for dp in new_ids.values() for step in dp for ids in step)
        verdict = "PASS" if ok else "FAIL"
        print(
            f"megatron_3d: {verdict}: TP{TP} PP{PP} DP{WORLD // (TP * PP)} on {WORLD} gloo ranks, loss "
            f"{ref_losses[0]:.3f} -> {ref_losses[-1]:.3f} over {ITERATIONS} iterations; crash after iteration "
            f"{CRASH_AFTER}, restart reproduced {len(new_losses)} losses and {samples} sample ids "
            f"{'exactly' if ok else 'WITH DIFFERENCES'} ({time.perf_counter() - began:.1f} s)"
        )
        if not ok:
            print(f"  reference losses {ref_losses}\n  restarted losses {new_losses}", file=sys.stderr)
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
