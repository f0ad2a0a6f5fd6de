"""Best-fit packing with document boundaries: whole documents, FlashAttention varlen inputs, exact resume.

Runs with no arguments on CPU in a temporary folder: packs the built-in corpus with
``packing: bestfit``, turns a batch's per-row ``cu_seqlens`` into the one flat ``cu_seqlens`` a
varlen attention kernel takes, checks that no label is padding where ``loss_mask`` is 1, then
saves mid-way and resumes on exactly the next batches with another worker count.
"""

from __future__ import annotations

import tempfile

import torch

from statefulset import WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.tools.demo import demo_spec


def varlen_inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Tokens as one packed row and the flat cu_seqlens / max_seqlen of flash_attn_varlen_func."""
    tokens = batch["text"][:, :-1]
    rows, seq = tokens.shape
    cu = batch["cu_seqlens"].to(torch.int64)
    # Row r's ends, shifted by r * seq; the padding entries (== seq) repeat a row's end: drop them.
    ends = (cu[:, 1:] + torch.arange(rows)[:, None] * seq).reshape(-1)
    keep = torch.ones_like(ends, dtype=torch.bool)
    keep[1:] = ends[1:] != ends[:-1]
    flat = torch.cat([torch.zeros(1, dtype=torch.int64), ends[keep]]).to(torch.int32)
    return tokens.reshape(1, -1), flat, int(batch["max_seqlen"].max())


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="statefulset-bestfit-") as folder:
        spec = demo_spec(folder, packing="bestfit", seq_length=256)

        def make_loader(num_workers: int):
            wc = WorkerConfig(rank=0, world_size=1, num_workers=num_workers)
            dataset = get_train_dataset(spec, batch_size=4, worker_config=wc, document_boundaries=True)
            return get_savable_loader(dataset)

        loader = make_loader(num_workers=2)
        padding = slots = 0
        for _, batch in zip(range(20), loader, strict=False):
            assert set(batch) == {"text", "sample_id", "loss_mask", "cu_seqlens", "max_seqlen", "position_ids"}
            labels = batch["text"][:, 1:]
            assert bool((labels[batch["loss_mask"] == 1] != -1).all())  # loss only on real tokens
            tokens, cu_seqlens, max_seqlen = varlen_inputs(batch)
            assert int(cu_seqlens[-1]) == tokens.numel() and max_seqlen <= 256
            padding += int((batch["text"] == -1).sum())
            slots += batch["text"].numel()
        print(f"20 batches: {padding / slots:.2%} padding; last batch {cu_seqlens.numel() - 1} varlen segments")

        state = loader.save_state_rank()
        expected = [b["sample_id"].tolist() for _, b in zip(range(3), loader, strict=False)]
        resumed = make_loader(num_workers=1)
        resumed.restore_state_rank(state)
        got = [b["sample_id"].tolist() for _, b in zip(range(3), resumed, strict=False)]
        assert got == expected, (got, expected)
        print("packing_bestfit: resumed on exactly the next samples")


if __name__ == "__main__":
    main()
