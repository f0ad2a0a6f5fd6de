"""The trainer's side of a worker hand-off: the micro-batches a note names, copied out of the ring's slot.

A worker (:mod:`statefulset.loading.batches`) sends ``("bundle", worker, slot, first, count)`` once
the slot holds the bundle, an encoded bundle out of the ring's layout as an arena slot or a packed
block (:mod:`statefulset.loading.encoded`), or an error. :func:`receive` copies the batches out before
the trainer asks for more (the worker may then refill the slot), widening ``text`` to int64, and
checks the slot's stamps afterwards (:mod:`statefulset.loading.ring`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy
import torch

from statefulset.errors import StatefulsetError
from statefulset.loading.encoded import from_arena, received
from statefulset.loading.encoded_ring import TORCH_DTYPES
from statefulset.loading.ring import BatchRing
from statefulset.streams.documents import WIRE, fields_from_wire

if TYPE_CHECKING:
    from statefulset.loading.batches import BatchSource


def _from_arena(source: BatchSource, item: tuple[Any, ...]) -> tuple[int, list[Any]]:
    """An arena hand-off's batches (statefulset.loading.encoded.Arena); the blocks held on the trainer's source."""
    arenas = source.__dict__.setdefault("_arenas", {})
    try:
        return from_arena(arenas, item, source.ring.slots)  # type: ignore[union-attr]
    except ValueError as exc:
        raise StatefulsetError(str(exc)) from None


def receive(source: BatchSource, item: Any, expected: int) -> list[Any]:
    """The trainer's batches from what a worker (or the in-process source) handed over."""
    if item[0] == "error":
        _, worker, t, message = item
        where = f"micro-batch {t}" if t is not None else "its first micro-batch"
        raise StatefulsetError(f"DataLoader worker {worker}, building {where}: {message}")
    if item[0] in ("encoded", "local", "arena"):
        if item[0] == "arena":
            t, batches = _from_arena(source, item)
        else:
            t, batches = received(item) if item[0] == "encoded" else (item[1], [item[2]])
        if t != expected:
            raise StatefulsetError(f"internal: expected micro-batch {expected}, a worker delivered {t}")
        return batches
    if item[0] == "bundle":
        _, worker, slot, t, count = item
        if t != expected:
            raise StatefulsetError(f"internal: expected micro-batch {expected}, worker {worker} delivered {t}")
        ring: BatchRing = source.ring  # type: ignore[assignment]
        view = ring.view(worker, slot)
        batches: list[dict[str, torch.Tensor]] = [{} for _ in range(count)]
        for name, array in view.items():
            if name == WIRE:  # the document fields, computed here from their pieces
                _receive_documents(source, (worker, slot), batches, array[:count], t)
                continue
            # Copied out of the slot now (text widened to int64): the worker may refill it once we
            # ask for more.
            dtype = torch.int64 if name == "text" else TORCH_DTYPES[array.dtype]
            values = torch.empty((count, *array.shape[1:]), dtype=dtype)
            values.numpy()[:] = array[:count]
            for batch, value in zip(batches, values.unbind(0), strict=True):
                batch[name] = value
        ring.check(worker, slot, t)
    else:
        t, arrays = item
        count, batches = 1, [{name: torch.from_numpy(value) for name, value in arrays.items()}]
    if t != expected:
        raise StatefulsetError(f"internal: expected micro-batch {expected}, a worker delivered {t}")
    for i, batch in enumerate(batches):
        batch["sample_id"] = torch.from_numpy(source.cursor.positions(t + i))
    return batches


def _receive_documents(
    source: BatchSource, where: tuple[int, int], batches: list[dict[str, torch.Tensor]], wire: numpy.ndarray, t: int
) -> None:
    """``cu_seqlens``, ``max_seqlen`` and ``position_ids`` of the bundle's batches, from the pieces in
    slot ``where`` (worker, slot): one kernel call writes them, in place of three copies out of the slot."""
    count, rows, seq_length = wire.shape[0], wire.shape[1], source.stream.seq_length
    made = {
        "cu_seqlens": torch.empty((count, rows, seq_length + 1), dtype=torch.int32),
        "max_seqlen": torch.empty((count, rows), dtype=torch.int32),
        "position_ids": torch.empty((count, rows, seq_length), dtype=torch.int64),
    }
    try:
        fields_from_wire(wire, seq_length, {k: v.numpy() for k, v in made.items()}, lambda i: source.positions(t + i))
    except StatefulsetError:
        source.ring.check(*where, t)  # type: ignore[union-attr]  # a torn slot says so first
        raise
    for name, values in made.items():
        for batch, value in zip(batches, values.unbind(0), strict=True):
            batch[name] = value
