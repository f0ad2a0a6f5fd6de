"""Fill-in-the-middle that resumes exactly: save on 2 DP ranks, resume on 3 with another worker count.

Runs with no arguments on CPU, in one process (each DP rank's loader is built here with its own
``WorkerConfig``; in a real job each rank builds its own, and ``save_state_global`` gathers them):

1. The uninterrupted run: DP1, no workers, the built-in corpus packed by bestfit with document
   boundaries, Megatron-LM's FIM (``FillInTheMiddle``: rate 0.5, SPM 0.5, split at the byte
   tokenizer's EOD 256, sentinels 257-259, pad 260) as the task encoder.
2. DP2, 1 worker per rank: 3 steps, then each rank's state is saved.
3. DP3, 2 workers per rank: every rank restores from both states and takes 2 steps.

Every sample of the resumed run must be the uninterrupted run's sample at the same position, FIM
and all: ``text``, ``loss_mask``, ``cu_seqlens`` and ``position_ids`` bit for bit, nothing lost,
nothing repeated. Prints one verdict line and exits 1 otherwise.
"""

from __future__ import annotations

import sys

import torch

from statefulset import WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.tools.demo import demo_spec
from statefulset.transforms import FillInTheMiddle

BATCH = 4
SAVE_AT = 3  # DP2 steps before the save
AFTER = 2  # DP3 steps after the restore
FIELDS = ("text", "loss_mask", "cu_seqlens", "position_ids")
PREFIX, MIDDLE, SUFFIX, PAD = 257, 258, 259, 260  # above the byte tokenizer's 0-256


def loader(spec: str, rank: int, world: int, workers: int):
    fim = FillInTheMiddle(0.5, 0.5, PREFIX, MIDDLE, SUFFIX, PAD, eod_id=256)
    wc = WorkerConfig(rank=rank, world_size=world, num_workers=workers)
    ds = get_train_dataset(spec, batch_size=BATCH, worker_config=wc, task_encoder=fim, document_boundaries=True)
    return get_savable_loader(ds)


def rows(batches: list[dict]) -> dict[int, dict[str, torch.Tensor]]:
    """Each sample of the batches by its position."""
    out = {}
    for batch in batches:
        for j, position in enumerate(batch["sample_id"].tolist()):
            out[position] = {name: batch[name][j] for name in FIELDS}
    return out


def take(it, steps: int) -> list[dict]:
    return [next(it) for _ in range(steps)]


def main() -> int:
    spec = demo_spec(packing="bestfit")
    dp2 = [loader(spec, rank, 2, workers=1) for rank in range(2)]
    its = [iter(each) for each in dp2]
    for it in its:
        take(it, SAVE_AT)  # "training"
    states = [each.save_state_rank() for each in dp2]
    del its, dp2

    resumed: dict[int, dict[str, torch.Tensor]] = {}
    for rank in range(3):
        dp3 = loader(spec, rank, 3, workers=2)
        dp3.restore_state_global(states)
        resumed.update(rows(take(iter(dp3), AFTER)))
        del dp3

    first, count = SAVE_AT * 2 * BATCH, AFTER * 3 * BATCH
    reference = rows(take(iter(loader(spec, 0, 1, workers=0)), (first + count) // BATCH))
    expected = list(range(first, first + count))
    same = sorted(resumed) == expected and all(
        torch.equal(resumed[p][name], reference[p][name]) for p in expected for name in FIELDS
    )
    fimmed = sum(int((resumed[p]["text"] == PREFIX).any()) for p in expected)
    print(
        f"fim_resume: {'OK' if same else 'MISMATCH'}: DP2 (1 worker/rank) saved after {first} samples; "
        f"DP3 (2 workers/rank) resumed with samples {expected[0]}..{expected[-1]}, {fimmed} of {count} "
        "holding FIM'd documents; text, loss_mask, cu_seqlens and position_ids identical to the "
        "uninterrupted DP1 run's"
    )
    return 0 if same and fimmed else 1


if __name__ == "__main__":
    sys.exit(main())
