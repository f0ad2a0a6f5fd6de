"""Small per-rank payloads over a process group, in fixed slots: gather to one rank, scatter from one.

``gather_object`` / ``broadcast_object_list`` are the obvious tools and the wrong ones at scale:
``gather_object`` first all-gathers every rank's payload size (each of W ranks receives W sizes,
W² in all), and broadcasting the list of every rank's state to every rank moves W² states
(at 16k DP ranks and ~400 B per state, 100 GB). A loader state is small and bounded, so each
rank's payload travels in a fixed slot of ``SLOT`` bytes (a 4-byte length, then the bytes):
one ``gather`` (W slots arrive at one rank) or one ``scatter`` (each rank receives its own
slot), O(W) bytes in all, no size exchange.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from statefulset.errors import StatefulsetError

SLOT = 4096  # bytes per rank; a state is ~300-600 bytes of msgpack


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pack(data: bytes, device: torch.device) -> torch.Tensor:
    if len(data) > SLOT - 4:
        raise StatefulsetError(f"a payload of {len(data)} bytes exceeds the {SLOT - 4}-byte slot of a loader state")
    slot = torch.zeros(SLOT, dtype=torch.uint8)
    slot[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
    if data:
        slot[4 : 4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return slot.to(device)


def _unpack(slot: torch.Tensor) -> bytes:
    raw = slot.cpu().numpy().tobytes()
    size = int.from_bytes(raw[:4], "little")
    if size > SLOT - 4:
        raise StatefulsetError(f"a received slot claims {size} bytes, more than the slot holds")
    return raw[4 : 4 + size]


def gather_bytes(data: bytes, dst: int, group: Any = None) -> list[bytes] | None:
    """Every rank's ``data`` at global rank ``dst`` (in group-rank order); None elsewhere."""
    device = _device(group)
    mine = _pack(data, device)
    size = dist.get_world_size(group)
    slots = (
        [torch.empty(SLOT, dtype=torch.uint8, device=device) for _ in range(size)] if dist.get_rank() == dst else None
    )
    dist.gather(mine, slots, dst=dst, group=group)
    return [_unpack(s) for s in slots] if slots is not None else None


def scatter_bytes(items: list[bytes] | None, src: int, group: Any = None) -> bytes:
    """Group rank ``r`` receives ``items[r]``, which only global rank ``src`` passes."""
    device = _device(group)
    slots = [_pack(item, device) for item in items] if dist.get_rank() == src and items is not None else None
    out = torch.empty(SLOT, dtype=torch.uint8, device=device)
    dist.scatter(out, slots, src=src, group=group)
    return _unpack(out)
