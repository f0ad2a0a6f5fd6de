"""``WorkerConfig``: who this rank is in the data-parallel group and how many workers it runs.

Names and keywords follow Megatron-Energon's ``WorkerConfig`` so training code ports with only
the import changed. Unlike Energon, nothing here is class-level global state, and worker seeds
are derived (never drawn from, nor written to, the global RNGs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from statefulset.errors import StatefulsetError, check_int
from statefulset.index.native.keys import derive_key


@dataclass(kw_only=True, eq=False)
class WorkerConfig:
    """Data-parallel rank, DP world size and worker processes of this rank's loader.

    ``rank`` is the rank *within* ``data_parallel_group`` (the world when None).
    ``worker_debug_path`` and ``worker_log_level`` are accepted for Energon compatibility.
    """

    rank: int
    world_size: int
    num_workers: int
    data_parallel_group: Any = None
    seed_offset: int = 0
    worker_debug_path: str | None = None
    worker_log_level: int = 0

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, 1, "WorkerConfig")
        check_int("rank", self.rank, 0, "WorkerConfig")
        check_int("num_workers", self.num_workers, 0, "WorkerConfig")
        check_int("seed_offset", self.seed_offset, 0, "WorkerConfig")
        if self.rank >= self.world_size:
            raise StatefulsetError(f"WorkerConfig: rank {self.rank} is outside [0, world_size {self.world_size})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WorkerConfig):
            return NotImplemented
        keys = ("rank", "world_size", "num_workers", "seed_offset")
        return all(getattr(self, k) == getattr(other, k) for k in keys)

    __hash__ = None  # type: ignore[assignment]

    def worker_seed(self, worker_id: int = 0, seed: int = 0) -> int:
        """A 63-bit seed for one worker, derived from (seed, seed_offset, rank, worker): for user transforms."""
        return derive_key(seed, self.seed_offset, self.rank, worker_id) >> 1

    def global_rank(self) -> int:
        """This process's global rank (0 without torch.distributed)."""
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @staticmethod
    def default_worker_config(num_workers: int = 4, data_parallel_group: Any = None) -> WorkerConfig:
        """Rank and world size from torch.distributed (within ``data_parallel_group``), else 0 of 1."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank(data_parallel_group)
            world = dist.get_world_size(data_parallel_group)
        else:
            rank, world = 0, 1
        return WorkerConfig(
            rank=rank, world_size=world, num_workers=num_workers, data_parallel_group=data_parallel_group
        )
