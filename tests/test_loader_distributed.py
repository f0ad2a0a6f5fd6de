"""The savable loader in real multi-process runs: gloo process groups, DataLoader worker processes, SIGKILL.

Every check compares whole streams in order (lists of sample_id and the text rows, never sorted
sets): nothing lost, nothing repeated, same order as an uninterrupted run and as the contract's
layout ``(t*W + r)*B + j`` read through ``open_stream(spec).gather``.

Ranks are forked from a fork server that has torch imported (as in test_parallel.py); each rank
writes what it saw to a file with ``torch.save`` and the checks run here, in the pytest process.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy
import pytest
import torch
import yaml
from ranks import init_rank, spawn

from statefulset import (
    IndexedDatasetWriter,
    ParallelLayout,
    PlaceholderLoader,
    StatefulsetError,
    WorkerConfig,
    create_parallel_groups,
    get_savable_loader,
    get_train_dataset,
    open_stream,
)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

BATCH = 4
SEQ = 16
PACKINGS = ("native", "megatron", "bestfit")


# --- corpus, specs and the expected stream ------------------------------------------------------


@pytest.fixture(scope="module")
def specs(tmp_path_factory) -> dict[str, dict]:
    """A two-prefix native blend, a one-prefix megatron stream that wraps, and megatron over the other shard."""
    root = tmp_path_factory.mktemp("corpus")
    rng = numpy.random.default_rng(0)
    for name, docs in (("a", 30), ("b", 20)):
        with IndexedDatasetWriter(str(root / name), numpy.uint16) as writer:
            for _ in range(docs):
                writer.add_document(rng.integers(0, 60000, int(rng.integers(4, 48))).astype(numpy.uint16))
    common = {"seq_length": SEQ, "split": "90,10,0", "seed": 7, "path_to_cache": str(root / "cache")}
    out = {
        "native": {**common, "data_path": {str(root / "a"): 0.6, str(root / "b"): 0.4}, "packing": "native"},
        "megatron": {**common, "data_path": str(root / "a"), "packing": "megatron", "num_samples": 20},
        "bestfit": {**common, "data_path": {str(root / "a"): 0.5, str(root / "b"): 0.5}, "packing": "bestfit"},
    }
    out["megatron_b"] = {**out["megatron"], "data_path": str(root / "b")}
    for spec in out.values():
        open_stream(spec)  # build the megatron indices once, before ranks open the streams concurrently
    length = len(open_stream(out["megatron"]))
    # A short stream whose end falls inside a micro-batch, so some batch straddles the wrap.
    assert 30 < length < 60 and length % BATCH, length
    return out


def stream_rows(spec: dict, ids) -> torch.Tensor:
    """The stream's rows at global positions ``ids``; a finite (megatron) train stream repeats."""
    stream = open_stream(spec)
    ids = numpy.asarray(ids, dtype=numpy.int64).reshape(-1)
    read = ids if stream.unbounded else ids % len(stream)
    return torch.from_numpy(stream.gather(read))


def layout_ids(base: int, dp_rank: int, dp_size: int, first: int, steps: int) -> list[list[int]]:
    """The contract's layout: micro-batch ``t`` of DP rank ``r`` holds ``base + (t*W + r)*B + j``."""
    return [[base + (t * dp_size + dp_rank) * BATCH + j for j in range(BATCH)] for t in range(first, first + steps)]


def wrap_step(spec: dict, dp_size: int) -> int:
    """The micro-batch index (per rank) whose global batch holds the megatron stream's end."""
    return len(open_stream(spec)) // (dp_size * BATCH)


def dataset_rows(ds, ids) -> torch.Tensor:
    """``ds[p]`` for every position (contract section 4: a pure function of the spec and ``p``)."""
    samples = [ds[p] for batch in ids for p in batch]
    assert [s["sample_id"] for s in samples] == [p for batch in ids for p in batch]
    return torch.from_numpy(numpy.stack([s["text"] for s in samples]))


def check_rows(spec: dict, ids: list[list[int]], text: torch.Tensor) -> None:
    assert text.dtype == torch.int64 and tuple(text.shape) == (len(ids), BATCH, SEQ + 1)
    assert torch.equal(text.reshape(-1, SEQ + 1), stream_rows(spec, ids))
    ds = get_train_dataset(spec, batch_size=BATCH, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    assert torch.equal(text.reshape(-1, SEQ + 1), dataset_rows(ds, ids))


# --- helpers that run inside the ranks ----------------------------------------------------------


def _take(loader, steps: int) -> dict:
    """``steps`` batches as {"ids": [[...], ...], "text": [steps, B, SEQ+1]} (zip never pulls an extra batch)."""
    ids, text = [], []
    for _, batch in zip(range(steps), loader, strict=False):
        assert batch["sample_id"].dtype == torch.int64
        ids.append(batch["sample_id"].tolist())
        text.append(batch["text"])
    return {"ids": ids, "text": torch.stack(text) if text else torch.empty(0, BATCH, SEQ + 1, dtype=torch.int64)}


def _loader(spec, dp_rank: int, dp_size: int, num_workers: int, group=None):
    wc = WorkerConfig(rank=dp_rank, world_size=dp_size, num_workers=num_workers, data_parallel_group=group)
    return get_savable_loader(get_train_dataset(spec, batch_size=BATCH, worker_config=wc))


def _load(path) -> dict:
    return torch.load(path)  # weights_only=True, the default: records and states are plain data and tensors


# --- 1. the Energon parallelism guide, nearly verbatim, on 8 ranks ------------------------------

GUIDE_STEPS = 5  # before the save; as many again after it (the megatron stream wraps in there)


def _guide_rank(rank: int, world: int, init_file: str, workdir: str, order: str) -> None:
    init_rank(rank, world, init_file)
    os.chdir(workdir)
    import torch.distributed  # the guide's spelling

    layout = ParallelLayout(8, tp=2, pp=2, order=order)
    info = layout.rank_info(torch.distributed.get_rank())

    # Get the DP, PP, TP ranks
    global_rank = torch.distributed.get_rank()
    data_parallel_rank = info.dp_rank if info.loads_data else None
    pipeline_parallel_rank = info.pp_rank
    tensor_parallel_rank = info.tp_rank

    # The guide creates its DP groups on some ranks only; torch.distributed.new_group must be called
    # by every rank for every group, in the same order, so every rank creates them all (and the PP
    # groups that carry the first stage's batch to the placeholder stages).
    groups = create_parallel_groups(layout, ("dp", "pp"))
    data_parallel_group = groups["dp"] if data_parallel_rank is not None else None
    if data_parallel_rank is not None:
        assert info.data_parallel_ranks[data_parallel_rank] == global_rank

    def steps(loader, n: int) -> dict:
        """n lockstep steps: the first stage loads; later stages receive its sample_ids over PP."""
        ids, text = [], []
        for _, batch in zip(range(n), loader, strict=False):
            sample_id = batch["sample_id"] if batch is not None else torch.zeros(4, dtype=torch.int64)
            torch.distributed.broadcast(sample_id, src=info.first_stage_rank, group=groups["pp"])
            ids.append(sample_id.tolist())
            if batch is not None:
                text.append(batch["text"])
        return {"ids": ids, "text": torch.stack(text) if text else None}

    def make_loader():
        if data_parallel_rank is None:
            return PlaceholderLoader()
        # Set the worker config correspondingly
        worker_config = WorkerConfig(
            rank=data_parallel_rank,
            world_size=torch.distributed.get_world_size(data_parallel_group),
            num_workers=3,
            data_parallel_group=data_parallel_group,
        )
        # Create the loader with that config
        return get_savable_loader(
            get_train_dataset(
                "dataset.yaml",
                batch_size=4,
                shuffle_buffer_size=100,
                max_samples_per_sequence=100,
                worker_config=worker_config,
            )
        )

    record = {}
    if data_parallel_rank is not None:
        assert pipeline_parallel_rank == 0, "Only Pipeline Parallel ranks 0 load data"
    loader = make_loader()
    # Iterate the data
    record["before_save"] = steps(loader, GUIDE_STEPS)

    if data_parallel_rank is not None and tensor_parallel_rank == 0:
        # Save the state only for the first TP rank (the other TP ranks have a copy of that state)
        state = loader.save_state_rank()
        torch.save(state, f"dataloader_rank{data_parallel_rank}.pt")

        # Alternatively, save once for the whole dp group:
        state = loader.save_state_global(global_dst_rank=info.data_parallel_ranks[0])
        if state is not None:
            torch.save(state, "dataloader.pt")
        assert (state is not None) == (data_parallel_rank == 0)

    # The uninterrupted run: the same loader keeps training after the save.
    record["uninterrupted"] = steps(loader, GUIDE_STEPS)
    del loader
    torch.distributed.barrier()  # the checkpoint files are on disk

    # ... when loading:
    for how in ("rank", "global", "global_src_rank_0"):
        loader = make_loader()
        if data_parallel_rank is not None:
            assert pipeline_parallel_rank == 0, "Only Pipeline Parallel ranks 0 load data"
            if how == "rank":
                # E.g. load from disk as saved above
                state = torch.load(f"dataloader_rank{data_parallel_rank}.pt")
                # Restore the state
                loader.restore_state_rank(state)
            elif how == "global":
                # Alternatively, when using a global checkpoint, load the checkpoint from disk on every dp rank:
                state = torch.load("dataloader.pt")
                loader.restore_state_global(state)
            else:
                # Or load only once from disk for each dp group:
                if data_parallel_rank == 0:  # noqa: SIM108 (the guide's spelling)
                    state = torch.load("dataloader.pt")
                else:
                    state = None
                loader.restore_state_global(state, src_rank=0)
        else:
            loader.restore_state_rank(None)  # the same checkpoint hook runs on every rank
        record[how] = steps(loader, GUIDE_STEPS)
        del loader
    torch.save(record, f"record_{global_rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize(
    ("order", "packing"),
    [("tp-pp-dp", "native"), ("tp-cp-ep-dp-pp", "megatron")],
)
def test_energon_guide_on_eight_ranks(tmp_path, specs, order, packing):
    spec = specs[packing]
    (tmp_path / "dataset.yaml").write_text(yaml.safe_dump(spec))
    spawn(_guide_rank, 8, tmp_path, str(tmp_path), order)

    layout = ParallelLayout(8, tp=2, pp=2, order=order)
    records = {g: _load(tmp_path / f"record_{g}.pt") for g in range(8)}
    for g, record in records.items():
        info = layout.rank_info(g)
        if not info.loads_data:
            # Placeholder stages stepped in lockstep and received exactly their first stage's batches.
            source = records[info.first_stage_rank]
            for phase in ("before_save", "uninterrupted", "rank", "global", "global_src_rank_0"):
                assert record[phase]["ids"] == source[phase]["ids"], (g, phase)
                assert record[phase]["text"] is None
            continue
        whole = record["before_save"]["ids"] + record["uninterrupted"]["ids"]
        assert whole == layout_ids(0, info.dp_rank, 2, 0, 2 * GUIDE_STEPS), g
        check_rows(spec, whole, torch.cat([record["before_save"]["text"], record["uninterrupted"]["text"]]))
        for how in ("rank", "global", "global_src_rank_0"):
            assert record[how]["ids"] == record["uninterrupted"]["ids"], (g, how)
            assert torch.equal(record[how]["text"], record["uninterrupted"]["text"]), (g, how)
        # TP peers saw identical batches in every phase.
        for peer in info.tp_group_ranks:
            for phase, seen in record.items():
                assert seen["ids"] == records[peer][phase]["ids"], (g, peer, phase)
                assert torch.equal(seen["text"], records[peer][phase]["text"]), (g, peer, phase)
    if packing == "megatron":
        assert GUIDE_STEPS <= wrap_step(spec, 2) < 2 * GUIDE_STEPS  # the restored part crossed the wrap

    # One file per DP rank (from TP rank 0) plus the global one; all small and plain.
    assert sorted(p.name for p in tmp_path.glob("dataloader*.pt")) == [
        "dataloader.pt",
        "dataloader_rank0.pt",
        "dataloader_rank1.pt",
    ]
    states = _load(tmp_path / "dataloader.pt")
    assert states == [_load(tmp_path / "dataloader_rank0.pt"), _load(tmp_path / "dataloader_rank1.pt")]
    assert [s["batches"] for s in states] == [GUIDE_STEPS, GUIDE_STEPS]


# --- 2. restores at random points, with another worker count ------------------------------------

# (num_workers while saving, num_workers after restoring); a cut is a number of batches taken before the save.
WORKER_PAIRS = ((0, 3), (3, 1), (1, 0))


def _cut_points(specs: dict) -> dict[str, list[int]]:
    """Per packing: a random mid-epoch cut, a cut on the batch that straddles the wrap, and one past it."""
    rng = random.Random(20240611)
    cuts = {}
    for packing in PACKINGS:
        boundary = len(open_stream(specs[packing])) // (2 * BATCH)  # native: one pass over the windows
        cuts[packing] = [rng.randint(1, boundary - 1), boundary, boundary + 1]
    return cuts


def _random_points_rank(rank: int, world: int, init_file: str, workdir: str, specs: dict, cuts: dict) -> None:
    import torch.distributed as dist

    init_rank(rank, world, init_file)
    record = {}
    for p, packing in enumerate(PACKINGS):
        spec = specs[packing]
        total = max(cuts[packing]) + 3
        reference = _loader(spec, rank, world, 0)
        record[packing] = {"reference": _take(reference, total)}
        # ds[p] in this rank, for the other rank's positions too: the same everywhere.
        everyone = layout_ids(0, 0, 1, 0, total * world)
        record[packing]["ds"] = dataset_rows(reference.dataset, everyone)
        for i, cut in enumerate(cuts[packing]):
            save_nw, restore_nw = WORKER_PAIRS[(i + p) % len(WORKER_PAIRS)]
            before = _loader(spec, rank, world, save_nw)
            taken = _take(before, cut)
            use_global = (i + p) % 2 == 1
            if use_global:
                state = before.save_state_global(global_dst_rank=0)
                assert (state is None) == (rank != 0)
            else:
                state = before.save_state_rank()
                assert state["num_workers"] == save_nw
            # The saving loader's prefetched-but-untaken batches must not count: keep it alive meanwhile.
            after = _loader(spec, rank, world, restore_nw)
            if use_global:
                after.restore_state_global(state, src_rank=0)
            else:
                after.restore_state_rank(state)
            resumed = _take(after, total - cut)
            del before, after
            record[packing][f"cut{cut}"] = {
                "taken": taken,
                "resumed": resumed,
                "workers": [save_nw, restore_nw],
                "global": use_global,
            }
    torch.save(record, os.path.join(workdir, f"record_{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_restores_at_random_points_with_other_worker_counts(tmp_path, specs):
    cuts = _cut_points(specs)
    spawn(_random_points_rank, 2, tmp_path, str(tmp_path), {p: specs[p] for p in PACKINGS}, cuts)
    seen_pairs = set()
    for rank in range(2):
        record = _load(tmp_path / f"record_{rank}.pt")
        for packing in PACKINGS:
            spec = specs[packing]
            total = max(cuts[packing]) + 3
            reference = record[packing]["reference"]
            assert reference["ids"] == layout_ids(0, rank, 2, 0, total)
            check_rows(spec, reference["ids"], reference["text"])
            assert torch.equal(record[packing]["ds"], stream_rows(spec, layout_ids(0, 0, 1, 0, total * 2)))
            for cut in cuts[packing]:
                run = record[packing][f"cut{cut}"]
                seen_pairs.add(tuple(run["workers"]))
                ids = run["taken"]["ids"] + run["resumed"]["ids"]
                assert ids == reference["ids"], (rank, packing, cut, run["workers"], run["global"])
                text = torch.cat([run["taken"]["text"], run["resumed"]["text"]])
                assert torch.equal(text, reference["text"]), (rank, packing, cut, run["workers"])
    assert seen_pairs == set(WORKER_PAIRS)
    # The megatron cuts straddle the end of its stream: the resumed part reads rows from both epochs.
    boundary = len(open_stream(specs["megatron"]))
    assert max(cuts["megatron"]) * 2 * BATCH > boundary > min(cuts["megatron"]) * 2 * BATCH


# --- 3. elastic data parallelism: DP 2 -> 1 -> 4 -----------------------------------------------

ELASTIC = {"a": (2, 3, 1), "b": (1, 3, 0), "c": (4, 2, 2)}  # phase: (DP size, batches per rank, num_workers)


def _elastic_rank(rank: int, world: int, init_file: str, workdir: str, specs: dict, phase: str) -> None:
    import torch.distributed as dist

    init_rank(rank, world, init_file)
    dp, steps, workers = ELASTIC[phase]
    record = {}
    for packing in PACKINGS:
        loader = _loader(specs[packing], rank, dp, workers)
        if phase == "c":
            state = _load(os.path.join(workdir, f"{packing}_b.pt")) if rank == 0 else None
            loader.restore_state_global(state, src_rank=0)
        record[packing] = _take(loader, steps)
        state = loader.save_state_global(global_dst_rank=0)
        if phase == "a":
            if rank == 0:
                torch.save(state, os.path.join(workdir, f"{packing}_a.pt"))
            # A state where the ranks consumed different amounts: rank 1 took one batch more.
            if rank == 1:
                _take(loader, 1)
            uneven = loader.save_state_global(global_dst_rank=0)
            if rank == 0:
                torch.save(uneven, os.path.join(workdir, f"{packing}_uneven.pt"))
        del loader
    torch.save(record, os.path.join(workdir, f"record_{phase}_{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_elastic_data_parallel_2_to_1_to_4(tmp_path, specs):
    specs = {p: specs[p] for p in PACKINGS}
    spawn(_elastic_rank, 2, tmp_path, str(tmp_path), specs, "a")

    # DP 1, in this process: the global state of 2 ranks restores into one.
    dp_b, steps_b, workers_b = ELASTIC["b"]
    phase_b = {}
    for packing in PACKINGS:
        loader = _loader(specs[packing], 0, dp_b, workers_b)
        uneven = _load(tmp_path / f"{packing}_uneven.pt")
        with pytest.raises(StatefulsetError, match=r"consumed different numbers of batches \(rank 0: 3, rank 1: 4\)"):
            loader.restore_state_global(uneven)
        loader.restore_state_global(_load(tmp_path / f"{packing}_a.pt"))
        phase_b[packing] = _take(loader, steps_b)
        torch.save(loader.save_state_global(), tmp_path / f"{packing}_b.pt")
        del loader
        # The uneven state still restores into its own layout: each rank resumes where it was.
        for dp_rank in range(2):
            same = _loader(specs[packing], dp_rank, 2, 0)
            same.restore_state_global(uneven)
            assert same.batches_taken == 3 + dp_rank

    spawn(_elastic_rank, 4, tmp_path, str(tmp_path), specs, "c")

    for packing, spec in specs.items():
        consumed = 0
        for phase in "abc":
            dp, steps, _ = ELASTIC[phase]
            if phase == "b":
                per_rank = [phase_b[packing]]
            else:
                per_rank = [_load(tmp_path / f"record_{phase}_{r}.pt")[packing] for r in range(dp)]
            for r, seen in enumerate(per_rank):
                assert seen["ids"] == layout_ids(consumed, r, dp, 0, steps), (packing, phase, r)
            # The union over ranks, ordered by global position, is the single stream from `consumed` on.
            rows = {}
            for seen in per_rank:
                flat = [i for batch in seen["ids"] for i in batch]
                rows.update(zip(flat, seen["text"].reshape(-1, SEQ + 1), strict=True))
            order = sorted(rows)
            assert order == list(range(consumed, consumed + dp * steps * BATCH)), (packing, phase)
            assert torch.equal(torch.stack([rows[i] for i in order]), stream_rows(spec, order)), (packing, phase)
            consumed += dp * steps * BATCH
        if packing == "megatron":
            assert consumed > len(open_stream(spec))  # the last phase ran across the wrap


# --- 4. a training process killed with SIGKILL right after a save ------------------------------

TRAIN_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time, zlib
    import torch
    from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

    spec, workdir, stop, every = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
    loader = get_savable_loader(get_train_dataset(spec, batch_size=4, worker_config=wc))
    state_path = os.path.join(workdir, "loader.pt")
    step = 0
    if os.path.exists(state_path):
        checkpoint = torch.load(state_path)
        loader.restore_state_rank(checkpoint["loader"])
        step = checkpoint["step"]
    with open(os.path.join(workdir, "train.log"), "a") as log:
        log.write(f"start {step}\\n")
        log.flush()
        for _, batch in zip(range(stop - step), loader):
            step += 1
            ids = " ".join(map(str, batch["sample_id"].tolist()))
            log.write(f"{step} {ids} {zlib.crc32(batch['text'].numpy().tobytes())}\\n")
            log.flush()
            if step % every == 0:
                tmp = state_path + ".tmp"
                torch.save({"step": step, "loader": loader.save_state_rank()}, tmp)
                os.replace(tmp, state_path)
                print(f"saved {step}", flush=True)
            time.sleep(0.01)  # the forward-backward pass
    """
)


def _train(tmp_path: Path, spec: dict, stop: int, every: int) -> subprocess.Popen:
    import json

    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(
        [sys.executable, str(script), json.dumps(spec), str(tmp_path), str(stop), str(every)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: the kill takes its DataLoader workers too
    )


def test_sigkill_right_after_a_save_then_restart(tmp_path, specs):
    spec, every, kill_after = specs["megatron"], 4, 8
    stop = 2 * len(open_stream(spec)) // BATCH  # the restarted run goes on across the wrap
    assert kill_after < wrap_step(spec, 1) < stop

    proc = _train(tmp_path, spec, 10**6, every)  # an endless run: only the kill ends it
    try:
        for line in proc.stdout:
            if line.strip() == f"saved {kill_after}":
                os.killpg(proc.pid, signal.SIGKILL)
                break
    finally:
        if proc.poll() is None:  # killed above and not yet reaped, or this test failed mid-way
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    resumed_from = _load(tmp_path / "loader.pt")["step"]  # the atomic replace left a whole state
    assert resumed_from >= kill_after and resumed_from % every == 0

    restart = _train(tmp_path, spec, stop, every)
    out, _ = restart.communicate(timeout=60)
    assert restart.returncode == 0, out

    # The uninterrupted run, in this process.
    uninterrupted = _take(_loader(spec, 0, 1, 0), stop)
    assert uninterrupted["ids"] == layout_ids(0, 0, 1, 0, stop)
    reference = {
        step: (ids, zlib.crc32(text.numpy().tobytes()))
        for step, (ids, text) in enumerate(zip(uninterrupted["ids"], uninterrupted["text"], strict=True), start=1)
    }

    runs: list[list[tuple[int, list[int], int]]] = []
    for line in (tmp_path / "train.log").read_text().splitlines():
        words = line.split()
        if words[0] == "start":
            runs.append([])
            assert int(words[1]) == (0 if len(runs) == 1 else resumed_from)
            continue
        runs[-1].append((int(words[0]), [int(w) for w in words[1:-1]], int(words[-1])))
    killed, restarted = runs
    # The killed run: steps 1.. in order, past the saved step (batches lost by the kill are redone).
    assert [s for s, _, _ in killed] == list(range(1, len(killed) + 1)) and len(killed) >= resumed_from
    # After the restart the log continues exactly from the save point, up to the end.
    assert [s for s, _, _ in restarted] == list(range(resumed_from + 1, stop + 1))
    for step, ids, crc in killed + restarted:
        assert (ids, crc) == reference[step], step


# --- 5. states that do not fit ------------------------------------------------------------------


def _saved(spec, dp_rank: int = 0, dp_size: int = 1, batches: int = 2) -> dict:
    loader = _loader(spec, dp_rank, dp_size, 0)
    _take(loader, batches)
    return loader.save_state_rank()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        pytest.param({"seed": 8}, {"seed": "state has 7, this loader 8"}, id="seed"),
        pytest.param({"seq_length": 24}, {"seq_length": f"state has {SEQ}, this loader 24"}, id="seq_length"),
        pytest.param(
            {"split": "80,20,0"},
            {"split_ratios": "state has '90,10,0', this loader '80,20,0'", "data": "split ranges"},
            id="split",
        ),
        pytest.param(
            {"packing": "native", "num_samples": None},
            {"packing": "state has 'megatron', this loader 'native'", "num_samples": "state has 20, this loader None"},
            id="packing",
        ),
        pytest.param("megatron_b", {"data": "the shards, their split ranges or weights differ"}, id="other-shard"),
    ],
)
def test_a_state_from_other_data_is_refused_naming_what_differs(specs, change, named):
    state = _saved(specs["megatron"])
    other = specs[change] if isinstance(change, str) else {**specs["megatron"], **change}
    for restore in ("rank", "global"):
        loader = _loader(other, 0, 1, 0)
        with pytest.raises(StatefulsetError, match="does not fit this dataset") as caught:
            if restore == "rank":
                loader.restore_state_rank(state)
            else:
                loader.restore_state_global([state])
        # Exactly the fields that differ are named, each with what the state and the loader have.
        details = re.search(r"\((.*)\)$", str(caught.value)).group(1).split("; ")
        fields = dict(detail.split(": ", 1) for detail in details)
        assert set(fields) == set(named), str(caught.value)
        for field, text in named.items():
            assert text in fields[field], str(caught.value)
        # The refused restore left the loader untouched: it starts at the beginning of its own stream.
        assert next(iter(loader))["sample_id"].tolist() == [0, 1, 2, 3]


def test_a_state_from_a_newer_format_is_refused(specs):
    state = {**_saved(specs["megatron"]), "version": 99}
    with pytest.raises(StatefulsetError, match="version 99 is newer"):
        _loader(specs["megatron"], 0, 1, 0).restore_state_rank(state)
    with pytest.raises(StatefulsetError, match="version 99 is newer"):
        _loader(specs["megatron"], 0, 1, 0).restore_state_global([state])


def test_restore_state_rank_refuses_another_dp_ranks_state(specs):
    state = _saved(specs["native"], dp_rank=1, dp_size=2)
    with pytest.raises(StatefulsetError, match="saved by DP rank 1 of 2, this loader is DP rank 0 of 2"):
        _loader(specs["native"], 0, 2, 0).restore_state_rank(state)


def test_restore_after_iteration_started_is_refused(specs):
    state = _saved(specs["native"])
    for num_workers in (0, 1):
        loader = _loader(specs["native"], 0, 1, num_workers)
        first = next(iter(loader))
        with pytest.raises(StatefulsetError, match="started iterating"):
            loader.restore_state_rank(state)
        with pytest.raises(StatefulsetError, match="started iterating"):
            loader.restore_state_global([state])
        # The refused restore changed nothing: the stream goes on from batch 1.
        assert first["sample_id"].tolist() == [0, 1, 2, 3]
        assert next(loader)["sample_id"].tolist() == [4, 5, 6, 7]


def _save_to_a_rank_outside_the_world(rank: int, world: int, init_file: str, out: str) -> None:
    init_rank(rank, world, init_file)
    spec = torch.load(out + "/spec.pt")
    loader = _loader(spec, rank, world, 0)  # data_parallel_group None: the world
    try:
        loader.save_state_global(global_dst_rank=5)
        message = "no error"
    except StatefulsetError as error:
        message = str(error)
    torch.save(message, f"{out}/{rank}.pt")


def test_save_state_global_to_a_rank_outside_the_world_is_refused(tmp_path, specs):
    torch.save(specs["native"], tmp_path / "spec.pt")
    spawn(_save_to_a_rank_outside_the_world, 2, tmp_path, str(tmp_path))
    for rank in range(2):
        assert "global rank 5 is not in this rank's data_parallel_group" in _load(tmp_path / f"{rank}.pt")
