"""How encoded micro-batches travel from a worker to the trainer: any structure, arrays in one shared block.

An encoder's batch is any nesting of dicts, lists, tuples, dataclasses, tensors, numpy arrays,
numbers and strings. The fixed-layout ring of :mod:`statefulset.loading.batches` holds it only
when it keeps the dataset's layout (the collated fields, of their shapes and dtypes, the tokens
within the ring's dtype, ``sample_id`` the positions: an encoder that changes tokens in place, as
fill-in-the-middle does); the worker then writes it into its slot (``BatchSource._send_encoded``).
Otherwise the worker copies every array and tensor of a bundle of micro-batches (as many as the
ring would bundle) into one flat uint8 tensor, made in shared memory, and sends it with the
bundle's *skeleton* (the structure, each array replaced by a :class:`Slot` naming its offset,
dtype, shape and kind) through the DataLoader's own queue: one shared-memory segment per bundle
(the cost the ring avoids is per segment, so bundling keeps it small). The trainer rebuilds the
structure with views into it, numpy arrays as numpy arrays and tensors as tensors. Arrays of a
dtype torch has no tensor for (strings, objects) travel pickled inside the skeleton. Values are
copied bit for bit: exactness holds.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any, NamedTuple

import numpy
import torch

_ALIGN = 16


class Slot(NamedTuple):
    """Where one array of a skeleton lies in the flat block."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    numpy: bool  # hand back a numpy array (else a tensor)


def _tensor_of(value: Any) -> tuple[torch.Tensor, bool] | None:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.is_sparse or value.layout != torch.strided:
            return None
        return value.detach(), False
    if isinstance(value, numpy.ndarray):
        try:
            return torch.from_numpy(numpy.ascontiguousarray(value)), True
        except TypeError:  # no torch dtype for it
            return None
    return None


class _Packer:
    def __init__(self) -> None:
        self.parts: list[tuple[int, torch.Tensor]] = []
        self.size = 0

    def walk(self, value: Any) -> Any:
        found = _tensor_of(value)
        if found is not None:
            tensor, as_numpy = found
            offset = -(-self.size // _ALIGN) * _ALIGN
            nbytes = tensor.numel() * tensor.element_size()
            self.parts.append((offset, tensor))
            self.size = offset + nbytes
            return Slot(offset, nbytes, tensor.dtype, tuple(tensor.shape), as_numpy)
        if type(value) is dict:
            return {k: self.walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.walk(v) for v in value]
        if isinstance(value, tuple) and not isinstance(value, Slot):
            items = [self.walk(v) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        if dataclasses.is_dataclass(value) and not isinstance(value, type) and hasattr(value, "__dict__"):
            return _map_dataclass(value, self.walk)
        return value


def _map_dataclass(value: Any, fn: Any) -> Any:
    copy = object.__new__(type(value))
    for name, item in vars(value).items():
        object.__setattr__(copy, name, fn(item))
    return copy


def pack(values: list[Any], shared: bool = True) -> tuple[torch.Tensor, list[Any]]:
    """The bundle's arrays in one flat uint8 tensor (in shared memory), and the skeleton of each value."""
    packer = _Packer()
    skeletons = [packer.walk(v) for v in values]
    # Made in shared memory here: torch would otherwise copy it there when it is sent.
    flat = torch.empty(-(-packer.size // _ALIGN) * _ALIGN, dtype=torch.uint8)
    if shared:
        flat.share_memory_()
    for offset, tensor in packer.parts:
        if tensor.numel():
            target = flat[offset : offset + tensor.numel() * tensor.element_size()]
            target.view(tensor.dtype).view(tensor.shape).copy_(tensor)
    return flat, skeletons


def unpack(flat: torch.Tensor, skeleton: Any) -> Any:
    """A value rebuilt from its skeleton, its arrays views into ``flat``."""
    if isinstance(skeleton, Slot):
        tensor = flat[skeleton.offset : skeleton.offset + skeleton.nbytes].view(skeleton.dtype).view(skeleton.shape)
        return tensor.numpy() if skeleton.numpy else tensor
    if type(skeleton) is dict:
        return {k: unpack(flat, v) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unpack(flat, v) for v in skeleton]
    if isinstance(skeleton, tuple):
        items = [unpack(flat, v) for v in skeleton]
        return type(skeleton)(*items) if hasattr(skeleton, "_fields") else type(skeleton)(items)
    if dataclasses.is_dataclass(skeleton) and not isinstance(skeleton, type) and hasattr(skeleton, "__dict__"):
        return _map_dataclass(skeleton, lambda item: unpack(flat, item))
    return skeleton


def pin(value: Any) -> Any:
    """Every tensor of a structure in pinned memory (numpy arrays and the rest unchanged)."""
    if isinstance(value, torch.Tensor):
        return value.pin_memory()
    if type(value) is dict:
        return {k: pin(v) for k, v in value.items()}
    if isinstance(value, list):
        return [pin(v) for v in value]
    if isinstance(value, tuple):
        items = [pin(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def received(item: tuple[Any, ...]) -> tuple[int, list[Any]]:
    """``(first micro-batch, batches)`` of an ``"encoded"`` hand-off."""
    _, _, first, count, flat, skeletons = item
    if len(skeletons) != count:
        raise ValueError(f"internal: an encoded bundle of {count} batches holds {len(skeletons)}")
    return first, [unpack(flat, s) for s in skeletons]


# The arena's header: per slot, the begin and end stamps (int64), as the ring's.
_STAMP_BYTES = 16
_ARENA_MIN = 1 << 16
_arena_numbers = itertools.count()


class Arena:
    """A worker's shared-memory slots for packed bundles, made once per pass (and again when a bundle
    outgrows them) instead of a block per bundle: a segment costs ~1 ms on each side (made, its file
    descriptor passed, mapped), a slot a copy. The block travels with the first bundle that uses it;
    later bundles name it. Slots are used as the ring's (``slots = prefetch_factor + 1``, the same
    bundle count), with the same begin/end stamps, which the trainer checks after copying a slot out."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.block: torch.Tensor | None = None
        self.slot_bytes = 0
        self.name = ""
        self._stamps: numpy.ndarray | None = None

    def _made(self, size: int) -> bool:
        """Slots of at least ``size`` bytes: True when a new block was made for them."""
        if self.block is not None and size <= self.slot_bytes:
            return False
        self.slot_bytes = -(-max(size + size // 4, _ARENA_MIN) // 4096) * 4096
        header = -(-self.slots * _STAMP_BYTES // 64) * 64
        self.block = torch.empty(header + self.slots * self.slot_bytes, dtype=torch.uint8).share_memory_()
        self._stamps = self.block[: self.slots * _STAMP_BYTES].numpy().view(numpy.int64).reshape(self.slots, 2)
        self._stamps[:] = -1
        self.name = f"{os.getpid()}.{next(_arena_numbers)}"
        return True

    def place(self, values: list[Any], slot: int, first: int) -> tuple[Any, ...]:
        """The bundle's arrays copied into ``slot``: ``(name, block or None, slot, slot_bytes, used, skeletons)``."""
        packer = _Packer()
        skeletons = [packer.walk(v) for v in values]
        made = self._made(packer.size)
        assert self.block is not None and self._stamps is not None
        self._stamps[slot, 0] = first
        base = _header(self.slots) + slot * self.slot_bytes
        for offset, tensor in packer.parts:
            if tensor.numel():
                target = self.block[base + offset : base + offset + tensor.numel() * tensor.element_size()]
                target.view(tensor.dtype).view(tensor.shape).copy_(tensor)
        self._stamps[slot, 1] = first
        return self.name, self.block if made else None, slot, self.slot_bytes, packer.size, skeletons


def _header(slots: int) -> int:
    return -(-slots * _STAMP_BYTES // 64) * 64


def from_arena(arenas: dict[int, tuple[str, torch.Tensor]], item: tuple[Any, ...], slots: int) -> tuple[int, list]:
    """``(first micro-batch, batches)`` of an ``"arena"`` hand-off, copied out of its slot (the worker
    may refill the slot once the trainer asks for more); ``arenas``: each worker's current block."""
    _, worker, first, count, name, block, slot, slot_bytes, used, skeletons = item
    if block is not None:
        arenas[worker] = (name, block)  # the worker's earlier blocks: every bundle placed there was taken
    held = arenas.get(worker)
    if held is None or held[0] != name:
        raise ValueError(f"internal: worker {worker} named arena {name}, the trainer holds {held and held[0]}")
    block = held[1]
    base = _header(slots) + slot * slot_bytes
    # numpy's copy, one thread: torch's clone of a large uint8 tensor starts intra-op threads, whose
    # waits cost the trainer several ms of CPU a bundle on a loaded machine.
    flat = torch.from_numpy(block[base : base + used].numpy().copy())
    stamps = block[: slots * _STAMP_BYTES].view(torch.int64).view(slots, 2)[slot].tolist()
    if stamps != [first, first]:
        raise ValueError(
            f"arena slot {slot} of DataLoader worker {worker} holds stamps begin={stamps[0]}, end={stamps[1]} "
            f"after the trainer copied micro-batch {first} out of it (expected {first} for both): the worker "
            f"refilled the slot during the copy, so torch {torch.__version__} prefetches more than the slots "
            "were sized for (statefulset.loading.torch_internals)"
        )
    if len(skeletons) != count:
        raise ValueError(f"internal: an encoded bundle of {count} batches holds {len(skeletons)}")
    return first, [unpack(flat, s) for s in skeletons]
