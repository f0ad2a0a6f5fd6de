"""Quickstart: shards → a YAML spec → a savable loader → save mid-way → restore → the same next batches.

Runs with no arguments on CPU in a temporary folder.
"""

from __future__ import annotations

import os
import tempfile

import numpy
import torch
import yaml

from statefulset import IndexedDatasetWriter, WorkerConfig, get_savable_loader, get_train_dataset


def main() -> None:
    folder = tempfile.mkdtemp(prefix="statefulset-quickstart-")
    rng = numpy.random.default_rng(0)
    for name in ("web", "code"):  # two tiny corpora of random token ids
        with IndexedDatasetWriter(os.path.join(folder, f"{name}_text_document")) as writer:
            for _ in range(500):
                writer.add_document(rng.integers(0, 50000, int(rng.geometric(1 / 200))))
    spec = os.path.join(folder, "dataset.yaml")
    with open(spec, "w") as f:
        yaml.safe_dump(
            {
                "data_path": {"web_text_document": 0.7, "code_text_document": 0.3},
                "seq_length": 256,
                "split": "98,2,0",
                "packing": "native",  # or megatron (add num_samples for a weighted blend)
            },
            f,
        )

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
