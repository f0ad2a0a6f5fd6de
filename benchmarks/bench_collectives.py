"""The collectives of save_state_global / restore_state_global(src_rank) as the DP group grows.

For W = 2, 4, 8, 16 gloo ranks on this machine (one process each), side by side in one run:

- **ours**: the store meeting (``statefulset.parallel.arrival.meet``: 5 store operations per
  rank) plus one ``gather`` of fixed 4 KiB slots to rank 0 (save), or one ``scatter`` of them
  from rank 0 (restore: each rank receives only its own cursor);
- **object collectives**: ``gather_object`` of the states (which first all-gathers every rank's
  payload size) and ``broadcast_object_list`` of the whole list (every rank receives every
  state), what the loader used before.

Median wall time per call over ``--calls`` calls (rank 0's clock), median (min–max) over ``--rounds``
rounds of fresh process groups, and bytes received per rank and in all, counted from what each
collective moves. Then the same byte counts at 16,384 ranks (arithmetic, not measured).
Run: ``python benchmarks/bench_collectives.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import statistics
import sys
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

STATE = {  # the shape of a real loader state (statefulset.loading.state.make_state)
    "format": "statefulset.loader",
    "version": 1,
    "identity": {
        "packing": "native", "split": "train", "split_ratios": "969,30,1", "seq_length": 4096, "seed": 1234,
        "num_samples": None, "data": "0123456789abcdef01234567",
    },
    "dp_rank": 0, "dp_size": 1, "batch_size": 4, "base": 0, "batches": 123456, "num_workers": 2,
}  # fmt: skip


def _worker(rank: int, world: int, port: int, calls: int, out: str) -> None:
    from statefulset.loading.state import encode
    from statefulset.parallel.arrival import meet
    from statefulset.parallel.exchange import SLOT, gather_bytes, scatter_bytes

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    state = {**STATE, "dp_rank": rank, "dp_size": world}
    states = [{**STATE, "dp_rank": r, "dp_size": world} for r in range(world)]
    times: dict[str, list[float]] = {k: [] for k in ("ours_save", "ours_restore", "objects_save", "objects_restore")}
    for _ in range(calls):
        dist.barrier()
        t = time.perf_counter()
        meet("save_state_global", None, 60, "global_dst_rank=0")
        gather_bytes(encode(state), 0)
        times["ours_save"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        meet("restore_state_global", None, 60, "src_rank=0")
        scatter_bytes([encode({"base": 0, "batches": 1})] * world if rank == 0 else None, 0)
        times["ours_restore"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        dist.gather_object(state, [None] * world if rank == 0 else None, dst=0)
        times["objects_save"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        box = [states if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        times["objects_restore"].append(time.perf_counter() - t)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({k: statistics.median(v) for k, v in times.items()} | {"slot": SLOT}, f)
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bytes_moved(world: int, slot: int) -> dict[str, float]:
    """Bytes received per rank (the root's receive counted separately) and in all."""
    state = len(pickle.dumps(STATE))
    return {
        "ours_save_root": world * slot,
        "ours_restore_each": slot,
        "ours_total": 2 * world * slot,
        "objects_save_each": world * 8,  # the all-gather of sizes
        "objects_save_root": world * 8 + world * state,
        "objects_restore_each": world * state,
        "objects_total": world * world * 8 + world * state + world * world * state,
    }


def _spread(runs: list[dict]) -> dict:
    """Per collective: median, min and max over the rounds of each round's median call."""
    keys = ("ours_save", "ours_restore", "objects_save", "objects_restore")
    return {k: {"median": statistics.median(r[k] for r in runs), "min": min(r[k] for r in runs),
                "max": max(r[k] for r in runs), "runs": [r[k] for r in runs]} for k in keys} | {
        "slot": runs[0]["slot"]}  # fmt: skip


def _ms(cell: float | dict) -> str:
    if isinstance(cell, dict):
        return f"{cell['median'] * 1e3:.2f} ({cell['min'] * 1e3:.2f}–{cell['max'] * 1e3:.2f})"
    return f"{cell * 1e3:.2f}"


def markdown(record: dict) -> str:
    """The two tables: median ms per call at each measured size, then the bytes each collective moves."""
    rows = {int(world): r for world, r in record["rows"].items()}
    if "rounds" in record:
        how = (
            f"Median (min–max) over {record['rounds']} rounds of fresh process groups, the sizes rotated, "
            f"of each round's median of {record['calls']} calls; the four collectives alternate in every call."
        )
    else:
        how = f"Median of {record['calls']} calls per size, one run (this results file predates the rounds)."
    lines = [how, "",
             "| DP ranks | ours: save, ms | ours: restore, ms | objects: save, ms | objects: restore, ms |",
             "|---|---|---|---|---|"]  # fmt: skip
    for world, r in rows.items():
        cells = (_ms(r[k]) for k in ("ours_save", "ours_restore", "objects_save", "objects_restore"))
        lines.append(f"| {world} | " + " | ".join(cells) + " |")
    slot = next(iter(rows.values()))["slot"]
    lines += ["", "| DP ranks | ours: bytes at the root / per other rank / in all | objects: per rank / in all |",
              "|---|---|---|"]  # fmt: skip
    for world in [*rows, 1024, 16384]:
        b = bytes_moved(world, slot)
        lines.append(
            f"| {world:,} | {b['ours_save_root']:,.0f} / {b['ours_restore_each']:,.0f} / "
            f"{b['ours_total']:,.0f} | {b['objects_restore_each']:,.0f} / {b['objects_total']:,.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="fresh process groups per size, sizes rotated")
    parser.add_argument("--quick", action="store_true", help="2 and 4 ranks, 5 calls, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.worlds, args.calls, args.rounds = [2, 4], 5, 1
    medians: dict[int, list[dict]] = {world: [] for world in args.worlds}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            k = round_ % len(args.worlds)
            for world in args.worlds[k:] + args.worlds[:k]:
                out = os.path.join(folder, f"{world}.json")
                mp.spawn(_worker, args=(world, _port(), args.calls, out), nprocs=world, join=True)
                with open(out) as f:
                    medians[world].append(json.load(f))
    rows = {world: _spread(runs) for world, runs in medians.items()}
    record = {"rows": rows, "calls": args.calls, "rounds": args.rounds}
    print(markdown(record))
    from provenance import write_results

    write_results("bench_collectives", record, quick=args.quick)


if __name__ == "__main__":
    main()
