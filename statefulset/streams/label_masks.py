"""``loss_mask`` from loss-mask shards (CONTRACT §16): read along the very token ranges of a sample.

A source whose token shard has a mask shard beside it (:mod:`statefulset.shards.loss_masks`) holds
one uint8 per token; every packing gathers a sample's tokens as ranges of its shard, and the
same ranges of the mask shard give each token's mask, so the mask is a pure function of the
position as the tokens are (exact after a restore, in every packing, blend and stage). The
label ``text[i + 1]`` of input ``i`` has the mask of token ``i + 1``: ``loss_mask`` is the token
masks without the first column, 1 for a source without a mask shard, 0 on bestfit padding.

Both are copied in one pass (:func:`gather_ranges`): the compiled kernel walks the planned ranges
once, reading the token shard's and the mask shard's memory maps at the same offsets, and writes
the float32 ``loss_mask`` directly (no second plan, no uint8 intermediate); the numpy version gives
the same arrays.
"""

from __future__ import annotations

from typing import Any

import numpy

from statefulset.index import compiled
from statefulset.shards import loss_masks
from statefulset.shards.loss_masks import MASK_DTYPE
from statefulset.spec.splits import SPLITS

# The integer dtypes the fused kernel reads and writes, by its kind numbers (kernels.c, SF_KINDS).
_KINDS = {
    numpy.dtype(t): k
    for k, t in enumerate((numpy.uint8, numpy.int8, numpy.int16, numpy.uint16, numpy.int32, numpy.int64))
}
_FLOAT32 = numpy.dtype(numpy.float32)
_HEADER = 10  # values before the ranges in the kernel's arguments (kernels.c, SF_HEADER)
_BOUNDS = {dtype: (int(numpy.iinfo(dtype).min), int(numpy.iinfo(dtype).max)) for dtype in _KINDS}


def gather_ranges(
    dataset: Any,
    starts: Any,
    lengths: Any,
    out: numpy.ndarray,
    labels: numpy.ndarray | None,
    used: Any = None,
    pad_id: int = 0,
    native: bool | None = None,
) -> None:
    """Rows of ``out`` (``[rows, width]``) from the token ranges (``starts``, ``lengths``: Python ints
    or int64 arrays), which fill row r's first ``used[r]`` tokens (all of them without ``used``),
    ``pad_id`` after; with ``labels`` (float32 ``[rows, width - 1]``, C-contiguous), the rows'
    ``loss_mask`` along the same ranges of the dataset's mask shard (1 without one, 0 on padding).

    With ``labels``, one compiled pass over the ranges copies both, tokens and masks, from the
    shards' memory maps (``native`` as in :func:`compiled.pick`); the numpy version (remote shards,
    no kernels, dtypes the kernel does not take, ranges it refuses) gives the same arrays, and the
    error messages.
    """
    if labels is not None and _gather_compiled(dataset, starts, lengths, out, labels, used, pad_id, native):
        return
    if used is None:
        dataset.gather(starts, lengths, out.reshape(-1))
    else:
        real = numpy.empty(sum(used), dtype=out.dtype)
        dataset.gather(starts, lengths, real)
        kept = numpy.arange(out.shape[1])[None, :] < numpy.asarray(used, dtype=numpy.int64)[:, None]
        out[...] = pad_id
        out[kept] = real
    if labels is not None:
        _fill_labels_numpy(dataset.loss_mask, starts, lengths, labels, used)


def _gather_compiled(
    dataset: Any, starts: Any, lengths: Any, out: numpy.ndarray, labels: numpy.ndarray, used: Any, pad_id: int,
    native: bool | None,
) -> bool:  # fmt: skip
    """:func:`gather_ranges` by the fused kernel; False (nothing written) where it does not apply."""
    lib = compiled.pick(native)
    shard = dataset.loss_mask
    if lib is None or not labels.flags.c_contiguous or not out.flags.c_contiguous:
        return False
    tokens, mask = dataset.mapped_address, 0 if shard is None else shard.mapped_address
    src_kind, dst_kind = _KINDS.get(dataset.dtype), _KINDS.get(out.dtype)
    if not tokens or mask is None or (shard is not None and not mask) or src_kind is None or dst_kind is None:
        return False
    low, high = _BOUNDS[out.dtype]
    if used is not None and not low <= pad_id <= high:  # numpy refuses it, C would wrap it
        return False
    rows, width = out.shape
    if labels.shape != (rows, width - 1) or labels.dtype != _FLOAT32:
        return False
    to, to_labels = compiled.writable_address(out), compiled.writable_address(labels)
    if to is None or to_labels is None:
        return False
    count, with_used = len(starts), used is not None
    if len(lengths) != count or (with_used and len(used) != rows):  # the numpy version names the shard
        return False
    header = [count, with_used, rows, width, src_kind, dataset.num_tokens, dst_kind, pad_id, tokens, mask]
    # The kernel's arguments, written into this thread's block (compiled.scratch): a new array per
    # batch, and reading its address, cost ~3 µs more.
    block, address = compiled.scratch(_HEADER + 2 * count + (rows if with_used else 0))
    block[:_HEADER] = header
    block[_HEADER : _HEADER + count] = starts
    block[_HEADER + count : _HEADER + 2 * count] = lengths
    if with_used:
        block[_HEADER + 2 * count : _HEADER + 2 * count + rows] = used
    if lib.sf_gather_masked(address, to, to_labels) != 0:
        return False
    # Never a row of another version of either file (a stat each after the copy, as every gather).
    dataset.bin_file.check_read()
    if shard is not None:
        shard.bin_file.check_read()
    return True


def _fill_labels_numpy(shard: Any, starts: Any, lengths: Any, labels: numpy.ndarray, used: Any) -> None:
    rows, width = labels.shape[0], labels.shape[1] + 1
    used_rows = None if used is None else numpy.asarray(used, dtype=numpy.int64)
    token_masks = numpy.empty(rows * width if used_rows is None else int(used_rows.sum()), dtype=MASK_DTYPE)
    if shard is None:
        token_masks.fill(1)
    else:
        shard.gather(starts, lengths, token_masks)
    if used_rows is None:
        grid = token_masks.reshape(rows, width)
    else:  # padding is never a label with loss
        grid = numpy.zeros((rows, width), dtype=MASK_DTYPE)
        grid[numpy.arange(width)[None, :] < used_rows[:, None]] = token_masks
    labels[...] = label_mask(grid)


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
