"""Small per-rank payloads over a process group, in fixed slots: gather to one rank, scatter from one.

``gather_object`` / ``broadcast_object_list`` are the obvious tools and the wrong ones at scale:
``gather_object`` first all-gathers every rank's payload size (each of W ranks receives W sizes,
W² in all), and broadcasting the list of every rank's state to every rank moves W² states
(at 16k DP ranks and ~400 B per state, 100 GB). A loader state is small and bounded, so each
rank's payload travels in a fixed slot of ``SLOT`` bytes (a 4-byte header, then the bytes):
one ``gather`` (W slots arrive at one rank) or one ``scatter`` (each rank receives its own
slot), O(W) bytes in all, no size exchange.

A rank never refuses before the collective: its peers would wait in it until the process
group's timeout. A payload that does not fit, or an error the sending rank wants every receiver
to raise, travels as an *error slot* instead (the header's top bit set, the UTF-8 message fitted
to the slot on a character boundary), and every rank that receives it raises a
``StatefulsetError`` naming the rank it came from.

The callers meet their peers first (:mod:`statefulset.parallel.arrival`), so a rank that never
comes is named within ``collective_timeout``. A peer that met and then stopped or died inside the
collective leaves the others waiting until the process group's own timeout; its backend error
(gloo: "Timed out waiting ... for recv operation") is raised as a ``StatefulsetError`` naming the
call, the collective and this rank (found by the reliability campaign, seed 100026).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from statefulset.errors import StatefulsetError

SLOT = 4096  # bytes per rank; a state is ~300-600 bytes of msgpack
PAYLOAD = SLOT - 4  # the header: the payload's size in the low 31 bits, the error bit on top
ERROR_BIT = 1 << 31
TRUNCATED = " [... truncated to fit the exchange slot]"


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fit_message(text: str, limit: int = PAYLOAD) -> bytes:
    """``text`` as UTF-8 in at most ``limit`` bytes, cut on a character boundary and marked when cut."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return data
    head = data[: limit - len(TRUNCATED.encode())]
    # A cut inside a multi-byte character leaves an incomplete sequence at the end only: drop it.
    return head.decode("utf-8", errors="ignore").encode() + TRUNCATED.encode()


def _slot(data: bytes, error: bool, device: torch.device) -> torch.Tensor:
    slot = torch.zeros(SLOT, dtype=torch.uint8)
    header = len(data) | (ERROR_BIT if error else 0)
    slot[:4] = torch.tensor(list(header.to_bytes(4, "little")), dtype=torch.uint8)
    if data:
        slot[4 : 4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return slot.to(device)


def _pack(data: bytes, device: torch.device, rank: int) -> torch.Tensor:
    """A payload's slot, or an error slot saying it does not fit (sent all the same: see above)."""
    if len(data) > PAYLOAD:
        text = f"a payload of {len(data)} bytes exceeds the {PAYLOAD}-byte slot of a loader state on rank {rank}"
        return _slot(fit_message(text), True, device)
    return _slot(data, False, device)


def _unpack(slot: torch.Tensor) -> tuple[bytes, bool]:
    raw = slot.cpu().numpy().tobytes()
    header = int.from_bytes(raw[:4], "little")
    size, error = header & ~ERROR_BIT, bool(header & ERROR_BIT)
    if size > PAYLOAD:
        raise StatefulsetError(f"a received slot claims {size} bytes, more than the slot holds")
    return raw[4 : 4 + size], error


def _raise_from(data: bytes, source: str) -> None:
    raise StatefulsetError(f"{data.decode('utf-8', errors='replace')} (sent by {source})")


def _collective(what: str, op: str, group: Any, call: Any) -> None:
    """``call()`` (one collective), its backend's failure raised as a StatefulsetError naming ``what``."""
    try:
        call()
    except RuntimeError as exc:  # gloo's and NCCL's errors (timeouts included) are RuntimeErrors
        raise StatefulsetError(
            f"{what}: the {op} over the data-parallel group ({dist.get_world_size(group)} ranks) failed on global "
            f"rank {dist.get_rank()}: a peer that reached it stopped or died inside it, and this rank waited until "
            f"the process group's timeout ({type(exc).__name__}: {exc})"
        ) from exc


def gather_bytes(data: bytes, dst: int, group: Any = None, what: str = "gather_bytes") -> list[bytes] | None:
    """Every rank's ``data`` at global rank ``dst`` (in group-rank order); None elsewhere.

    A payload that does not fit its slot makes its own rank and ``dst`` raise, after the gather.
    """
    device = _device(group)
    me = dist.get_rank()
    mine = _pack(data, device, me)
    size = dist.get_world_size(group)
    slots = [torch.empty(SLOT, dtype=torch.uint8, device=device) for _ in range(size)] if me == dst else None
    _collective(what, "gather", group, lambda: dist.gather(mine, slots, dst=dst, group=group))
    if len(data) > PAYLOAD:
        _raise_from(_unpack(mine)[0], f"global rank {me}")
    if slots is None:
        return None
    out = []
    for group_rank, slot in enumerate(slots):
        payload, error = _unpack(slot)
        if error:
            source = dist.get_global_rank(group, group_rank) if group is not None else group_rank
            _raise_from(payload, f"global rank {source}")
        out.append(payload)
    return out


def scatter_bytes(
    items: list[bytes] | None,
    src: int,
    group: Any = None,
    error: str | None = None,
    source: str | None = None,
    what: str = "scatter_bytes",
) -> bytes:
    """Group rank ``r`` receives ``items[r]``, which only global rank ``src`` passes.

    ``error`` (on ``src``, instead of ``items``): every rank, ``src`` too, raises a
    ``StatefulsetError`` with this message, naming ``source`` (default "global rank ``src``").
    So does a list of the wrong length or an item that does not fit.
    """
    device = _device(group)
    slots = None
    if dist.get_rank() == src:
        if error is None and items is None:
            error = "internal: the source rank of a scatter passed neither items nor an error"
        size = dist.get_world_size(group)
        if error is None and items is not None and len(items) != size:
            error = f"internal: a scatter over {size} ranks was given {len(items)} items"
        if error is None and items is not None:
            too_big = [(r, len(item)) for r, item in enumerate(items) if len(item) > PAYLOAD]
            if too_big:
                r, n = too_big[0]
                error = f"the payload for group rank {r} ({n} bytes) exceeds the {PAYLOAD}-byte exchange slot"
        if error is not None:
            slots = [_slot(fit_message(error), True, device)] * size
        else:
            slots = [_pack(item, device, src) for item in items]  # type: ignore[union-attr]
    out = torch.empty(SLOT, dtype=torch.uint8, device=device)
    _collective(what, "scatter", group, lambda: dist.scatter(out, slots, src=src, group=group))
    payload, failed = _unpack(out)
    if failed:
        _raise_from(payload, source or f"global rank {src}")
    return payload


def all_gather_floats(values: list[float], group: Any = None, what: str = "all_gather_floats") -> torch.Tensor:
    """Every rank's ``values`` as a float64 ``[world, len(values)]`` tensor (on the CPU), in group-rank order.

    One all-gather of ``len(values)`` floats per rank: for a few metrics, not for payloads.
    """
    device = _device(group)
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    _collective(what, "all-gather", group, lambda: dist.all_gather(out, mine, group=group))
    return torch.stack(out).cpu()
