"""Which ranks load, save and restore data under tensor, pipeline, context and data parallelism.

A loader must know its data-parallel (DP) coordinate and whether it sits on a rank that reads
data at all. Hard-coding global-rank arithmetic breaks as soon as a launcher uses another rank
order, so everything here is derived from one pure description, :class:`ParallelLayout`: the
parallel sizes plus an order string in megatron-core's ``RankGenerator`` notation.

The order string lists dimensions **fastest-varying first** (a mixed-radix number whose least
significant digit comes first). Two orders matter in practice:

- ``"tp-cp-ep-dp-pp"``: megatron-core's default and Nanotron's layout. World 8, TP2 PP2 gives
  DP groups ``[0, 2] [1, 3] [4, 6] [5, 7]`` and PP groups ``[0, 4] [1, 5] [2, 6] [3, 7]``.
- ``"tp-pp-dp"`` (Megatron-LM's ``--use-tp-pp-dp-mapping``, the Energon parallelism guide):
  the same sizes give DP groups ``[0, 4] [1, 5] [2, 6] [3, 7]`` and PP groups ``[0, 2] ...``.

Roles (the contract in CONTRACT.md section 6):

- ``loads_data``: the first pipeline stage; later stages never build a loader and iterate a
  :class:`~statefulset.loading.placeholder.PlaceholderLoader` instead so every rank still steps in lockstep;
- ``saves_state``: TP rank 0 and CP rank 0 of the first stage, i.e. one state per DP rank
  (TP and CP peers hold identical copies);
- ``restores_state``: every first-stage rank (TP/CP peers restore their TP rank 0's state).

The data shard coordinate is the DP rank *without* CP, as in every Megatron sampler: CP peers
share a DP rank, read the same samples and later slice their part of the sequence.

Expert parallelism (EP) does not change the dense data path. megatron-core builds the dense
("decoder") rank generator with ``ep=1`` and a separate expert generator whose ``ep`` groups
subdivide the ranks that share a TP/PP coordinate; so here ``dp = world / (tp * cp * pp)``
whatever ``ep`` is, and ``ep`` only has to divide ``world / (tp * pp)`` (expert TP = TP).

Everything here is pure (no process group). Process groups are created by
:mod:`statefulset.parallel.groups` (``create_parallel_groups`` / ``create_data_parallel_groups``),
which follow ``torch.distributed.new_group``'s rule that every rank creates every group, in the
same order.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

from statefulset.errors import StatefulsetError, check_int

__all__ = ["DEFAULT_ORDER", "ParallelLayout", "RankInfo"]

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
_DIMS = ("tp", "cp", "ep", "dp", "pp")
# Dimensions of the dense layout; "ep" only exists in the expert layout (see module docstring).
_DENSE_DIMS = ("tp", "cp", "dp", "pp")


def _digits(index: int, sizes: Sequence[int]) -> list[int]:
    """``index`` written in the mixed radix ``sizes``, least significant (fastest) digit first."""
    out = []
    for size in sizes:
        index, digit = divmod(index, size)
        out.append(digit)
    return out


def _strides(sizes: Sequence[int]) -> list[int]:
    """Stride of each digit: the product of the sizes of the faster dimensions."""
    out, stride = [], 1
    for size in sizes:
        out.append(stride)
        stride *= size
    return out


class _Grid:
    """Ranks ``0 .. prod(sizes) - 1`` laid out in a mixed radix, fastest dimension first."""

    def __init__(self, names: Sequence[str], sizes: Sequence[int]) -> None:
        self.names = tuple(names)
        self.sizes = tuple(sizes)
        self.strides = tuple(_strides(sizes))

    def coordinate(self, rank: int, name: str) -> int:
        i = self.names.index(name)
        return (rank // self.strides[i]) % self.sizes[i]

    def _split(self, kind: Sequence[str]) -> tuple[list[int], list[int]]:
        inside = [i for i, n in enumerate(self.names) if n in kind]
        outside = [i for i, n in enumerate(self.names) if n not in kind]
        return inside, outside

    def _members(self, base: int, inside: list[int]) -> list[int]:
        sizes = [self.sizes[i] for i in inside]
        strides = [self.strides[i] for i in inside]
        return [
            base + sum(d * st for d, st in zip(_digits(k, sizes), strides, strict=True))
            for k in range(math.prod(sizes))
        ]

    def group_of(self, rank: int, kind: Sequence[str]) -> list[int]:
        """Ranks sharing every coordinate of ``rank`` outside ``kind``, ordered by their in-group index."""
        inside, _ = self._split(kind)
        base = rank - sum(self.coordinate(rank, self.names[i]) * self.strides[i] for i in inside)
        return self._members(base, inside)

    def groups(self, kind: Sequence[str]) -> list[list[int]]:
        """All groups of ``kind``; group ``k`` holds the ranks whose outside coordinates spell ``k``."""
        inside, outside = self._split(kind)
        out_sizes = [self.sizes[i] for i in outside]
        out_strides = [self.strides[i] for i in outside]
        result = []
        for k in range(math.prod(out_sizes)):
            base = sum(d * st for d, st in zip(_digits(k, out_sizes), out_strides, strict=True))
            result.append(self._members(base, inside))
        return result


@dataclass(frozen=True)
class RankInfo:
    """What one global rank is in a :class:`ParallelLayout` and what its data loader must do."""

    global_rank: int
    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int
    ep_rank: int
    dp_size: int
    loads_data: bool
    """First pipeline stage: build a real loader here, a :class:`PlaceholderLoader` elsewhere."""
    saves_state: bool
    """TP rank 0 and CP rank 0 of the first stage: exactly one saver per DP rank."""
    restores_state: bool
    """Every first-stage rank; TP/CP peers restore the state their TP rank 0 saved."""
    is_last_stage: bool
    """Last pipeline stage (where Megatron's stock GPT recipe also reads labels)."""
    data_parallel_ranks: tuple[int, ...]
    """Global ranks of this rank's DP group, in DP-rank order."""
    tp_group_ranks: tuple[int, ...]
    cp_group_ranks: tuple[int, ...]
    pp_group_ranks: tuple[int, ...]
    """Global ranks of this rank's pipeline, first stage first."""

    @property
    def tp_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group: the root of a TP broadcast."""
        return self.tp_group_ranks[0]

    @property
    def first_stage_rank(self) -> int:
        """Global rank of the first pipeline stage of this rank's pipeline: the source of a PP send."""
        return self.pp_group_ranks[0]


@dataclass(frozen=True)
class ParallelLayout:
    """Parallel sizes and rank order of a training job; pure, needs no process group.

    ``dp`` is derived: ``world_size / (tp * cp * pp)``. ``order`` uses megatron-core's notation
    (dash-separated ``tp``/``cp``/``ep``/``dp``/``pp``, fastest first, case-insensitive); a
    dimension of size 1 may be left out. Bad values raise :class:`StatefulsetError` naming the field.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    order: str = DEFAULT_ORDER
    _dense: _Grid = field(init=False, repr=False, compare=False)
    _expert: _Grid = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        world = check_int("world_size", self.world_size, 1, "ParallelLayout")
        tp = check_int("tp", self.tp, 1, "ParallelLayout")
        pp = check_int("pp", self.pp, 1, "ParallelLayout")
        cp = check_int("cp", self.cp, 1, "ParallelLayout")
        ep = check_int("ep", self.ep, 1, "ParallelLayout")
        if not isinstance(self.order, str):
            raise StatefulsetError(f"ParallelLayout: order must be a string like {DEFAULT_ORDER!r}, got {self.order!r}")
        order = self.order.strip().lower()
        tokens = order.split("-")
        for token in tokens:
            if token not in _DIMS:
                raise StatefulsetError(
                    f"ParallelLayout: order {self.order!r} has unknown token {token!r}; use tp, cp, ep, dp, pp"
                )
        if len(set(tokens)) != len(tokens):
            raise StatefulsetError(f"ParallelLayout: order {self.order!r} names a dimension twice")

        model = tp * cp * pp
        if world % model:
            raise StatefulsetError(
                f"ParallelLayout: world_size {world} is not divisible by tp*cp*pp = {tp}*{cp}*{pp} = {model}"
            )
        dp = world // model
        if (world // (tp * pp)) % ep:
            raise StatefulsetError(
                f"ParallelLayout: ep {ep} does not divide world_size / (tp*pp) = {world // (tp * pp)} "
                "(experts are spread over the ranks sharing a TP and PP coordinate)"
            )
        dense_sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
        expert_sizes = {"tp": tp, "cp": 1, "ep": ep, "dp": world // (tp * pp * ep), "pp": pp}
        for name in _DIMS:
            if name not in tokens and max(dense_sizes[name], expert_sizes[name]) > 1:
                size = max(dense_sizes[name], expert_sizes[name])
                raise StatefulsetError(f"ParallelLayout: order {self.order!r} leaves out {name}, whose size is {size}")
        # Missing dimensions have size 1, so where they go does not matter; append them like megatron does.
        full = tokens + [name for name in _DIMS if name not in tokens]
        dense = [n for n in full if n != "ep"]
        expert = [n for n in full if n != "cp"]
        for name, value in (("world_size", world), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("order", order)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_dense", _Grid(dense, [dense_sizes[n] for n in dense]))
        object.__setattr__(self, "_expert", _Grid(expert, [expert_sizes[n] for n in expert]))

    @property
    def dp(self) -> int:
        """Data-parallel size: the number of distinct data shards."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def dp_size(self) -> int:
        """Data-parallel size (alias of :attr:`dp`)."""
        return self.dp

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel size (alias of :attr:`dp`, Megatron's name)."""
        return self.dp

    def _check_rank(self, global_rank: int) -> int:
        try:
            rank = operator.index(global_rank)
        except TypeError:
            raise StatefulsetError(f"ParallelLayout: global_rank must be an integer, got {global_rank!r}") from None
        if isinstance(global_rank, bool) or not 0 <= rank < self.world_size:
            raise StatefulsetError(f"ParallelLayout: global_rank {global_rank!r} is outside [0, {self.world_size})")
        return rank

    def coordinates(self, global_rank: int) -> dict[str, int]:
        """``{"tp": ..., "cp": ..., "dp": ..., "pp": ..., "ep": ...}`` of one global rank."""
        rank = self._check_rank(global_rank)
        coords = {name: self._dense.coordinate(rank, name) for name in _DENSE_DIMS}
        coords["ep"] = self._expert.coordinate(rank, "ep")
        return coords

    def rank_info(self, global_rank: int) -> RankInfo:
        """Coordinates, loader roles and group members of one global rank."""
        rank = self._check_rank(global_rank)
        c = self.coordinates(rank)
        first = c["pp"] == 0
        return RankInfo(
            global_rank=rank,
            tp_rank=c["tp"],
            cp_rank=c["cp"],
            dp_rank=c["dp"],
            pp_rank=c["pp"],
            ep_rank=c["ep"],
            dp_size=self.dp,
            loads_data=first,
            saves_state=first and c["tp"] == 0 and c["cp"] == 0,
            restores_state=first,
            is_last_stage=c["pp"] == self.pp - 1,
            data_parallel_ranks=tuple(self._dense.group_of(rank, ("dp",))),
            tp_group_ranks=tuple(self._dense.group_of(rank, ("tp",))),
            cp_group_ranks=tuple(self._dense.group_of(rank, ("cp",))),
            pp_group_ranks=tuple(self._dense.group_of(rank, ("pp",))),
        )

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind``, in megatron-core's ``RankGenerator.get_ranks(kind)`` order.

        ``kind`` is ``"tp"``, ``"cp"``, ``"dp"``, ``"pp"``, a dash-joined combination of them
        (``"tp-pp"`` is Megatron's model-parallel group, ``"dp-cp"`` its gradient group), or
        ``"ep"`` for the expert-parallel groups. Within a group ranks are in in-group-rank order.
        """
        if not isinstance(kind, str):
            raise StatefulsetError(f"ParallelLayout.groups: kind must be a string like 'dp', got {kind!r}")
        names = kind.strip().lower().split("-")
        if names == ["ep"]:
            return self._expert.groups(("ep",))
        if any(n not in _DENSE_DIMS for n in names) or len(set(names)) != len(names):
            raise StatefulsetError(
                f"ParallelLayout.groups: kind {kind!r} is not 'ep' or a dash-joined set of tp, cp, dp, pp"
            )
        return self._dense.groups(names)
