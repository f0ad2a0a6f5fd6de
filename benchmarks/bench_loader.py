"""The savable loader against torchdata's ``StatefulDataLoader``: resume, state size, throughput.

Both loaders read the same shard (the 1,000,000-document corpus of ``corpus.py``, written to
``benchmarks/out/loader/`` when missing) through the same stream, ``statefulset.open_stream(spec)``
with ``seq_length`` 2048, split ``100,0,0``, seed 1234, micro-batch 8, DP rank 0 of 1:

* ``packing: native``: unbounded, computed from the position (one pass is 244,132 windows; the
  late position, 800,000 samples, is in the fourth pass).
* ``packing: megatron`` with ``num_samples`` 5,000,000 and ``path_to_cache`` (megatron-core's
  GPTDataset, the version the results' environment names: 5,126,793 samples over 21 epochs). The
  parent builds the cache once in a child before anything is timed; every timed open mmaps the
  cached indices.

Loaders:

* ``ours``: ``get_savable_loader(get_train_dataset(spec, batch_size=8, worker_config=
  WorkerConfig(rank=0, world_size=1, num_workers=W)))``; state ``save_state_rank()``.
* ``torchdata``: ``StatefulDataLoader(StreamMap(spec), batch_size=8, num_workers=W)`` with the
  default collate, where ``StreamMap`` is a map-style ``torch.utils.data.Dataset`` whose
  ``__getitem__(i)`` is ``open_stream(spec)[i]`` and whose length is the megatron stream's
  (native: ``num_samples``, 5,000,000). With ``shuffle=False`` its batch ``t`` holds positions
  ``8t .. 8t+7``: the very samples our loader gives (checked every run). With ``shuffle=True``
  (its own ``RandomSampler``, seeded) it gives the same samples in another order: the usual way to
  shuffle a map-style dataset with it, whose resume costs differ, so both are measured.

Parts (each measurement a fresh child process; repeats interleaved in rotating order; medians):

1. ``resume``. A ``consume`` child builds the loader, takes N batches (N = 100 and N = 100,000,
   really iterated: nothing is constructed by hand), saves the state with ``torch.save``, then
   takes one more batch as the uninterrupted reference. Then, per repeat, a ``resume`` child
   times, after its imports: building dataset and loader, ``torch.load(weights_only=True)`` of
   the state plus ``restore_state_rank`` / ``load_state_dict``, and ``iter`` plus the first
   ``next``. Its first batch must equal the reference (sample ids and a hash of the tokens).
   A ``fresh`` child (no state) gives the start-up floor.
2. ``size``. The states of part 1: ``torch.save`` bytes, ``pickle`` bytes, and for ours also
   ``statefulset.loading.state.encode`` (msgpack) bytes.
3. ``throughput``. A child iterates for ``--seconds`` after 20 warm-up batches; tokens/s counts
   ``8 × seq_length`` tokens per batch. Then it times 10,000 single calls of ``save_state_rank()``
   (torchdata: ``state_dict()``) at that position and reports the median and p99. One more child
   per repeat times the hand-off of one batch from a worker process to the main process (send and
   receive side apart), the per-batch cost every ``torch.utils.data`` worker pays.

Before each resume and throughput child the parent waits (up to ``--max-wait`` s) until other
processes use less than ``--foreign-limit`` cores, and redoes a run during which they used more.

Output: a markdown section on stdout and in ``benchmarks/out/loader/bench_loader.md``; every run,
with its command and load average, in ``benchmarks/out/loader/bench_loader.json``. ``--pool A.json
B.json ...`` runs nothing and reports the runs of several such files together (same code and
configuration), into ``bench_loader.pooled.{md,json}``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import pickle
import resource
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any

from bench_read import find_or_write_shard, warm
from benchenv import busy_cpu_s, environment, environment_markdown, git_state, load_average, spread, wait_for_quiet
from corpus import OUT_DIR, add_docs_argument
from plots import add_plot_argument, apply_quick, publish_result

SEQ_LENGTH = 2048
DEFAULT_SECONDS = 8.0  # timed iteration per throughput process
SEED = 1234
SPLIT = "100,0,0"
BATCH = 8
NUM_SAMPLES = 5_000_000
WORKERS = (0, 2)
EARLY, LATE = 100, 100_000
# (loader, packing, shuffle, batched fetch): torchdata's shuffle=False is the same batch stream as ours.
VARIANTS = {
    "ours_native": ("ours", "native", False, False),
    "ours_megatron": ("ours", "megatron", False, False),
    "td_native": ("torchdata", "native", False, False),
    "td_megatron": ("torchdata", "megatron", False, False),
    "td_native_shuffle": ("torchdata", "native", True, False),
    "td_native_batched": ("torchdata", "native", False, True),
}
RESUME_VARIANTS = ("ours_native", "ours_megatron", "td_native", "td_megatron", "td_native_shuffle")
THROUGHPUT_VARIANTS = ("ours_native", "ours_megatron", "td_native", "td_megatron", "td_native_batched")
LABELS = {
    "ours_native": "statefulset `SavableLoader`, native",
    "ours_megatron": "statefulset `SavableLoader`, megatron (cached)",
    "td_native": "torchdata `StatefulDataLoader`, native, shuffle=False",
    "td_megatron": "torchdata `StatefulDataLoader`, megatron (cached), shuffle=False",
    "td_native_shuffle": "torchdata `StatefulDataLoader`, native, shuffle=True",
    "td_native_batched": "torchdata `StatefulDataLoader`, native, shuffle=False, `__getitems__`",
}
# Which of our variants a torchdata variant is compared with.
OURS_FOR = {
    "td_native": "ours_native",
    "td_megatron": "ours_megatron",
    "td_native_shuffle": "ours_native",
    "td_native_batched": "ours_native",
}
LATENCY_CALLS = 10_000
IPC_BATCHES = 2_000
# anchor-energon.md §0 and §6: Energon 7.4.1, 2 workers, simple pipeline.
ENERGON = {"pickle": "53.2–55.3 KB", "torch_save": "63.5–65.7 KB", "save_latency": "9–90 ms"}
TARGET_LATE_OVER_EARLY = 1.2
TARGET_VS_TORCHDATA = 5.0


# -- the child side: one measurement per process -------------------------------------------------
def _spec(job: dict[str, Any]) -> dict[str, Any]:
    spec = {"data_path": job["prefix"], "seq_length": job["seq_length"], "split": SPLIT, "seed": SEED}
    if job["packing"] == "native":
        return {**spec, "packing": "native"}
    return {**spec, "packing": "megatron", "num_samples": job["num_samples"], "path_to_cache": job["cache"]}


def _stream_map_class(batched: bool):
    import numpy
    import torch

    from statefulset import open_stream

    class StreamMap(torch.utils.data.Dataset):
        """Map-style view of a stream: item ``i`` is ``stream[i]``, as a torchdata user would write it."""

        def __init__(self, spec: dict[str, Any], length: int | None) -> None:
            self.stream = open_stream(spec)
            self.length = len(self.stream) if length is None else length

        def __len__(self) -> int:
            return self.length

        def __getitem__(self, i: int) -> dict[str, Any]:
            return self.stream[i]

    class BatchedStreamMap(StreamMap):
        """The same items, fetched for a whole batch with one ``gather`` (torch calls ``__getitems__``)."""

        def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
            rows = self.stream.gather(numpy.asarray(indices, dtype=numpy.int64))
            return [{"text": rows[k], "sample_id": i} for k, i in enumerate(indices)]

    return BatchedStreamMap if batched else StreamMap


def _build(job: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(loader, save_state, restore_state) for the job's variant."""
    import torch

    loader_kind, packing, shuffle, batched = VARIANTS[job["variant"]]
    spec = _spec({**job, "packing": packing})
    workers = job["workers"]
    if loader_kind == "ours":
        from statefulset import WorkerConfig, get_savable_loader, get_train_dataset

        wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
        loader = get_savable_loader(get_train_dataset(spec, batch_size=BATCH, worker_config=wc))
        return loader, loader.save_state_rank, loader.restore_state_rank
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset = _stream_map_class(batched)(spec, job["num_samples"] if packing == "native" else None)
    generator = torch.Generator().manual_seed(SEED) if shuffle else None
    loader = StatefulDataLoader(dataset, batch_size=BATCH, shuffle=shuffle, num_workers=workers, generator=generator)
    return loader, loader.state_dict, loader.load_state_dict


def _fingerprint(batch: dict[str, Any]) -> dict[str, Any]:
    text = batch["text"].numpy()
    return {
        "ids": batch["sample_id"].tolist(),
        "shape": list(text.shape),
        "hash": hashlib.blake2b(text.tobytes(), digest_size=8).hexdigest(),
    }


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _sizes(state: Any, ours: bool) -> dict[str, int]:
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    out = {"torch_save": len(buf.getvalue()), "pickle": len(pickle.dumps(state))}
    if ours:
        from statefulset.loading.state import encode

        out["msgpack"] = len(encode(state))
    return out


def child_prepare(job: dict[str, Any]) -> dict[str, Any]:
    from statefulset import open_stream

    t0 = time.perf_counter()
    stream = open_stream(_spec({**job, "packing": "megatron"}))
    open_s = time.perf_counter() - t0
    native_pass = len(open_stream(_spec({**job, "packing": "native"})))
    return {"open_s": open_s, "samples": len(stream), "native_windows_per_pass": native_pass}


def child_consume(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    loader, save, _ = _build(job)
    it = iter(loader)
    t0 = time.perf_counter()
    for _ in range(job["batches"]):
        next(it)
    consume_s = time.perf_counter() - t0
    state = save()
    torch.save(state, job["state_path"])
    reference = _fingerprint(next(it))
    ours = VARIANTS[job["variant"]][0] == "ours"
    return {"consume_s": consume_s, "reference": reference, "sizes": _sizes(state, ours)}


def child_resume(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    c0, t0 = _cpu(), time.perf_counter()
    loader, _, restore = _build(job)
    t1 = time.perf_counter()
    if job.get("state_path"):
        restore(torch.load(job["state_path"], weights_only=True))
    t2 = time.perf_counter()
    batch = next(iter(loader))
    t3 = time.perf_counter()
    c1 = _cpu()
    return {
        "build_s": t1 - t0,
        "restore_s": t2 - t1,
        "first_s": t3 - t2,
        "total_s": t3 - t0,
        "main_cpu_s": c1 - c0,
        "first": _fingerprint(batch),
    }


def child_throughput(job: dict[str, Any]) -> dict[str, Any]:
    loader, save, _ = _build(job)
    it = iter(loader)
    for _ in range(20):
        next(it)
    clock = time.perf_counter
    batches, t0, c0 = 0, clock(), _cpu()
    while True:
        next(it)
        batches += 1
        elapsed = clock() - t0
        if elapsed >= job["seconds"]:
            break
    main_cpu = _cpu() - c0
    calls = []
    ns = time.perf_counter_ns
    for _ in range(LATENCY_CALLS):
        a = ns()
        save()
        calls.append(ns() - a)
    calls.sort()
    return {
        "batches": batches,
        "seconds": elapsed,
        "batches_per_s": batches / elapsed,
        "tokens_per_s": batches * BATCH * job["seq_length"] / elapsed,
        "main_cpu_per_s": main_cpu / elapsed,
        "save_us_median": calls[len(calls) // 2] / 1e3,
        "save_us_p99": calls[int(len(calls) * 0.99)] / 1e3,
    }


def _ipc_sender(conn: Any, count: int, width: int, done: Any) -> None:
    """What a worker does per batch: both tensors of a fresh batch pickled for the queue (moved to shared memory)."""
    from multiprocessing.reduction import ForkingPickler

    import torch

    payloads, t0 = [], time.perf_counter()
    for _ in range(count):
        text, ids = torch.zeros((BATCH, width), dtype=torch.int64), torch.arange(BATCH)
        payloads.append((bytes(ForkingPickler.dumps(text)), bytes(ForkingPickler.dumps(ids))))
    conn.send(((time.perf_counter() - t0) / count, payloads))
    done.wait()  # the receiver fetches each tensor's file descriptor from this process


def child_ipc(job: dict[str, Any]) -> dict[str, Any]:
    """Cost of handing one batch from a worker process to the main process, send and receive side apart.

    torch's DataLoader moves every tensor a worker returns into a new shared-memory segment and
    the main process fetches its file descriptor over a socket from the worker; both loaders pay
    this per tensor (a batch here holds two: text and sample ids).
    """
    import pickle

    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    done = ctx.Event()
    sender = ctx.Process(target=_ipc_sender, args=(there, job["batches"], job["seq_length"] + 1, done))
    sender.start()
    send_s, payloads = here.recv()
    t0 = time.perf_counter()
    for text, ids in payloads:
        pickle.loads(text).sum()
        pickle.loads(ids)
    receive_s = (time.perf_counter() - t0) / len(payloads)
    done.set()
    sender.join()
    return {"send_us": send_s * 1e6, "receive_us": receive_s * 1e6}


CHILDREN = {
    "ipc": child_ipc,
    "prepare": child_prepare,
    "consume": child_consume,
    "resume": child_resume,
    "throughput": child_throughput,
}


def run_child(job: dict[str, Any]) -> dict[str, Any]:
    # torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates, once per loader.
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    t_start = time.perf_counter()
    import torch  # noqa: F401  (imports are not timed; they are the same for both loaders)

    import statefulset

    # The package imports its loader and stream modules on first use (statefulset.__getattr__):
    # import them here too, or ours' "build" would time ~10 ms of imports torchdata's does not.
    for name in ("WorkerConfig", "get_savable_loader", "get_train_dataset", "open_stream"):
        getattr(statefulset, name)
    if VARIANTS.get(job.get("variant", ""), ("ours",))[0] == "torchdata":
        import torchdata.stateful_dataloader  # noqa: F401
    import_s = time.perf_counter() - t_start
    result = CHILDREN[job["role"]](job)
    result["import_s"] = import_s
    return result


# -- the parent side -----------------------------------------------------------------------------
def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def spawn(job: dict[str, Any], quiet: dict[str, float] | None = None) -> dict[str, Any]:
    """Run one child; with ``quiet``, wait for an idle machine first and redo runs another process disturbed.

    ``foreign_cores``: CPU the machine spent on anything but this child (and its workers) while it
    ran, divided by its wall time. A run above ``quiet["limit"]`` is redone up to ``quiet["retries"]``
    times; the last attempt is kept either way, and every attempt is recorded.
    """
    attempts = []
    for attempt in range(1 + int(quiet["retries"] if quiet else 0)):
        waited = wait_for_quiet(quiet["max_wait"], quiet["limit"]) if quiet else 0.0
        load = load_average()
        busy0, own0, t0 = busy_cpu_s(), _children_cpu_s(), time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(job)]
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
        wall = time.perf_counter() - t0
        own = _children_cpu_s() - own0
        result = json.loads(out.strip().splitlines()[-1])
        foreign = max(busy_cpu_s() - busy0 - own, 0.0) / wall
        result.update(process_s=wall, load_before=load, waited_s=waited, foreign_cores=foreign, attempt=attempt)
        attempts.append(foreign)
        if quiet is None or foreign <= quiet["limit"]:
            break
        print(f"  redo: other processes used {foreign:.2f} cores during the run", file=sys.stderr)
    result["attempts_foreign_cores"] = attempts
    return {**job, **result}


def _state_path(out_dir: str, variant: str, workers: int, batches: int) -> str:
    return os.path.join(out_dir, "states", f"{variant}_w{workers}_n{batches}.pt")


def make_states(base: dict[str, Any], out_dir: str, positions: tuple[int, ...], reuse: bool) -> list[dict[str, Any]]:
    os.makedirs(os.path.join(out_dir, "states"), exist_ok=True)
    runs = []
    for variant in RESUME_VARIANTS:
        for workers in WORKERS:
            for batches in positions:
                path = _state_path(out_dir, variant, workers, batches)
                meta_path = path + ".json"
                job = {**base, "role": "consume", "variant": variant, "workers": workers, "batches": batches}
                job["state_path"] = path
                if reuse and os.path.exists(path) and os.path.exists(meta_path):
                    with open(meta_path) as f:
                        meta = json.load(f)
                    if all(meta.get(k) == v for k, v in job.items()):
                        runs.append(meta)
                        continue
                run = spawn(job)
                with open(meta_path, "w") as f:
                    json.dump(run, f)
                runs.append(run)
                print(
                    f"state {variant} w={workers} N={batches}: consumed in {run['consume_s']:.1f} s, "
                    f"{run['sizes']['torch_save']} B",
                    file=sys.stderr,
                )
    return runs


def rotate(items: list[Any], k: int) -> list[Any]:
    k %= len(items)
    return items[k:] + items[:k]


def run_resumes(
    base: dict[str, Any], out_dir: str, positions: tuple[int, ...], repeats: int, quiet: dict[str, float]
) -> list[dict[str, Any]]:
    jobs = []
    for variant in RESUME_VARIANTS:
        for workers in WORKERS:
            for batches in (0, *positions):
                path = _state_path(out_dir, variant, workers, batches) if batches else None
                jobs.append({**base, "role": "resume", "variant": variant, "workers": workers, "batches": batches,
                             "state_path": path})  # fmt: skip
    runs = []
    for rep in range(repeats):
        for job in rotate(jobs, rep * 7):
            run = spawn(job, quiet)
            run["repeat"] = rep
            runs.append(run)
            print(
                f"resume rep {rep + 1}/{repeats} {job['variant']} w={job['workers']} N={job['batches']}: "
                f"{run['total_s']:.3f} s",
                file=sys.stderr,
            )
    return runs


def run_throughput(base: dict[str, Any], repeats: int, seconds: float, quiet: dict[str, float]) -> list[dict[str, Any]]:
    jobs = [
        {**base, "role": "throughput", "variant": v, "workers": w, "seconds": seconds}
        for v in THROUGHPUT_VARIANTS
        for w in WORKERS
    ]
    jobs.append({**base, "role": "ipc", "variant": "ipc", "workers": 1, "batches": IPC_BATCHES})
    runs = []
    for rep in range(repeats):
        for job in rotate(jobs, rep * 3):
            run = spawn(job, quiet)
            run["repeat"] = rep
            runs.append(run)
            what = (
                f"{run['tokens_per_s'] / 1e6:.1f}M tokens/s" if "tokens_per_s" in run else f"{run['receive_us']:.0f} µs"
            )
            print(f"throughput rep {rep + 1}/{repeats} {job['variant']} w={job['workers']}: {what}", file=sys.stderr)
    return runs


# -- summary and report --------------------------------------------------------------------------
def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    positions = result["positions"]
    refs = {(s["variant"], s["workers"], s["batches"]): s["reference"] for s in result["states"]}
    resume: dict[str, Any] = {}
    for variant in RESUME_VARIANTS:
        for w in WORKERS:
            row: dict[str, Any] = {}
            for n in (0, *positions):
                runs = [r for r in result["resume"] if (r["variant"], r["workers"], r["batches"]) == (variant, w, n)]
                if not runs:
                    continue
                equal = sum(r["first"] == refs[(variant, w, n)] for r in runs) if n else None
                row[str(n)] = {
                    "total_s": spread([r["total_s"] for r in runs]),
                    **{k: _median(runs, k) for k in ("build_s", "restore_s", "first_s", "main_cpu_s", "process_s")},
                    "equal": equal,
                    "runs": len(runs),
                }
            early, late = row[str(positions[0])], row[str(positions[-1])]
            row["late_over_early"] = late["total_s"]["median"] / early["total_s"]["median"]
            resume[f"{variant}/w{w}"] = row
    for variant, ours in OURS_FOR.items():
        if variant not in RESUME_VARIANTS:
            continue
        for w in WORKERS:
            t, o = resume[f"{variant}/w{w}"], resume[f"{ours}/w{w}"]
            for n in (0, *positions):
                t[str(n)]["vs_ours"] = t[str(n)]["total_s"]["median"] / o[str(n)]["total_s"]["median"]
    # Same batches: torchdata shuffle=False against ours, at every saved position.
    same = {
        f"{td}/w{w}/n{n}": refs[(td, w, n)] == refs[(OURS_FOR[td], w, n)]
        for td in ("td_native", "td_megatron")
        for w in WORKERS
        for n in positions
    }
    sizes = {f"{s['variant']}/w{s['workers']}/n{s['batches']}": s["sizes"] for s in result["states"]}
    consume = {f"{s['variant']}/w{s['workers']}/n{s['batches']}": s["consume_s"] for s in result["states"]}
    throughput: dict[str, Any] = {}
    for variant in THROUGHPUT_VARIANTS:
        for w in WORKERS:
            runs = [r for r in result["throughput"] if (r["variant"], r["workers"]) == (variant, w)]
            if runs:
                throughput[f"{variant}/w{w}"] = {
                    "tokens_per_s": spread([r["tokens_per_s"] for r in runs]),
                    "batches_per_s": _median(runs, "batches_per_s"),
                    "main_cpu_per_s": _median(runs, "main_cpu_per_s"),
                    "save_us_median": _median(runs, "save_us_median"),
                    "save_us_p99": _median(runs, "save_us_p99"),
                    "runs": len(runs),
                }
    ipc = [r for r in result["throughput"] if r["role"] == "ipc" and "receive_us" in r]
    if ipc:
        throughput["ipc"] = {
            "send_us": spread([r["send_us"] for r in ipc]),
            "receive_us": spread([r["receive_us"] for r in ipc]),
        }
    for variant, ours in OURS_FOR.items():
        for w in WORKERS:
            key = f"{variant}/w{w}"
            if key in throughput:
                ratio = throughput[f"{ours}/w{w}"]["tokens_per_s"]["median"] / throughput[key]["tokens_per_s"]["median"]
                throughput[key]["ours_over_this"] = ratio
    return {"resume": resume, "same_batches": same, "sizes": sizes, "consume_s": consume, "throughput": throughput}


def _fmt_us(s: dict[str, float]) -> str:
    return f"{s['median']:,.0f} ({s['min']:,.0f}–{s['max']:,.0f})"


def _fmt_s(s: dict[str, float]) -> str:
    return f"{s['median']:.3f} ({s['min']:.3f}–{s['max']:.3f})"


def report(result: dict[str, Any]) -> str:
    head = (
        f"**Results** (`{result['command']}`). {environment_markdown(result['environment'])} "
        f"Code: statefulset at commit `{result['git']['head'][:7]}`"
        + (f" (uncommitted changes in the library: {result['git']['dirty']!r})." if result["git"]["dirty"] else ".")
        + f" Load average during the runs: {result['load_min']:.1f}–{result['load_max']:.1f}."
    )
    return head + "\n\n" + tables(result)


def tables(result: dict[str, Any]) -> str:
    """The tables of a run, also from a committed results file (which may lack the run's settings).

    Files written before the settings were kept (``benchmarks/results/bench_loader.json``) give the
    positions through their keys, the sequence length through tokens/s ÷ batches/s, and no length of
    the throughput processes unless the command line set one.
    """
    s = result["summary"]
    saved = [int(n) for n in s["resume"]["ours_native/w0"] if n.isdigit() and n != "0"]
    early, late = result.get("positions") or sorted(saved)
    first = s["throughput"]["ours_native/w0"]
    tokens_per_batch = first["tokens_per_s"]["median"] / first["batches_per_s"]
    seq_length = result.get("seq_length") or round(tokens_per_batch / BATCH)
    result = {**result, "seq_length": seq_length}
    if "seconds" in result:
        seconds = f"of {result['seconds']:.0f} s each"
    elif "--seconds" not in result.get("command", ""):
        seconds = f"of {DEFAULT_SECONDS:.0f} s each (the script's default; the results file does not record it)"
    else:
        seconds = "(their length is not in the results file)"
    lines = [
        f"Restore + first batch, seconds after imports, median (min–max) of "
        f"{s['resume']['ours_native/w0'][str(late)]['runs']} fresh processes. "
        f"`vs ours` is this loader's time ÷ ours at the same position and worker count (above 1× = ours is faster).",
        "",
        f"| Loader | Workers | fresh, s | N = {early:,}, s | N = {late:,}, s | late ÷ early | late vs ours | "
        f"first batch == uninterrupted | creating the N = {late:,} state |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant in RESUME_VARIANTS:
        for w in WORKERS:
            row = s["resume"][f"{variant}/w{w}"]
            e, lt, f = row[str(early)], row[str(late)], row["0"]
            vs = f"**{lt['vs_ours']:.1f}×**" if "vs_ours" in lt else "—"
            eq = f"{e['equal'] + lt['equal']}/{e['runs'] + lt['runs']}"
            consume = s["consume_s"][f"{variant}/w{w}/n{late}"]
            times = " | ".join(_fmt_s(x["total_s"]) for x in (f, e, lt))
            lines.append(
                f"| {LABELS[variant]} | {w} | {times} | **{row['late_over_early']:.2f}** | {vs} | {eq} "
                f"| {consume:.0f} s ({late / consume:,.0f} batches/s) |"
            )
    lines += [
        "",
        f"Where the time goes at N = {late:,} (medians, s): build = dataset + loader, restore = `torch.load` + "
        "restore call, first = `iter` + first `next`; main CPU = the main process's user + system time.",
        "",
        f"| Loader | Workers | build | restore | first | restore + first at N = {early:,} | main CPU "
        "| whole process (imports included) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant in RESUME_VARIANTS:
        for w in WORKERS:
            lt, e = s["resume"][f"{variant}/w{w}"][str(late)], s["resume"][f"{variant}/w{w}"][str(early)]
            lines.append(
                f"| {LABELS[variant]} | {w} | {lt['build_s']:.3f} | {lt['restore_s']:.3f} | {lt['first_s']:.3f} | "
                f"{e['restore_s'] + e['first_s']:.3f} | {lt['main_cpu_s']:.3f} | {lt['process_s']:.2f} |"
            )
    if result.get("per_run"):
        per_run = "; ".join(
            f"{LABELS[v]}, {w} workers: " + " / ".join(f"{run[f'{v}/w{w}']:.2f}" for run in result["per_run"])
            for v in ("ours_native", "ours_megatron")
            for w in WORKERS
        )
        lines += ["", f"late ÷ early of each pooled run on its own ({len(result['per_run'])} runs): {per_run}."]
    ours_ratios = [
        s["resume"][f"{v}/w{w}"]["late_over_early"] for v in ("ours_native", "ours_megatron") for w in WORKERS
    ]
    versus = {
        v: [s["resume"][f"{v}/w{w}"][str(late)]["vs_ours"] for w in WORKERS] for v in OURS_FOR if v in RESUME_VARIANTS
    }
    vs_text = "; ".join(f"{LABELS[v]}: {min(r):.1f}–{max(r):.1f}×" for v, r in versus.items())
    lines += [
        "",
        f"Targets: ours late ÷ early ≤ {TARGET_LATE_OVER_EARLY} (measured {min(ours_ratios):.2f}–"
        f"{max(ours_ratios):.2f}); ours ≥ {TARGET_VS_TORCHDATA:.0f}× faster than torchdata at N = {late:,} "
        f"(measured {vs_text}).",
    ]
    same = s["same_batches"]
    lines += [
        "",
        f"torchdata with shuffle=False gave the same batch as ours at every saved position: "
        f"{sum(same.values())}/{len(same)}.",
        "",
        "State size (bytes; the same at both positions unless shown as early / late):",
        "",
        "| Loader | Workers | `torch.save` | `pickle` | msgpack (`state.encode`) | `torch.save` vs ours |",
        "|---|---|---|---|---|---|",
    ]

    def size(variant: str, w: int, key: str) -> str:
        a = s["sizes"][f"{variant}/w{w}/n{early}"].get(key)
        b = s["sizes"][f"{variant}/w{w}/n{late}"].get(key)
        if a is None:
            return "—"
        return f"{a:,}" if a == b else f"{a:,} / {b:,}"

    for variant in ("ours_native", "ours_megatron", "td_native", "td_native_shuffle"):
        for w in WORKERS:
            ours = s["sizes"][f"{OURS_FOR.get(variant, variant)}/w{w}/n{late}"]["torch_save"]
            mine = s["sizes"][f"{variant}/w{w}/n{late}"]["torch_save"]
            lines.append(
                f"| {LABELS[variant]} | {w} | {size(variant, w, 'torch_save')} | {size(variant, w, 'pickle')} | "
                f"{size(variant, w, 'msgpack')} | {mine / ours:.1f}× |"
            )
    energon_ratio = 64_600 / s["sizes"][f"ours_native/w2/n{late}"]["torch_save"]
    lines += [
        f"| Megatron-Energon 7.4.1 `save_state_rank()` (cited: anchor-energon.md §0, §6) | 2 | "
        f"{ENERGON['torch_save']} | {ENERGON['pickle']} | — | ≈{energon_ratio:.0f}× |",
        "",
        f"Throughput (tokens/s = batches/s × {BATCH} × {result['seq_length']}), median (min–max) of "
        f"{s['throughput']['ours_native/w0']['runs']} fresh processes {seconds}, and the "
        "latency of one `save_state_rank()` (torchdata: `state_dict()`; Megatron-Energon, cited: "
        f"{ENERGON['save_latency']} with 2 workers), median of {LATENCY_CALLS:,} calls per process:",
        "",
        "| Loader | Workers | tokens/s | batches/s | ours ÷ this | main-process CPU (cores) | save, µs (p50 / p99) |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant in THROUGHPUT_VARIANTS:
        for w in WORKERS:
            t = s["throughput"][f"{variant}/w{w}"]
            tp = t["tokens_per_s"]
            ratio = f"**{t['ours_over_this']:.2f}×**" if "ours_over_this" in t else "—"
            lines.append(
                f"| {LABELS[variant]} | {w} | {tp['median'] / 1e6:.1f}M ({tp['min'] / 1e6:.1f}–{tp['max'] / 1e6:.1f}M) "
                f"| {t['batches_per_s']:,.0f} | {ratio} | {t['main_cpu_per_s']:.2f} | "
                f"{t['save_us_median']:.1f} / {t['save_us_p99']:.1f} |"
            )
    if "ipc" not in s["throughput"]:
        return "\n".join(lines) + "\n"
    ipc = s["throughput"]["ipc"]
    lines += [
        "",
        f"Handing one batch (a `[{BATCH}, {result['seq_length'] + 1}]` int64 tensor and `[{BATCH}]` sample ids) from a "
        "worker process to the main process, measured apart (median (min–max) over the same fresh processes): "
        f"send side (both tensors moved to shared memory and pickled) {_fmt_us(ipc['send_us'])} µs, receive side "
        f"(unpickled in the main process: one socket round trip per tensor to fetch its file descriptor, then "
        f"mmap) {_fmt_us(ipc['receive_us'])} µs. The receive side alone caps a 2-worker loader at about "
        f"{1e6 / ipc['receive_us']['median']:,.0f} batches/s on this machine.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_docs_argument(parser)
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per resume measurement")
    parser.add_argument("--repeats-throughput", type=int, default=3, help="fresh processes per throughput row")
    parser.add_argument("--seconds", type=float, default=DEFAULT_SECONDS, help="timed iteration per throughput process")
    parser.add_argument("--early", type=int, default=EARLY, help=f"early position in batches (default {EARLY})")
    parser.add_argument("--late", type=int, default=LATE, help=f"late position in batches (default {LATE:,})")
    parser.add_argument("--seq-length", type=int, default=SEQ_LENGTH)
    parser.add_argument("--num-samples", type=int, default=NUM_SAMPLES, help="megatron num_samples")
    parser.add_argument("--max-wait", type=float, default=120, help="seconds to wait for an idle machine per run")
    parser.add_argument(
        "--foreign-limit", type=float, default=0.5, help="redo a run when other processes used more cores than this"
    )
    parser.add_argument("--retries", type=int, default=2, help="redos per disturbed run (default 2)")
    parser.add_argument("--reuse-states", action="store_true", help="reuse saved states of an identical config")
    parser.add_argument("--states-only", action="store_true", help="only create the saved states, then stop")
    parser.add_argument("--out-dir", default=os.path.join(OUT_DIR, "loader"), help="shard, cache, states, results")
    parser.add_argument(
        "--pool", nargs="+", metavar="JSON", help="no runs: report the runs of these result files together"
    )
    add_plot_argument(parser)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    apply_quick(
        args, "bench_loader", docs=20_000, num_samples=50_000, early=10, late=300,
        repeats=1, repeats_throughput=1, seconds=1.0, max_wait=1.0, retries=0,
    )  # fmt: skip
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return
    if args.pool:
        pool(args.pool, os.path.abspath(args.out_dir))
        return

    out_dir = os.path.abspath(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    git_before = git_state()
    prefix, written = find_or_write_shard(out_dir, args.docs)
    warm_s = warm(prefix)
    base = {
        "prefix": prefix,
        "cache": os.path.join(out_dir, "cache"),
        "seq_length": args.seq_length,
        "num_samples": args.num_samples,
    }
    prepared = spawn({**base, "role": "prepare"})
    print(f"megatron stream: {prepared['samples']:,} samples, open {prepared['open_s']:.1f} s", file=sys.stderr)
    positions = (args.early, args.late)
    states = make_states(base, out_dir, positions, args.reuse_states)
    if args.states_only:
        return
    quiet = {"max_wait": args.max_wait, "limit": args.foreign_limit, "retries": args.retries}
    resumes = run_resumes(base, out_dir, positions, args.repeats, quiet)
    throughput = run_throughput(base, args.repeats_throughput, args.seconds, quiet)
    loads = [r["load_before"][0] for r in resumes + throughput]
    result: dict[str, Any] = {
        "command": "python benchmarks/bench_loader.py " + " ".join(sys.argv[1:]),
        "environment": environment(),
        "torchdata": _torchdata_version(),
        "git": git_before,
        "git_after": git_state(),
        "shard": {"prefix": prefix, "written": written, "warm_s": warm_s},
        "megatron_stream": prepared,
        "seq_length": args.seq_length,
        "positions": list(positions),
        "repeats": args.repeats,
        "repeats_throughput": args.repeats_throughput,
        "seconds": args.seconds,
        "load_min": min(loads),
        "load_max": max(loads),
        "states": states,
        "resume": resumes,
        "throughput": throughput,
    }
    result["summary"] = summarise(result)
    with open(os.path.join(out_dir, "bench_loader.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = report(result)
    with open(os.path.join(out_dir, "bench_loader.md"), "w") as f:
        f.write(text)
    print(text)
    publish_result("bench_loader", result, not args.no_plot, quick=args.quick)


def pool(paths: list[str], out_dir: str) -> None:
    """One report over several runs of the same configuration and code (more processes per median)."""
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    first = results[0]
    for path, r in zip(paths, results, strict=True):
        r = {**r, "megatron_stream": r["megatron_stream"]["samples"]}
        for key in ("seq_length", "positions", "seconds", "git", "megatron_stream"):
            if r[key] != (first["megatron_stream"]["samples"] if key == "megatron_stream" else first[key]):
                raise SystemExit(f"{path}: {key} differs from {paths[0]}; only runs of one configuration pool")
    merged = dict(results[-1])
    merged["command"] = "python benchmarks/bench_loader.py --pool " + " ".join(paths)
    merged["sources"] = [r["command"] for r in results]
    merged["resume"] = [x for r in results for x in r["resume"]]
    merged["throughput"] = [x for r in results for x in r["throughput"]]
    merged["load_min"] = min(r["load_min"] for r in results)
    merged["load_max"] = max(r["load_max"] for r in results)
    merged["per_run"] = [{key: row["late_over_early"] for key, row in summarise(r)["resume"].items()} for r in results]
    merged["summary"] = summarise(merged)
    with open(os.path.join(out_dir, "bench_loader.pooled.json"), "w") as f:
        json.dump(merged, f, indent=1)
    text = report(merged)
    with open(os.path.join(out_dir, "bench_loader.pooled.md"), "w") as f:
        f.write(text)
    print(text)


def _torchdata_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("torchdata")
    except metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    main()
