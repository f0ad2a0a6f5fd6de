"""Run a loading case: phase 1 takes batches and saves, phase 2 restores (other workers, start
method, batch size or DP size) and takes more; every batch must equal the reference ``ds[p]`` of an
uninterrupted, fault-free run on the pristine local shards, at the positions of Megatron's layout.
Phase 2 of a case whose data changed validly before it, in no stage begun before the state's position,
is compared with the changed data instead: such a state restores by contract (a state saved after 0
batches onto a re-tokenised corpus reads the new corpus from its start)."""

from __future__ import annotations

import contextlib
import datetime
import gc
import multiprocessing
import os
import pickle
import random
import signal
import time
import traceback

import numpy

from campaign import procs
from campaign.corpus import copy_shards
from campaign.loading_faults import DAMAGE_BEFORE_OPEN, REPLACE_MID_RUN, LoadFaults, damage_state
from campaign.outcome import Mismatch


def make_spec(case: dict, where: dict[str, str], cache: str, options: dict | None) -> dict:
    def mix(entries):
        if len(entries) == 1:
            return where[entries[0][0]]
        return {where[n]: w for n, w in entries}

    spec = {
        "seq_length": case["seq_length"],
        "split": case["split"],
        "seed": case["spec_seed"],
        "packing": case["packing"],
        "path_to_cache": cache,
    }
    if case["stages"]:
        spec["stages"] = [{"start": s, "data_path": mix(m)} for s, m in case["stages"]]
    else:
        spec["data_path"] = mix(case["sources"])
    if case["packing"] == "megatron":
        spec["num_samples"] = case["num_samples"]
    if options:
        spec["storage_options"] = options
    return spec


class Reference:
    """``ds[p]`` of the fault-free local spec: what an uninterrupted run yields at position p."""

    def __init__(self, spec: dict, document_boundaries: bool) -> None:
        from statefulset import WorkerConfig, get_train_dataset

        wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
        self.ds = get_train_dataset(spec, batch_size=1, worker_config=wc, document_boundaries=document_boundaries)
        self.memo: dict[int, dict] = {}

    def __call__(self, p: int) -> dict:
        if p not in self.memo:
            self.memo[p] = {k: numpy.asarray(v) for k, v in self.ds[p].items()}
        return self.memo[p]


def check_batch(batch: dict, positions: list[int], ref: Reference, where: str) -> None:
    ids = numpy.asarray(batch["sample_id"]).tolist()
    if ids != positions:
        raise Mismatch(f"{where}: sample_id {ids}, expected positions {positions}")
    want = [ref(p) for p in positions]
    if set(batch) != set(want[0]):
        raise Mismatch(f"{where}: keys {sorted(batch)}, expected {sorted(want[0])}")
    for key in want[0]:
        expected = numpy.stack([w[key] for w in want])
        got = numpy.asarray(batch[key])
        if got.dtype != expected.dtype or got.shape != expected.shape or not numpy.array_equal(got, expected):
            raise Mismatch(f"{where}: {key!r} differs from the reference ({got.dtype}{list(got.shape)})")


def _to_numpy(batch: dict) -> dict:
    return {k: v.numpy() if hasattr(v, "numpy") else numpy.asarray(v) for k, v in batch.items()}


def take(case: dict, phase: int, spec: dict, rank: int, world: int, state, faults: LoadFaults | None, gate=None):
    """Open, restore ``state`` (a rank state or a global list), take this phase's batches, save."""
    from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

    i = phase - 1
    workers = case["workers"][i]
    wc = WorkerConfig(rank=rank, world_size=world, num_workers=workers)
    ds = get_train_dataset(
        spec, batch_size=case["batch_sizes"][i], worker_config=wc, document_boundaries=case["document_boundaries"]
    )
    watch = {"watchdog_timeout_seconds": 4, "fail_on_timeout": True} if case["fault"] == "stop_worker" else {}
    if world > 1:
        watch["collective_timeout"] = 30  # a dead or stopped peer: a named error after 30 s, not 300
    loader = get_savable_loader(ds, multiprocessing_context=case["contexts"][i] if workers else None, **watch)
    if state is not None:
        if case["restore"] == "global":
            loader.restore_state_global(state)
        else:
            loader.restore_state_rank(state)
    before = set(procs.descendants(os.getpid()))
    batches = []
    it = iter(loader)
    for t in range(case["steps"][i]):
        if faults is not None:
            faults.at_batch(phase, t, before)
        batches.append(_to_numpy(next(it)))
        if gate is not None and t == 0:
            open(gate, "w").close()  # the rank took its first batch: a rank fault may land now
    saved = loader.save_state_global(0) if case["restore"] == "global" else loader.save_state_rank()
    del it, loader
    gc.collect()
    return batches, saved


def expected_positions(case: dict, phase: int, rank: int, t: int) -> list[int]:
    b1, b2 = case["batch_sizes"]
    w1, w2 = case["dp_sizes"]
    if phase == 1:
        first = (t * w1 + rank) * b1
        return list(range(first, first + b1))
    first = case["steps"][0] * w1 * b1 + (t * w2 + rank) * b2
    return list(range(first, first + b2))


def run_load(case: dict, env: dict) -> dict:
    work = env["work"]
    shards, s3, options, proxy = _storage(case, env, work)
    faults = LoadFaults(case, shards, s3, proxy)
    try:
        spec = make_spec(case, shards, os.path.join(work, "cache"), options)
        single = case["dp_sizes"] == (1, 1)
        got = _single_rank(case, spec, faults) if single else _ranks(case, spec, faults, work)
        ref = Reference(
            make_spec(case, env["shards"], os.path.join(work, "ref-cache"), None), case["document_boundaries"]
        )
        # Data changed before phase 2 that no stage begun before the state's position reads: the state
        # restores (CONTRACT: later stages may change) and phase 2 reads the new data, exactly.
        ref2 = ref
        if _continues_on_changed_data(case, faults.victim()):
            ref2 = Reference(
                make_spec(case, shards, os.path.join(work, "ref2-cache"), options), case["document_boundaries"]
            )
        for phase, rank, t, batch in got:
            where = f"phase {phase} rank {rank} batch {t}"
            check_batch(batch, expected_positions(case, phase, rank, t), ref if phase == 1 else ref2, where)
        return {"landed": faults.landed, "batches": len(got)}
    finally:
        faults.cleanup()
        if proxy is not None:
            proxy.close()


def _continues_on_changed_data(case: dict, victim: str) -> bool:
    """The shard changed (validly) before phase 2 is read by no stage begun before the state's position.

    A data schedule (any packing but megatron's, a plain data_path being a one-stage schedule) keeps
    only the stages begun before the position fixed; megatron's identity covers all its data."""
    # A truncated .bin or .idx is no valid data: it must always end in a named error.
    if (
        case["packing"] == "megatron"
        or case["fault"] not in ("retokenised_bin", "flip_idx")
        or case["fault_phase"] != 2
    ):
        return False
    position = case["steps"][0] * case["dp_sizes"][0] * case["batch_sizes"][0]
    stages = case["stages"] or [(0, case["sources"])]
    return all(victim not in [n for n, _ in mix] for start, mix in stages if start < position)


def _single_rank(case: dict, spec: dict, faults: LoadFaults) -> list:
    out = []
    faults.before_open(1, spec)
    batches, state = take(case, 1, spec, 0, 1, None, faults)
    out += [(1, 0, t, b) for t, b in enumerate(batches)]
    if case["fault"] == "damage_state" and case["fault_phase"] == 2:
        faults.landed = True
        state = (
            [damage_state(state[0], case["state_damage"])]
            if case["restore"] == "global"
            else damage_state(state, case["state_damage"])
        )
    faults.before_open(2, spec)
    batches, _ = take(case, 2, spec, 0, 1, state, faults)
    return out + [(2, 0, t, b) for t, b in enumerate(batches)]


def _storage(case: dict, env: dict, work: str):
    """Where this case's shards are (shared, or its own copy when a fault changes them), and the S3 client."""
    from campaign.s3 import CaseProxy, client, upload_copy

    own = case["fault"] in DAMAGE_BEFORE_OPEN + REPLACE_MID_RUN
    if case["storage"] == "local":
        return (copy_shards(env["shards"], os.path.join(work, "shards")) if own else env["shards"]), None, None, None
    os.environ["STATEFULSET_S3_CLIENT"] = case["s3_client"]
    os.environ["STATEFULSET_STORAGE_RETRIES"] = "4"
    os.environ["STATEFULSET_STORAGE_RETRY_SECONDS"] = "30"
    s3 = client(env["endpoint"])
    case["bucket"] = env["bucket"]
    prefix = f"cases/{case['seed']}" if own else "shared"
    if own:
        upload_copy(s3, env["bucket"], env["shards"], prefix)
    shards = {n: f"s3://{env['bucket']}/{prefix}/{n}" for n in env["shards"]}
    options = {"endpoint_url": env["endpoint"], "key": "testing", "secret": "testing"}
    proxy = None
    if case["storage"] == "s3-proxy":
        proxy = CaseProxy(env["endpoint"])
        options = {
            **options,
            "endpoint_url": proxy.endpoint,
            "config_kwargs": {"read_timeout": 5, "connect_timeout": 5},
        }
    return shards, s3, options, proxy


# -- DP > 1: real gloo groups, one process per rank --------------------------------------------------
def _rank_main(rank: int, world: int, init_file: str, case: dict, phase: int, spec: dict, state_file: str, out: str):
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        state = None
        if phase == 2:
            with open(state_file, "rb") as f:
                state = pickle.load(f)
        batches, saved = take(case, phase, spec, rank, world, state, None, gate=f"{out}.started")
        with open(f"{out}.{rank}", "wb") as f:
            pickle.dump(("ok", batches, saved), f)
    except BaseException as exc:  # reported to the case process, which re-raises it
        with open(f"{out}.{rank}", "wb") as f:
            pickle.dump(("error", exc if _picklable(exc) else RuntimeError(repr(exc)), traceback.format_exc()), f)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        os._exit(0)


def _picklable(exc: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(exc))
        return True
    except Exception:
        return False


def _phase_ranks(case: dict, phase: int, spec: dict, work: str) -> list:
    world = case["dp_sizes"][phase - 1]
    init = os.path.join(work, f"rendezvous-{phase}")
    out = os.path.join(work, f"phase{phase}")
    ctx = multiprocessing.get_context("fork")
    ranks = [
        ctx.Process(target=_rank_main, args=(r, world, init, case, phase, spec, os.path.join(work, "state"), out))
        for r in range(world)
    ]
    for p in ranks:
        p.start()
    victim = _signal_rank(case, phase, ranks, out)
    deadline = time.monotonic() + 240
    for p in ranks:
        if p is not victim:
            p.join(max(0.0, deadline - time.monotonic()))
    if victim is not None:
        victim.kill()  # a stopped rank stays stopped until the others are done
        victim.join(30)
    results = {}
    for r in range(world):
        if os.path.exists(f"{out}.{r}"):
            with open(f"{out}.{r}", "rb") as f:
                results[r] = pickle.load(f)
        elif ranks[r] is not victim:
            raise RuntimeError(f"rank {r} of phase {phase} ended with exit code {ranks[r].exitcode} and no result")
    errors = [rest for status, *rest in results.values() if status == "error"]
    named = [e for e, _ in errors if _is_named(e)]
    if errors:
        raise (named or [errors[0][0]])[0]
    # The others finished although the victim left no result: it was signalled after its part of the
    # collective, before it wrote its file. Their batches are still checked.
    return [results.get(r, ("ok", [], None)) for r in range(world)]


def _is_named(exc: BaseException) -> bool:
    from statefulset import StatefulsetError

    return isinstance(exc, StatefulsetError)


def _signal_rank(case: dict, phase: int, ranks: list, out: str):
    """For kill_rank / stop_rank: the last rank, once one rank took a batch (or all are done)."""
    if not case["fault"].endswith("_rank") or case["fault_phase"] != phase or len(ranks) < 2:
        return None
    deadline = time.monotonic() + 120
    while not os.path.exists(f"{out}.started") and any(p.is_alive() for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(random.Random(case["seed"]).uniform(0.0, 1.0))
    victim = ranks[-1]
    if victim.is_alive():
        os.kill(victim.pid, signal.SIGKILL if case["fault"] == "kill_rank" else signal.SIGSTOP)
        case["landed"] = True
        return victim
    return None


def _ranks(case: dict, spec: dict, faults: LoadFaults, work: str) -> list:
    faults.before_open(1, spec)
    results = _phase_ranks(case, 1, spec, work)
    state = results[0][2]
    if case["fault"] == "damage_state" and case["fault_phase"] == 2:
        faults.landed = True
        state = [damage_state(s, case["state_damage"]) for s in state]
    with open(os.path.join(work, "state"), "wb") as f:
        pickle.dump(state, f)
    out = [(1, r, t, b) for r, (_, batches, _) in enumerate(results) for t, b in enumerate(batches)]
    faults.before_open(2, spec)
    results = _phase_ranks(case, 2, spec, work)
    return out + [(2, r, t, b) for r, (_, batches, _) in enumerate(results) for t, b in enumerate(batches)]
