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
