"""Plain DDP under torchrun: train, checkpoint the model and the loader, crash, resume on the next sample.

The most common case, as a job runs it (CPU and gloo here; use "nccl" and .cuda() on GPUs)::

    torchrun --standalone --nproc-per-node 2 examples/ddp_checkpoint_resume.py --spec dataset.yaml \\
        --checkpoint ckpt --steps 8 --save-every 4          # trains, checkpoints at steps 4 and 8
    torchrun --standalone --nproc-per-node 2 examples/ddp_checkpoint_resume.py --spec dataset.yaml \\
        --checkpoint ckpt --steps 12 --save-every 4          # finds ckpt/latest: resumes after step 8

A checkpoint is a folder ``ckpt/step_<N>/``: ``model.pt`` (model and optimizer, written by rank 0)
and ``loader_rank<r>.pt`` (each rank's ``loader.save_state_rank()``, ~300 bytes), then
``ckpt/latest`` naming it, written by rank 0 after a barrier, so a crash mid-save leaves the
previous checkpoint in force. On start, a rank that finds ``ckpt/latest`` loads the model and
its own loader state (``restore_state_rank``) before its first batch: the next batch holds
exactly the samples that come after the last checkpointed step. ``--record FILE`` appends, per
step, the step, the rank and the batch's ``sample_id`` values as JSON lines;
``--crash-after N`` SIGKILLs every rank after step N (a lost job).

With no arguments, it runs the whole story and checks it: an uninterrupted run of 8 steps; a run
that checkpoints at step 4 and is killed after step 6; a resumed run to step 8. The resumed steps
5..8 must see the samples of the uninterrupted run's steps 5..8 and end with the same weights.
Prints one verdict line; exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

BATCH = 4
VOCAB = 512  # the demo corpus is bytes (ids 0..256)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spec", required=True, help="the dataset spec (YAML)")
    p.add_argument("--checkpoint", required=True, help="the checkpoint folder (resumes from it when it has one)")
    p.add_argument("--steps", type=int, required=True, help="train until this step")
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--record", help="append each step's sample ids here (JSON lines)")
    p.add_argument("--crash-after", type=int, help="SIGKILL every rank after this step")
    return p.parse_args(argv)


def save(folder: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, loader) -> None:
    """Every rank saves its loader state, rank 0 the model; ``latest`` moves only when all are written."""
    target = os.path.join(folder, f"step_{step}")
    os.makedirs(target, exist_ok=True)
    rank = dist.get_rank()
    _atomic_save(loader.save_state_rank(), os.path.join(target, f"loader_rank{rank}.pt"))
    if rank == 0:
        _atomic_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                     os.path.join(target, "model.pt"))  # fmt: skip
    dist.barrier()
    if rank == 0:
        with open(os.path.join(folder, "latest.tmp"), "w") as f:
            f.write(f"step_{step}\n")
        os.replace(os.path.join(folder, "latest.tmp"), os.path.join(folder, "latest"))
    dist.barrier()


def _atomic_save(obj, path: str) -> None:
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def resume(folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, loader) -> int:
    """The step of the last checkpoint (0 with none); model, optimizer and loader restored from it."""
    try:
        with open(os.path.join(folder, "latest")) as f:
            target = os.path.join(folder, f.read().strip())
    except FileNotFoundError:
        return 0
    saved = torch.load(os.path.join(target, "model.pt"))
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    loader.restore_state_rank(torch.load(os.path.join(target, f"loader_rank{dist.get_rank()}.pt")))
    return saved["step"]


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))  # torchrun set the rendezvous
    rank = dist.get_rank()
    wc = WorkerConfig(rank=rank, world_size=dist.get_world_size(), num_workers=args.num_workers)
    loader = get_savable_loader(get_train_dataset(args.spec, batch_size=BATCH, worker_config=wc))
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = resume(args.checkpoint, model.module, optimizer, loader)  # before the first batch
    batches = iter(loader)
    while step < args.steps:
        batch = next(batches)
        step += 1
        tokens = batch["text"]
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.record:
            with open(args.record, "a") as f:
                f.write(json.dumps({"step": step, "rank": rank, "samples": batch["sample_id"].tolist()}) + "\n")
        if step % args.save_every == 0:
            save(args.checkpoint, step, model.module, optimizer, loader)
        if step == args.crash_after:
            os.kill(os.getpid(), signal.SIGKILL)  # a lost job: nothing after the last checkpoint survives
    dist.destroy_process_group()


def torchrun(logs: str, *args: str) -> int:
    """The script under torchrun on 2 ranks; torchrun's logs in ``logs`` (else it leaves a folder in $TMPDIR)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--log-dir", logs, os.path.abspath(__file__), *args]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks with it
        proc.communicate()
        raise RuntimeError(f"torchrun {' '.join(args)}: still running after 600 s") from None
    if proc.returncode != 0 and "--crash-after" not in args:
        sys.stderr.write(err.decode(errors="replace")[-4000:])
    return proc.returncode


def steps(record: str) -> dict[tuple[int, int], list[int]]:
    with open(record) as f:
        return {(r["step"], r["rank"]): r["samples"] for r in map(json.loads, f)}


def demonstrate() -> int:
    from statefulset.tools.demo import demo_spec

    spec = demo_spec()  # the built-in corpus, written once before any rank starts
    with tempfile.TemporaryDirectory(prefix="statefulset-ddp-") as tmp:
        ref, run = (os.path.join(tmp, n) for n in ("reference", "run"))
        logs = os.path.join(tmp, "torchrun-logs")
        common = ["--spec", spec, "--steps", "8", "--save-every", "4"]
        assert torchrun(logs, *common, "--checkpoint", ref, "--record", ref + ".jsonl") == 0, "the reference run failed"
        crashed = torchrun(logs, *common, "--checkpoint", run, "--record", run + ".jsonl", "--crash-after", "6")
        assert crashed != 0, "the crashing run did not crash"
        assert torchrun(logs, *common, "--checkpoint", run, "--record", run + ".jsonl") == 0, "the resumed run failed"
        want, got = steps(ref + ".jsonl"), steps(run + ".jsonl")  # the resumed run rewrote steps 5 and 6
        weights = [torch.load(os.path.join(d, "step_8", "model.pt"))["model"] for d in (ref, run)]
        same_weights = all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
        ok = got == want and same_weights
        first = want[(5, 0)] + want[(5, 1)]
        print(f"ddp_checkpoint_resume: {'OK' if ok else 'MISMATCH'}: 2 ranks checkpointed at step 4, killed after "
              f"step 6, resumed from step 4 with samples {sorted(first)[0]}..{sorted(first)[-1]}; steps 5-8 saw "
              f"the samples of the uninterrupted run and ended with {'the same' if same_weights else 'other'} "
              f"weights")  # fmt: skip
        return 0 if ok else 1


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # started by torchrun
        train(parse())
    else:
        sys.exit(demonstrate())
