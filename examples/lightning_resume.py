"""Lightning: StatefulsetDataModule + Trainer, checkpoint mid-epoch, resume with ``ckpt_path``, exact continuation.

Runs with no arguments on CPU (needs ``pip install statefulset[lightning]``). A tiny language
model trains 8 optimizer steps of 2 micro-batches each (gradient accumulation), validating every 4
micro-batches on 2 batches; ``ModelCheckpoint`` saves every 3 steps. A second Trainer resumes
from the step-3 checkpoint with another worker count and trains to step 8.

Checks: the resumed run's training sample ids are exactly the uninterrupted run's from step 3 on
(whole ordered lists), every validation pass in both runs sees the same first validation samples,
and the checkpoint's data-module entry says 24 samples consumed. Prints one verdict line; exits 1
on a mismatch.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from statefulset.integrations.lightning.datamodule import StatefulsetDataModule
from statefulset.tools.demo import demo_spec

MICRO, ACCUMULATE, STEPS, SAVE_EVERY = 4, 2, 8, 3


class TinyLM(L.LightningModule):
    """Records the sample ids it trains and validates on."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Embedding(257, 16), torch.nn.Linear(16, 257))
        self.train_ids: list[list[int]] = []
        self.val_passes: list[list[list[int]]] = []

    def training_step(self, batch, batch_idx):
        self.train_ids.append(batch["sample_id"].tolist())
        x, y = batch["text"][:, :-1], batch["text"][:, 1:]
        return torch.nn.functional.cross_entropy(self.layers(x).flatten(0, 1), y.flatten())

    def on_validation_epoch_start(self) -> None:
        self.val_passes.append([])

    def validation_step(self, batch, batch_idx):
        self.val_passes[-1].append(batch["sample_id"].tolist())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(spec: str, folder: str, num_workers: int, ckpt_path: str | None = None) -> TinyLM:
    datamodule = StatefulsetDataModule(
        spec, micro_batch_size=MICRO, global_batch_size=MICRO * ACCUMULATE, num_workers=num_workers
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        val_check_interval=4,
        limit_val_batches=2,
        callbacks=[
            ModelCheckpoint(dirpath=os.path.join(folder, "ckpt"), every_n_train_steps=SAVE_EVERY, save_top_k=-1)
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=folder,
    )
    model = TinyLM()
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    return model


def main() -> int:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    spec = demo_spec()
    with tempfile.TemporaryDirectory(prefix="statefulset-lightning-") as folder:
        full = fit(spec, folder, num_workers=1)
        checkpoint = os.path.join(folder, "ckpt", f"epoch=0-step={SAVE_EVERY}.ckpt")
        saved = torch.load(checkpoint, weights_only=False)["StatefulsetDataModule"]
        resumed = fit(spec, os.path.join(folder, "resumed"), num_workers=2, ckpt_path=checkpoint)

        cut = SAVE_EVERY * ACCUMULATE  # micro-batches before the checkpoint
        train_ok = resumed.train_ids == full.train_ids[cut:] and len(full.train_ids) == STEPS * ACCUMULATE
        first_val = full.val_passes[0]
        val_ok = all(p == first_val[: len(p)] for p in full.val_passes + resumed.val_passes) and len(first_val) == 2
        consumed_ok = saved["consumed_samples"] == cut * MICRO == saved["loader_states"][0]["batches"] * MICRO
        ok = train_ok and val_ok and consumed_ok
        print(
            f"lightning_resume: {'OK' if ok else 'MISMATCH'}: checkpoint at step {SAVE_EVERY} "
            f"(consumed_samples {saved['consumed_samples']}); resumed run trained on samples "
            f"{resumed.train_ids[0][0]}..{resumed.train_ids[-1][-1]}, "
            f"{'identical to' if train_ok else 'NOT'} the uninterrupted run's steps {SAVE_EVERY + 1}..{STEPS}; "
            f"{len(full.val_passes) + len(resumed.val_passes)} validation passes "
            f"{'all start at' if val_ok else 'do NOT all start at'} sample {first_val[0][0]}"
        )
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
