"""ParallelLayout against megatron-core's RankGenerator, its invariants, and real gloo process groups."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ranks import init_rank, spawn

from statefulset.errors import StatefulsetError
from statefulset.loading.placeholder import PlaceholderLoader
from statefulset.parallel.groups import create_data_parallel_groups, create_parallel_groups
from statefulset.parallel.layout import ParallelLayout

MEGATRON_ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-dp", "tp-dp-pp", "pp-dp-cp-ep-tp", "dp-tp-cp-pp-ep")


def _layout_cases() -> list[tuple[int, int, int, int, int, str]]:
    """(world, tp, pp, cp, ep, order) combinations megatron-core accepts."""
    cases = []
    for world, tp, pp, cp, ep in itertools.product((1, 2, 4, 6, 8, 12, 16), (1, 2, 4), (1, 2, 3), (1, 2), (1, 2)):
        if world % (tp * pp * cp) or (world // (tp * pp)) % ep:
            continue
        for order in MEGATRON_ORDERS:
            cases.append((world, tp, pp, cp, ep, order))
    return cases


LAYOUT_CASES = _layout_cases()


# --- worked examples -----------------------------------------------------------------------


def test_megatron_default_order_worked_example():
    """anchor-parallel-plumbing.md §1.2: world 8, TP2 PP2 DP2, tp-cp-ep-dp-pp."""
    layout = ParallelLayout(8, tp=2, pp=2)
    assert layout.dp == layout.dp_size == layout.data_parallel_size == 2
    table = [(layout.rank_info(g).tp_rank, layout.rank_info(g).dp_rank, layout.rank_info(g).pp_rank) for g in range(8)]
    assert table == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.groups("tp-dp-cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    infos = [layout.rank_info(g) for g in range(8)]
    assert [g for g, i in enumerate(infos) if i.loads_data] == [0, 1, 2, 3]
    assert [g for g, i in enumerate(infos) if i.saves_state] == [0, 2]
    assert [g for g, i in enumerate(infos) if i.restores_state] == [0, 1, 2, 3]
    assert [g for g, i in enumerate(infos) if i.is_last_stage] == [4, 5, 6, 7]
    assert infos[2].data_parallel_ranks == (0, 2)
    assert infos[3].tp_src_rank == 2
    assert infos[6].first_stage_rank == 2


def test_energon_guide_order_worked_example():
    """The Energon parallelism guide's table is Megatron's tp-pp-dp order."""
    layout = ParallelLayout(8, tp=2, pp=2, order="tp-pp-dp")
    infos = [layout.rank_info(g) for g in range(8)]
    # Guide: data_parallel_rank = [0, 0, X, X, 1, 1, X, X], pp = [0, 0, 1, 1, ...], tp = [0, 1, 0, 1, ...].
    assert [i.pp_rank for i in infos] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [i.tp_rank for i in infos] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [i.dp_rank for i in infos if i.loads_data] == [0, 0, 1, 1]
    assert infos[0].data_parallel_ranks == (0, 4)  # DP group A
    assert infos[1].data_parallel_ranks == (1, 5)  # DP group B
    assert [g for g, i in enumerate(infos) if i.saves_state] == [0, 4]
    assert [g for g, i in enumerate(infos) if i.restores_state] == [0, 1, 4, 5]
    assert layout.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # Megatron-LM's --use-tp-pp-dp-mapping spells the same layout with cp and ep.
    assert ParallelLayout(8, tp=2, pp=2, order="tp-cp-ep-pp-dp").groups("dp") == layout.groups("dp")


def test_context_parallel_peers_share_data_but_only_one_saves():
    layout = ParallelLayout(8, tp=2, cp=2)
    infos = [layout.rank_info(g) for g in range(8)]
    assert [(i.tp_rank, i.cp_rank, i.dp_rank) for i in infos[:4]] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert all(i.loads_data and i.restores_state for i in infos)
    assert [g for g, i in enumerate(infos) if i.saves_state] == [0, 4]
    assert infos[2].cp_group_ranks == (0, 2)
    assert infos[2].data_parallel_ranks == (2, 6)


def test_order_is_case_insensitive_and_size_one_dims_may_be_left_out():
    assert ParallelLayout(8, tp=2, pp=2, order="TP-DP-PP").groups("dp") == ParallelLayout(8, tp=2, pp=2).groups("dp")
    assert ParallelLayout(4, order="dp").groups("dp") == [[0, 1, 2, 3]]
    assert ParallelLayout(4).order == "tp-cp-ep-dp-pp"


def test_expert_parallelism_does_not_change_the_dense_data_path():
    dense = ParallelLayout(16, tp=2, pp=2)
    moe = ParallelLayout(16, tp=2, pp=2, ep=2)
    assert moe.dp == dense.dp == 4
    for g in range(16):
        a, b = dense.rank_info(g), moe.rank_info(g)
        assert (a.dp_rank, a.data_parallel_ranks, a.saves_state) == (b.dp_rank, b.data_parallel_ranks, b.saves_state)
    assert moe.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert [moe.rank_info(g).ep_rank for g in range(4)] == [0, 0, 1, 1]


def test_layout_is_frozen_and_hashable():
    layout = ParallelLayout(8, tp=2)
    with pytest.raises(AttributeError):
        layout.tp = 4  # type: ignore[misc]
    assert layout == ParallelLayout(8, tp=2) and hash(layout) == hash(ParallelLayout(8, tp=2))
    assert "order='tp-cp-ep-dp-pp'" in repr(layout)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 8, "tp": 0}, "tp"),
        ({"world_size": 8, "pp": -2}, "pp"),
        ({"world_size": 8, "cp": "2"}, "cp"),
        ({"world_size": 8, "ep": 1.0}, "ep"),
        ({"world_size": 8, "tp": True}, "tp"),
        ({"world_size": 6, "tp": 4}, "world_size"),
        ({"world_size": 8, "tp": 2, "pp": 2, "ep": 4}, "ep"),
        ({"world_size": 8, "order": "tp-xp-dp"}, "order"),
        ({"world_size": 8, "order": "tp-dp-tp"}, "order"),
        ({"world_size": 8, "tp": 2, "order": "dp-pp"}, "order"),
        ({"world_size": 8, "ep": 2, "order": "tp-pp-dp"}, "order"),
        ({"world_size": 8, "order": 3}, "order"),
    ],
)
def test_bad_layouts_name_the_field(kwargs, field):
    with pytest.raises(StatefulsetError, match=rf"^ParallelLayout: {field}\b"):
        ParallelLayout(**kwargs)


def test_bad_rank_and_kind_are_named():
    layout = ParallelLayout(8, tp=2)
    for bad in (8, -1, "0", 1.0):
        with pytest.raises(StatefulsetError, match="global_rank"):
            layout.rank_info(bad)
    for kind in ("xx", "tp-tp", "ep-tp", 1):
        with pytest.raises(StatefulsetError, match="kind"):
            layout.groups(kind)


# --- megatron-core as the oracle -----------------------------------------------------------


@pytest.fixture(scope="module")
def rank_generator():
    from megatron.core.parallel_state import RankGenerator

    return RankGenerator


@pytest.mark.oracle
@pytest.mark.parametrize(("world", "tp", "pp", "cp", "ep", "order"), LAYOUT_CASES)
def test_matches_megatron_rank_generator(rank_generator, world, tp, pp, cp, ep, order):
    dp = world // (tp * pp * cp)
    try:
        # The dense generator gets ep=1 and the expert one cp=1, as in initialize_model_parallel.
        dense = rank_generator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
        expert = rank_generator(tp=tp, ep=ep, dp=world // (tp * pp * ep), pp=pp, cp=1, order=order)
    except RuntimeError:  # the order leaves out a dimension of size > 1: refused by both
        with pytest.raises(StatefulsetError, match=r"order .* leaves out"):
            ParallelLayout(world, tp=tp, pp=pp, cp=cp, ep=ep, order=order)
        return
    layout = ParallelLayout(world, tp=tp, pp=pp, cp=cp, ep=ep, order=order)
    for kind in ("tp", "pp", "dp", "cp", "tp-pp", "dp-cp", "tp-dp-cp", "tp-cp"):
        assert layout.groups(kind) == dense.get_ranks(kind), kind
    assert layout.groups("ep") == expert.get_ranks("ep")

    def position(groups, rank):
        (found,) = [(group, group.index(rank)) for group in groups if rank in group]
        return found

    oracle = {kind: dense.get_ranks(kind) for kind in ("tp", "pp", "dp", "cp")}
    ep_groups = expert.get_ranks("ep")
    for g in range(world):
        info = layout.rank_info(g)
        dp_group, dp_rank = position(oracle["dp"], g)
        assert (info.dp_rank, list(info.data_parallel_ranks)) == (dp_rank, dp_group)
        tp_group, tp_rank = position(oracle["tp"], g)
        assert (info.tp_rank, list(info.tp_group_ranks)) == (tp_rank, tp_group)
        pp_group, pp_rank = position(oracle["pp"], g)
        assert (info.pp_rank, list(info.pp_group_ranks)) == (pp_rank, pp_group)
        cp_group, cp_rank = position(oracle["cp"], g)
        assert (info.cp_rank, list(info.cp_group_ranks)) == (cp_rank, cp_group)
        assert info.ep_rank == position(ep_groups, g)[1]


# --- invariants for any valid layout -------------------------------------------------------


@st.composite
def layouts(draw) -> ParallelLayout:
    tp, cp, dp, pp = (draw(st.integers(1, 4)) for _ in range(4))
    ep = draw(st.sampled_from([d for d in range(1, dp * cp + 1) if (dp * cp) % d == 0]))
    sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
    tokens = draw(st.permutations(list(sizes)))
    # Size-1 dims may be left out, except dp when the expert layout still needs it (dp*cp/ep > 1).
    needed = {n for n, s in sizes.items() if s > 1} | ({"dp"} if dp * cp > ep else set())
    kept = [t for t in tokens if t in needed or draw(st.booleans())] or ["dp"]
    return ParallelLayout(tp * cp * dp * pp, tp=tp, pp=pp, cp=cp, ep=ep, order="-".join(kept))


@settings(max_examples=80, deadline=None)
@given(layouts())
def test_layout_invariants(layout):
    world = layout.world_size
    sizes = {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp, "ep": layout.ep}
    for kind, size in sizes.items():
        groups = layout.groups(kind)
        assert sorted(r for group in groups for r in group) == list(range(world)), kind
        assert all(len(group) == size for group in groups), kind
    infos = [layout.rank_info(g) for g in range(world)]
    coords = {(i.tp_rank, i.cp_rank, i.dp_rank, i.pp_rank) for i in infos}
    assert len(coords) == world
    for info in infos:
        members = [infos[r] for r in info.data_parallel_ranks]
        assert [m.dp_rank for m in members] == list(range(layout.dp))
        assert {(m.tp_rank, m.cp_rank, m.pp_rank) for m in members} == {(info.tp_rank, info.cp_rank, info.pp_rank)}
        assert list(info.data_parallel_ranks) in layout.groups("dp")
        assert [infos[r].pp_rank for r in info.pp_group_ranks] == list(range(layout.pp))
        assert infos[info.tp_src_rank].tp_rank == 0
        assert info.loads_data == info.restores_state == (info.pp_rank == 0)
    savers = [i for i in infos if i.saves_state]
    assert sorted(i.dp_rank for i in savers) == list(range(layout.dp))
    assert all(i.tp_rank == 0 and i.cp_rank == 0 and i.pp_rank == 0 for i in savers)


def test_default_order_is_the_documented_formula():
    layout = ParallelLayout(48, tp=2, cp=2, pp=3)
    for g in range(48):
        i = layout.rank_info(g)
        assert g == i.tp_rank + 2 * (i.cp_rank + 2 * (i.dp_rank + layout.dp * i.pp_rank))


# --- PlaceholderLoader ---------------------------------------------------------------------


def test_placeholder_loader_is_lockstep_and_stateless():
    loader = PlaceholderLoader(3)
    assert len(loader) == 3
    assert list(loader) == [None, None, None]
    assert list(loader) == [None, None, None]  # re-iterable, like an epoch of a real loader
    assert list(PlaceholderLoader(2, placeholder={"text": None})) == [{"text": None}] * 2
    assert loader.save_state_rank() is None
    loader.restore_state_rank(None)
    loader.restore_state_rank({"from": "a hook that loads a file per DP rank"})
    assert loader.save_state_global(global_dst_rank=0) is None
    loader.restore_state_global([None, None], src_rank=0)
    assert loader.state_dict() == {}
    loader.load_state_dict({})


def test_placeholder_loader_without_length_is_endless():
    loader = PlaceholderLoader()
    assert list(itertools.islice(loader, 5)) == [None] * 5
    with pytest.raises(TypeError):
        len(loader)
    assert [b for _, b in zip(range(4), loader, strict=False)] == [None] * 4


@pytest.mark.parametrize("length", [-1, 1.5, "3", True])
def test_placeholder_loader_rejects_bad_length(length):
    with pytest.raises(StatefulsetError, match="length"):
        PlaceholderLoader(length)


def test_group_creation_needs_an_initialised_matching_world():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(StatefulsetError, match="not initialised"):
        create_data_parallel_groups(ParallelLayout(8, tp=2))


# --- real process groups -------------------------------------------------------------------

WORLD = 8
DISTRIBUTED_LAYOUTS = (
    {"tp": 2, "pp": 2},
    {"tp": 2, "pp": 2, "order": "tp-pp-dp"},
    {"tp": 2, "cp": 2},
)
STEPS = 3


def _distributed_worker(rank: int, world: int, init_file: str) -> None:
    """One of WORLD gloo processes: check groups, roles and a first-stage -> later-stage hand-off."""
    import torch
    import torch.distributed as dist

    init_rank(rank, world, init_file)
    try:
        with pytest.raises(StatefulsetError, match="world_size"):
            create_parallel_groups(ParallelLayout(4))
        with pytest.raises(StatefulsetError, match="repeats"):
            create_parallel_groups(ParallelLayout(WORLD), ("dp", "dp"))
        for kwargs in DISTRIBUTED_LAYOUTS:
            layout = ParallelLayout(WORLD, **kwargs)
            info = layout.rank_info(rank)
            dp_group = create_data_parallel_groups(layout)
            groups = create_parallel_groups(layout, ("tp", "pp"))

            # The DP group holds exactly data_parallel_ranks, and group rank == DP rank.
            members = [None] * dist.get_world_size(dp_group)
            dist.all_gather_object(members, (rank, info.dp_rank), group=dp_group)
            assert [m[0] for m in members] == list(info.data_parallel_ranks), (kwargs, rank, members)
            assert [m[1] for m in members] == list(range(layout.dp))
            assert dist.get_rank(dp_group) == info.dp_rank

            # One saver per DP rank across the whole world.
            everyone = [None] * WORLD
            dist.all_gather_object(everyone, (info.saves_state, info.dp_rank, info.restores_state))
            assert sorted(dp for saves, dp, _ in everyone if saves) == list(range(layout.dp))
            assert sum(restores for _, _, restores in everyone) == WORLD // layout.pp

            # TP broadcast: TP peers receive TP rank 0's batch.
            payload = [("batch-of", info.dp_rank, rank) if info.tp_rank == 0 else None]
            dist.broadcast_object_list(payload, src=info.tp_src_rank, group=groups["tp"])
            assert payload[0] == ("batch-of", info.dp_rank, info.tp_src_rank)

            # PP hand-off: first stage loads, later stages iterate placeholders in lockstep and
            # receive the first stage's batch through the PP group.
            if info.loads_data:
                loader = [torch.tensor([info.dp_rank, step]) for step in range(STEPS)]
            else:
                loader = PlaceholderLoader(STEPS)
            received = []
            for batch in loader:
                tensor = batch if batch is not None else torch.zeros(2, dtype=torch.int64)
                dist.broadcast(tensor, src=info.first_stage_rank, group=groups["pp"])
                received.append(tensor.tolist())
            assert received == [[info.dp_rank, step] for step in range(STEPS)]
            if not info.loads_data:
                assert loader.save_state_rank() is None
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_real_gloo_groups_match_the_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    spawn(_distributed_worker, WORLD, tmp_path)
