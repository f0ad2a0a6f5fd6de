"""Quickstart: shards → a YAML spec → a savable loader → save mid-way → restore → the same next batches.

Runs with no arguments on CPU in a temporary folder.
"""

from __future__ import annotations

import os
import tempfile

import torch

from statefulset import WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.tools.demo import demo_spec


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="statefulset-quickstart-") as folder:
        # The built-in corpus: two byte-tokenised shards (blend 0.7 / 0.3) and a YAML spec.
        spec = demo_spec(folder, packing="native", seq_length=256)
        with open(spec, encoding="utf-8") as f:
            print(f.read().strip())

        def make_loader(num_workers: int):
            wc = WorkerConfig(rank=0, world_size=1, num_workers=num_workers)
            return get_savable_loader(get_train_dataset(spec, batch_size=4, worker_config=wc))

        loader = make_loader(num_workers=2)
        steps = 10
        for _, batch in zip(range(steps), loader, strict=False):
            assert batch["text"].shape == (4, 257) and batch["text"].dtype == torch.int64
        state = loader.save_state_rank()
        torch.save(state, os.path.join(folder, "loader.pt"))
        expected = [b["sample_id"].tolist() for _, b in zip(range(3), loader, strict=False)]

        resumed = make_loader(num_workers=1)  # a different worker count is fine
        resumed.restore_state_rank(torch.load(os.path.join(folder, "loader.pt")))
        got = [b["sample_id"].tolist() for _, b in zip(range(3), resumed, strict=False)]
        print(f"state after {steps} steps: {len(repr(state))} bytes; next sample ids {got}")
        assert got == expected, (got, expected)
        print("quickstart: resumed on exactly the next samples")


if __name__ == "__main__":
    main()
