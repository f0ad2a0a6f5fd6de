"""Print the loader roles of every global rank as markdown tables (the tables of docs/parallelism.md).

Runs with no arguments and needs no process group: ``ParallelLayout`` is pure. Each table lists,
for one layout, every global rank's coordinates, whether it builds a loader (``loads_data``),
saves a state (``saves_state``) or restores one (``restores_state``), and its DP group.

    python examples/rank_tables.py > /tmp/tables.md
"""

from __future__ import annotations

from statefulset import ParallelLayout

# (world_size, tp, cp, pp, order): Megatron's default order (also Nanotron's layout) and the
# order of the Energon parallelism guide (Megatron-LM's --use-tp-pp-dp-mapping), without and with CP.
LAYOUTS = (
    (8, 2, 1, 2, "tp-cp-ep-dp-pp"),
    (8, 2, 1, 2, "tp-pp-dp"),
    (16, 2, 2, 2, "tp-cp-ep-dp-pp"),
    (16, 2, 2, 2, "tp-cp-pp-dp"),
)


def _yes(flag: bool) -> str:
    return "yes" if flag else ""


def table(layout: ParallelLayout) -> str:
    """One markdown table: a row per global rank."""
    with_cp = layout.cp > 1
    head = ["global", "tp", *(["cp"] if with_cp else []), "pp", "dp", "loads_data", "saves_state", "restores_state"]
    head.append("DP group (data_parallel_ranks)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rank in range(layout.world_size):
        info = layout.rank_info(rank)
        cells = [str(rank), str(info.tp_rank), *([str(info.cp_rank)] if with_cp else []), str(info.pp_rank)]
        cells += [str(info.dp_rank), _yes(info.loads_data), _yes(info.saves_state), _yes(info.restores_state)]
        cells.append(str(list(info.data_parallel_ranks)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(layout: ParallelLayout) -> str:
    """Which ranks build loaders, save and restore, and the groups, in one paragraph."""
    infos = [layout.rank_info(r) for r in range(layout.world_size)]
    loads = [i.global_rank for i in infos if i.loads_data]
    saves = [f"{i.global_rank} (DP {i.dp_rank})" for i in infos if i.saves_state]
    restores = [i.global_rank for i in infos if i.restores_state]
    return (
        f"Loaders on {loads}; one state per DP rank saved by {', '.join(saves)}; restored on {restores}. "
        f"DP groups {layout.groups('dp')}, TP groups {layout.groups('tp')}, PP groups {layout.groups('pp')}"
        + (f", CP groups {layout.groups('cp')}" if layout.cp > 1 else "")
        + "."
    )


def main() -> None:
    for world, tp, cp, pp, order in LAYOUTS:
        layout = ParallelLayout(world_size=world, tp=tp, cp=cp, pp=pp, order=order)
        cp_text = f" CP{cp}" if cp > 1 else ""
        print(f'#### World {world}, TP{tp}{cp_text} PP{pp} DP{layout.dp}, order "{layout.order}"\n')
        print(table(layout))
        print()
        print(summary(layout))
        print()
        # The contract, checked on the table just printed: one saver per DP rank, loaders on stage 0 only.
        infos = [layout.rank_info(r) for r in range(world)]
        savers = sorted(i.dp_rank for i in infos if i.saves_state)
        assert savers == list(range(layout.dp)), savers
        assert all(i.loads_data == (i.pp_rank == 0) == i.restores_state for i in infos)


if __name__ == "__main__":
    main()
