"""Moving a micro-batch from the rank that read it to the ranks that need it.

The loader lives on the first pipeline stage only. Two moves remain:

- **TP broadcast** (:func:`broadcast_batch`): TP rank 0 reads, its TP peers receive the same
  tensors. Receivers must allocate before the data arrives, so both sides agree on a fixed
  list of :class:`TensorSpec` (name, shape, dtype); the sender checks its tensors against it
  and raises instead of letting a mismatch corrupt data or hang the group.
- **First → last stage** (:class:`StageLink`): the last stage needs labels and a loss mask.
  Rather than a second loader re-reading the same samples (Megatron-LM's recipe, which rests
  on both reads agreeing), the first stage sends the raw ``text`` rows point-to-point to the
  last stage of its own pipeline, which derives labels and masks from them with the same pure
  function. One int64 ``[B, S+1]`` tensor per micro-batch, sent with ``isend`` so the sender
  never waits on the receiver's schedule; messages between one pair arrive in order.

Both take global ranks and an optional process group. Sends use a fixed tag so they cannot be
matched against a framework's own activation sends on the same group (gloo matches by tag).
NCCL ignores tags: there, pass a group used only for this link (``create_parallel_groups``
with kind ``"pp"`` creates one).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from statefulset.errors import StatefulsetError

__all__ = ["LINK_TAG", "StageLink", "TensorSpec", "broadcast_batch"]

LINK_TAG = 0x5F5E7  # statefulset's p2p tag; any fixed value distinct from a framework's (0)


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor of a micro-batch, agreed on by sender and receivers."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _check(batch: Mapping[str, Any], specs: Sequence[TensorSpec], what: str) -> None:
    for spec in specs:
        tensor = batch.get(spec.name)
        if not isinstance(tensor, torch.Tensor):
            raise StatefulsetError(f"{what}: the batch has no tensor {spec.name!r} (keys: {sorted(batch)})")
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise StatefulsetError(
                f"{what}: {spec.name!r} is {tensor.dtype} {tuple(tensor.shape)}, receivers expect "
                f"{spec.dtype} {spec.shape}"
            )


def broadcast_batch(
    batch: Mapping[str, torch.Tensor] | None,
    specs: Sequence[TensorSpec],
    src: int,
    group: Any = None,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Broadcast ``specs``' tensors from global rank ``src`` over ``group``; every member calls it.

    ``src`` passes its batch, the others pass None and get freshly allocated tensors (on
    ``device``, CPU by default). Returns the dict of ``specs``' names on every rank.
    """
    if dist.get_rank() == src:
        if batch is None:
            raise StatefulsetError(f"broadcast_batch: rank {src} is the source but passed no batch")
        _check(batch, specs, f"broadcast_batch from rank {src}")
        out = {s.name: batch[s.name].contiguous() for s in specs}
    else:
        out = {s.name: torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs}
    for spec in specs:
        dist.broadcast(out[spec.name], src=src, group=group)
    return out


class StageLink:
    """One direction of a point-to-point link between two global ranks, for fixed-shape tensors.

    The sending side calls :meth:`send` once per micro-batch, the receiving side :meth:`recv`
    as many times, in the same order. At most ``depth`` sends are in flight; a further send
    waits for the oldest, which bounds memory without coupling the two ranks' schedules.
    """

    def __init__(
        self,
        peer: int,
        specs: Sequence[TensorSpec],
        group: Any = None,
        tag: int = LINK_TAG,
        depth: int = 4,
        device: torch.device | str | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise StatefulsetError("StageLink: torch.distributed is not initialised")
        if peer == dist.get_rank():
            raise StatefulsetError(f"StageLink: rank {peer} cannot link to itself")
        self.peer = peer
        self.specs = tuple(specs)
        self.group = group
        self.tag = tag
        self.depth = max(1, depth)
        self.device = device
        self._in_flight: deque[tuple[Any, list[torch.Tensor]]] = deque()

    def send(self, batch: Mapping[str, torch.Tensor]) -> None:
        _check(batch, self.specs, f"StageLink send to rank {self.peer}")
        while len(self._in_flight) >= self.depth:
            self._wait_oldest()
        tensors = [batch[s.name].contiguous() for s in self.specs]
        works = [dist.isend(t, dst=self.peer, group=self.group, tag=self.tag) for t in tensors]
        # Keep the tensors alive until their sends complete.
        self._in_flight.append((works, tensors))

    def _wait_oldest(self) -> None:
        works, _ = self._in_flight.popleft()
        for work in works:
            work.wait()

    def flush(self) -> None:
        """Wait for every send in flight (before a checkpoint or shutdown)."""
        while self._in_flight:
            self._wait_oldest()

    def recv(self) -> dict[str, torch.Tensor]:
        out = {s.name: torch.empty(s.shape, dtype=s.dtype, device=self.device) for s in self.specs}
        for spec in self.specs:
            dist.recv(out[spec.name], src=self.peer, group=self.group, tag=self.tag)
        return out
