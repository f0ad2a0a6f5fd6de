"""Draw a loading case: packing x document boundaries x stages x blends x workers x start method x
storage x save/restore point x DP/worker/batch-size change x one fault."""

from __future__ import annotations

import random

NAMES = ("web", "code", "math")

# fault -> (weight, what it needs): "workers" (a worker process to signal), "s3", "proxy"
FAULTS = {
    "none": (30, ()),
    "kill_worker": (8, ("workers",)),
    "stop_worker_cont": (5, ("workers",)),
    "stop_worker": (4, ("workers",)),
    "replace_rename": (4, ("local",)),
    "replace_inplace": (4, ("local",)),
    "replace_object": (5, ("s3",)),
    "truncate_bin": (4, ()),
    "truncate_idx": (3, ()),
    "flip_idx": (4, ()),
    "retokenised_bin": (5, ()),
    "damage_state": (8, ()),
    "lock_holder_kill": (5, ()),
    "lock_holder_stop": (3, ()),
    "s3_503": (5, ("proxy",)),
    "s3_drop": (4, ("proxy",)),
    "s3_stall": (3, ("proxy",)),
}
STATE_DAMAGE = ("drop_key", "version", "format", "seed", "data", "negative", "type", "dp_rank", "batch_size", "garbage")


def _mix(rng: random.Random) -> list[tuple[str, float]]:
    names = rng.sample(NAMES, rng.choice((1, 1, 2, 3)))
    return [(n, round(rng.uniform(0.1, 1.0), 3)) for n in names]


def _fault(rng: random.Random, storage: str, workers: tuple[int, int], dp: bool) -> str:
    usable = []
    for name, (weight, needs) in FAULTS.items():
        if "workers" in needs and (max(workers) == 0 or dp):
            continue
        if ("local" in needs and storage != "local") or ("s3" in needs and storage == "local"):
            continue
        if "proxy" in needs and storage != "s3-proxy":
            continue
        if dp and name not in ("none", "damage_state", "retokenised_bin", "truncate_bin"):
            continue
        usable += [name] * weight
    return rng.choice(usable)


def draw_load(rng: random.Random, long_form: bool) -> dict:
    packing = rng.choice(("megatron", "native", "bestfit"))
    stages = None
    if packing != "megatron" and rng.random() < 0.4:
        start, stages = 0, []
        for _ in range(rng.randint(2, 3)):
            stages.append((start, _mix(rng)))
            start += rng.randint(1, 60)
    dp = long_form and rng.random() < 0.08
    dp_sizes = (rng.randint(1, 3), rng.randint(1, 3)) if dp else (1, 1)
    workers = (rng.choice((0, 0, 1, 2, 3)), rng.choice((0, 1, 2, 3)))
    if dp:
        workers = (rng.choice((0, 1)), rng.choice((0, 1)))  # ranks x workers on 2 cores
    storage = rng.choice(("local", "local", "local", "s3", "s3-proxy"))
    if long_form and storage != "local" and rng.random() < 0.3:
        storage = "local"  # the same economy as for preprocessing
    case = {
        "kind": "load",
        "packing": packing,
        "document_boundaries": rng.random() < 0.5,
        "sources": _mix(rng),
        "stages": stages,
        "seq_length": rng.choice((8, 16, 32, 64)),
        "split": rng.choice(("1", "90,10,0", "70,20,10")),
        "spec_seed": rng.randint(0, 10_000),
        "num_samples": 900 if packing == "megatron" else None,
        "workers": workers,
        "contexts": (
            rng.choice(("fork", "fork", "fork", "forkserver")),
            rng.choice(("fork", "fork", "fork", "forkserver")),
        ),
        "storage": storage,
        "s3_client": rng.choice(("obstore", "s3fs")),
        "batch_sizes": (rng.randint(1, 4), rng.randint(1, 4)),
        "dp_sizes": dp_sizes,
        "restore": "global" if dp or rng.random() < 0.4 else "rank",
        "steps": (rng.randint(0, 6), rng.randint(1, 6)),  # batches before the save, after the restore
    }
    if case["restore"] == "rank":
        case["batch_sizes"] = (case["batch_sizes"][0],) * 2
    case["fault"] = _fault(rng, storage, workers, dp)
    case["fault_phase"] = rng.choice((1, 2))
    if dp and max(dp_sizes) > 1 and rng.random() < 0.4:  # a rank killed or stopped (long form only)
        case["fault"] = rng.choice(("kill_rank", "stop_rank"))
    if case["fault"] in ("damage_state", "retokenised_bin"):
        case["fault_phase"] = 2  # a state is damaged, or the data re-tokenised, between save and restore
    case["fault_at"] = rng.randint(0, max(0, case["steps"][case["fault_phase"] - 1] - 1))
    case["state_damage"] = rng.choice(STATE_DAMAGE)
    return case
