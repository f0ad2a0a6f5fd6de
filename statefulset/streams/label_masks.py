"""``loss_mask`` from loss-mask shards (CONTRACT §16): read along the very token ranges of a sample.

A source whose token shard has a mask shard beside it (:mod:`statefulset.shards.loss_masks`) holds
one uint8 per token; every packing gathers a sample's tokens as ranges of its shard, and the
same ranges of the mask shard give each token's mask, so the mask is a pure function of the
position as the tokens are (exact after a restore, in every packing, blend and stage). The
label ``text[i + 1]`` of input ``i`` has the mask of token ``i + 1``: ``loss_mask`` is the token
masks without the first column, 1 for a source without a mask shard, 0 on bestfit padding.
"""

from __future__ import annotations

from typing import Any

import numpy

from statefulset.shards import loss_masks
from statefulset.spec.splits import SPLITS


def gather_ranges(dataset: Any, starts: Any, lengths: Any, out: numpy.ndarray, masks: numpy.ndarray | None) -> None:
    """The token ranges into ``out`` and, with ``masks`` (uint8, ``out``'s shape), their masks."""
    dataset.gather(starts, lengths, out.reshape(-1))
    if masks is None:
        return
    if dataset.loss_mask is None:
        masks.fill(1)
    else:
        dataset.loss_mask.gather(starts, lengths, masks.reshape(-1))


def label_mask(token_masks: numpy.ndarray) -> numpy.ndarray:
    """float32 ``[B, S]``: the masks of the labels ``text[1:]`` (any nonzero byte counts as 1)."""
    return (token_masks[:, 1:] != 0).astype(numpy.float32)


def spec_has_masks(spec: Any) -> bool:
    """Whether any source a spec reads (any split, any stage) has a loss-mask shard: what a pipeline
    stage that opens no shard needs to know to receive ``loss_mask`` from the stage that does."""
    for split in SPLITS:
        selected = spec.blend_for(split)
        if selected is None:
            continue
        for prefix, weight in selected[0]:
            if (weight is None or weight > 0) and loss_masks.exists(prefix, spec.storage_options):
                return True
    return False


def link_fields(raw: Any, specs: Any) -> dict[str, Any]:
    """The fields a pipeline link sends; a ``loss_mask`` the batch lacks (a split without mask shards)
    goes as ones, which is what its absence means."""
    import torch

    return {
        s.name: raw[s.name] if s.name in raw or s.name != "loss_mask" else torch.ones(s.shape, dtype=s.dtype)
        for s in specs
    }
