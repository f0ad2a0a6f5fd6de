"""Sample streams against megatron-core's GPTDataset: index build, open, and batch assembly.

Four parts, each side by side with megatron-core 0.16.1 in the same run, on the 1,000,000-document
corpus of ``corpus.py`` (the shard ``bench_write.py`` leaves in ``benchmarks/out/`` is reused when
it matches ``--docs``; otherwise it is written there):

1. ``build``: ``open_stream`` with ``packing: megatron`` against megatron-core's
   ``BlendedMegatronDatasetBuilder(GPTDataset, ...)`` with ``blend=([prefix], None)``, split
   ``100,0,0``, seed 1234, ``seq_length`` 2048, ``NullTokenizer(50256)``,
   ``create_attention_mask=False``, for 1 epoch (``num_samples`` unset), 3.5 epochs (which builds
   4) and 100 epochs. Each measurement is a fresh child process: imports first (the import
   baseline is its ``VmRSS``), then the timed build, then its ``VmHWM`` (peak RSS). Cold builds
   have no cache (``path_to_cache=None`` on both sides); cached opens are the second open with
   ``path_to_cache`` set (a child built the entry first). Every run hashes its three index
   arrays (dtype, shape and bytes) after the timer so the parent can check ours equal megatron's.
2. ``native``: ``packing: native`` open + first gather of 8 positions in epoch 1, 4, 100 and 10^6,
   for the shard alone and for a blend of three prefixes (hard links to the same shard, weights
   0.5/0.3/0.2). One fresh child times it (and reads the peak RSS over the import baseline),
   another runs it under ``tracemalloc``. The shard digest memo (``~/.cache/statefulset``) is
   warm, as after the first open of a shard on a machine; one more child per corpus runs with an
   empty memo (``XDG_CACHE_HOME`` pointing to a new folder), the very first open.
3. ``firstuse``: one-off costs a first open pays in a fresh process, each timed on its own: importing
   and loading the compiled kernels, opening the shard with and without the whole-index check (and
   megatron-core's open), GPTSource's first-token table, and the ``numpy.ma`` import that
   ``native.py``'s first ``numpy.unique`` triggers.
4. ``batch``: B=8 random positions, ``seq_length`` 2048, warm page cache. Per fresh child: both
   files read once, each reader's mmap touched once per page, then timed passes in rotating order
   of ``stream.gather(positions)`` (megatron and native packing), a loop of megatron-core
   ``GPTDataset.__getitem__`` over the same 8 indices, and a loop of its
   ``_query_document_sample_shuffle_indices``. The child also measures the machine's copy bandwidth
   (a large numpy copy, and the uint16 → int64 widening copy that gather does).

Output: a markdown section on stdout and in ``benchmarks/out/bench_stream.md``; every run, with its
command, in ``benchmarks/out/bench_stream.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy
from bench_read import find_or_write_shard, warm
from benchenv import busy_cpu_s, environment, environment_markdown, git_state, load_average, spread, wait_for_quiet
from corpus import OUT_DIR, add_docs_argument
from plots import add_plot_argument, apply_quick, publish_result

SEQ_LENGTH = 2048
SEED = 1234
SPLIT = "100,0,0"
EOD = 50256
SIDES = ("megatron", "ours")
PARTS = ("build", "native", "firstuse", "batch")
EPOCHS = (1, 4, 100)
NATIVE_EPOCHS = (1, 4, 100, 1_000_000)
BLEND_WEIGHTS = (0.5, 0.3, 0.2)
BATCH = 8
BATCH_VARIANTS = ("ours_megatron", "ours_native", "megatron_getitem", "megatron_raw")
BATCH_LABELS = {
    "ours_megatron": "statefulset `stream.gather(positions)`, `packing: megatron`",
    "ours_native": "statefulset `stream.gather(positions)`, `packing: native`",
    "megatron_getitem": "megatron-core `GPTDataset.__getitem__` loop (8 calls)",
    "megatron_raw": "megatron-core `_query_document_sample_shuffle_indices` loop (8 calls)",
}
NATIVE_TARGET_S = 0.010
NATIVE_TARGET_BYTES = 50 * 2**20
BATCH_TARGET = 10.0
MIB = 2**20
# The machine is shared: a run starts once others use less than QUIET_CORES, and is redone (up to
# --retries times) when others used more than FOREIGN_LIMIT cores on average while it ran.
QUIET_CORES = 0.3
FOREIGN_LIMIT = 0.3
SETTINGS: dict[str, float] = {"retries": 2, "max_wait": 600.0}
CHILD_ENV: dict[str, str] = dict(os.environ)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- what each epoch setting asks for ---------------------------------------------------------------
def num_samples_for(epochs: int, tokens: int) -> int | None:
    """``num_samples`` of each setting: unset (1 epoch), 3.5 epochs' worth (builds 4), or exactly 100 epochs."""
    per_epoch = (tokens - 1) // SEQ_LENGTH
    if epochs == 1:
        return None
    if epochs == 4:
        return int(3.5 * per_epoch)
    return (epochs * tokens - 1) // SEQ_LENGTH


# -- child side -------------------------------------------------------------------------------------
def _rss() -> dict[str, int]:
    """VmRSS, VmHWM (peak) and the current anonymous / file-backed split of RSS, in KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0])
    return {"rss_kib": out["VmRSS"], "hwm_kib": out["VmHWM"], "anon_kib": out["RssAnon"], "file_kib": out["RssFile"]}


def _loaded_sources() -> tuple[str, list[str]]:
    """Digest of the package's sources (every .py and .c file), and the statefulset modules this process imported.

    The digest covers the whole package, not only what a run imported, so runs that import
    different modules (megatron packing loads the kernels, native packing does not) compare equal.
    """
    names = sorted(
        os.path.basename(getattr(sys.modules[n], "__file__", "") or "")
        for n in sys.modules
        if n == "statefulset" or n.startswith("statefulset.")
    )
    if not names:
        return "", []
    package = os.path.dirname(sys.modules["statefulset"].__file__)
    digest = hashlib.sha256()
    for name in sorted(os.listdir(package)):
        if name.endswith((".py", ".c")):
            with open(os.path.join(package, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()[:12], [n for n in names if n]


def _array_digest(array: numpy.ndarray) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{array.dtype.str}{tuple(array.shape)}".encode())
    digest.update(memoryview(numpy.ascontiguousarray(array)).cast("B"))
    return digest.hexdigest()


class _Phases:
    """Wall time spent inside named module functions (outermost call only, so recursion counts once)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._depth: dict[str, int] = {}

    def wrap(self, module: Any, attribute: str, name: str) -> None:
        original = getattr(module, attribute)
        self.seconds.setdefault(name, 0.0)
        self._depth.setdefault(name, 0)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth[name] += 1
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth[name] -= 1
                if self._depth[name] == 0:
                    self.seconds[name] += time.perf_counter() - t0

        setattr(module, attribute, timed)


def _megatron_config(prefix: str, cache: str | None) -> Any:
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return GPTDatasetConfig(
        random_seed=SEED, sequence_length=SEQ_LENGTH, blend=([prefix], None), split=SPLIT,
        tokenizer=NullTokenizer(EOD), reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        path_to_cache=cache, create_attention_mask=False,
    )  # fmt: skip


def _megatron_build(prefix: str, num_samples: int | None, cache: str | None) -> Any:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    config = _megatron_config(prefix, cache)
    return BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, None, None], lambda: True, config).build()[0]


def _ours_spec(data_path: Any, packing: str, num_samples: int | None = None, cache: str | None = None) -> dict:
    return {
        "data_path": data_path, "seq_length": SEQ_LENGTH, "split": SPLIT, "seed": SEED, "packing": packing,
        "num_samples": num_samples, "path_to_cache": cache,
    }  # fmt: skip


def _quiet_megatron() -> None:
    import logging
    import warnings

    logging.disable(logging.WARNING)  # "Unable to save ... path_to_cache is None" and friends
    warnings.filterwarnings("ignore")


def child_build(job: dict[str, Any]) -> dict[str, Any]:
    """One index build (or cached open) in this fresh process."""
    phases = _Phases()
    fresh = None
    if job["mode"] == "write_cache":
        shutil.rmtree(job["cache"], ignore_errors=True)  # a redone run must build again
    if job["cache"] == "fresh":
        fresh = job["cache"] = tempfile.mkdtemp(prefix="megatron_cold_", dir=job["cache_root"])
    if job["side"] == "megatron":
        _quiet_megatron()
        import torch  # noqa: F401  (what megatron-core imports anyway; part of its baseline)
        from megatron.core.datasets import gpt_dataset, helpers

        _megatron_config(job["prefix"], job["cache"])  # imports the tokenizer and config modules
        phases.wrap(gpt_dataset, "_build_document_index", "document_index")
        phases.wrap(helpers, "build_sample_idx", "sample_index")
        phases.wrap(gpt_dataset, "_build_shuffle_index", "shuffle_index")
        before = _rss()
        t0 = time.perf_counter()
        dataset = _megatron_build(job["prefix"], job["num_samples"], job["cache"])
        seconds = time.perf_counter() - t0
        arrays = (dataset.document_index, dataset.sample_index, dataset.shuffle_index)
        length = len(dataset)
    else:
        import numpy.random  # noqa: F401  (torch has it loaded in any training process)

        from statefulset.index.megatron import gpt as sampling
        from statefulset.streams import opening as stream_module

        phases.wrap(stream_module, "IndexedDataset", "open_shard")
        # The .idx digest (what the open still waits for of it: a first open hashes it in a thread while it
        # builds a one-epoch index ahead, statefulset.streams.megatron.build_ahead) and the .bin sample.
        phases.wrap(stream_module.Identifications, "results", "shard_digest")
        phases.wrap(sampling, "build_document_index", "document_index")
        phases.wrap(sampling, "build_sample_index", "sample_index")
        phases.wrap(sampling, "build_shuffle_index", "shuffle_index")
        spec = _ours_spec(job["prefix"], "megatron", job["num_samples"], job["cache"])
        before = _rss()
        t0 = time.perf_counter()
        stream = stream_module.open_stream(spec, "train")
        seconds = time.perf_counter() - t0
        source = stream.sources[0]
        arrays = (source.document_index, source.sample_index, source.shuffle_index)
        length = len(stream)
    after = _rss()
    names = ("document_index", "sample_index", "shuffle_index")
    digests = {n: _array_digest(a) for n, a in zip(names, arrays, strict=True)}
    if fresh:
        shutil.rmtree(fresh, ignore_errors=True)
        job["cache"] = "fresh"
    return {
        "seconds": seconds,
        "phases_s": phases.seconds,
        "baseline_rss_kib": before["rss_kib"],
        "import_hwm_kib": before["hwm_kib"],
        "peak_rss_kib": after["hwm_kib"],
        "rss_after_kib": after["rss_kib"],
        "length": length,
        "dtypes": {n: a.dtype.str for n, a in zip(names, arrays, strict=True)},
        "digests": digests,
    }


def child_native(job: dict[str, Any]) -> dict[str, Any]:
    """``packing: native``: open and first gather of one batch, in this fresh process."""
    import tracemalloc

    from statefulset.index.native import windows as native
    from statefulset.shards.reader import IndexedDataset
    from statefulset.streams import opening as stream_module

    phases = _Phases()
    phases.wrap(stream_module, "load_spec", "read_spec")
    phases.wrap(stream_module, "IndexedDataset", "open_shard")
    phases.wrap(stream_module.Identifications, "results", "shard_digest")  # the .idx digest and a .bin sample
    phases.wrap(numpy, "unique", "numpy_unique")  # native.py's first numpy.unique imports numpy.ma
    phases.wrap(native.KeyedPermutation, "__call__", "permutation")
    phases.wrap(IndexedDataset, "gather", "copy_tokens")
    spec = _ours_spec(job["data_path"], "native")
    traced = job["tracemalloc"]
    before = _rss()
    if traced:
        tracemalloc.start()
    t0 = time.perf_counter()
    stream = stream_module.open_stream(spec, "train")
    t1 = time.perf_counter()
    rng = numpy.random.default_rng(job["epoch"])
    positions = (job["epoch"] - 1) * len(stream) + rng.integers(0, len(stream), BATCH)
    t2 = time.perf_counter()
    batch = stream.gather(positions)
    t3 = time.perf_counter()
    peak = tracemalloc.get_traced_memory()[1] if traced else None
    if traced:
        tracemalloc.stop()
    after = _rss()
    return {
        "open_s": t1 - t0,
        "gather_s": t3 - t2,
        "seconds": (t1 - t0) + (t3 - t2),
        "phases_s": phases.seconds,
        "tracemalloc_peak_bytes": peak,
        "baseline_rss_kib": before["rss_kib"],
        "peak_rss_kib": after["hwm_kib"],
        "anon_delta_kib": after["anon_kib"] - before["anon_kib"],
        "file_delta_kib": after["file_kib"] - before["file_kib"],
        "windows": len(stream),
        "positions": positions.tolist(),
        "batch_digest": _array_digest(batch),
    }


def child_firstuse(job: dict[str, Any]) -> dict[str, Any]:
    """One-off costs a first open pays in a fresh process (imports done), each timed on its own."""
    _quiet_megatron()
    import torch  # noqa: F401

    import statefulset.streams.opening  # noqa: F401
    from statefulset.shards.reader import IndexedDataset

    prefix = job["prefix"]
    out: dict[str, Any] = {}
    before = _rss()
    t0 = time.perf_counter()
    from statefulset.index import compiled as kernels

    t1 = time.perf_counter()
    kernels.available()
    t2 = time.perf_counter()
    out["import_kernels_s"], out["load_kernel_library_s"] = t1 - t0, t2 - t1
    import tracemalloc

    memo = tempfile.mkdtemp(prefix="bench_stream_memo_")  # empty: the whole index is checked, as on a first open
    tracemalloc.start()
    t0 = time.perf_counter()
    dataset = IndexedDataset(prefix, facts_dir=memo)
    t1 = time.perf_counter()
    out["open_validated_s"] = t1 - t0
    out["open_validated_tracemalloc_peak_bytes"] = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    after = _rss()
    out["open_validated_rss_file_delta_kib"] = after["file_kib"] - before["file_kib"]
    shutil.rmtree(memo, ignore_errors=True)
    t0 = time.perf_counter()
    IndexedDataset(prefix, validate=False)
    out["open_unvalidated_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    first_tokens = dataset.sequence_pointers // dataset.dtype.itemsize  # what GPTSource.__init__ computes
    out["first_tokens_s"] = time.perf_counter() - t0
    del first_tokens
    t0 = time.perf_counter()
    import numpy.ma  # noqa: F401  (what native.py's first numpy.unique call imports)

    out["import_numpy_ma_s"] = time.perf_counter() - t0
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset

    t0 = time.perf_counter()
    MegatronDataset(prefix)
    out["megatron_open_s"] = time.perf_counter() - t0
    return out


def _bandwidth(repeats: int = 5) -> dict[str, Any]:
    """This machine's copy bandwidth, bytes read + written per second (arrays far larger than any cache)."""
    n = 64 * MIB  # elements
    src16 = numpy.random.default_rng(0).integers(0, 50000, n, dtype=numpy.uint16)
    dst64 = numpy.ones(n, dtype=numpy.int64)  # written once first: no page faults in the timed copies
    big = numpy.ones(n, dtype=numpy.int64)
    copy = numpy.zeros(n, dtype=numpy.int64)

    def best_and_median(fn: Callable[[], None], nbytes: int) -> dict[str, float]:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return {"median_bytes_per_s": nbytes / statistics.median(times), "best_bytes_per_s": nbytes / min(times)}

    out = {
        "copy_int64": best_and_median(lambda: numpy.copyto(copy, big), 2 * big.nbytes),
        "widen_uint16_int64": best_and_median(lambda: numpy.copyto(dst64, src16), src16.nbytes + dst64.nbytes),
    }
    # The same widening at the size of one batch (in cache), call overhead included.
    small_src, small_dst = src16[: BATCH * (SEQ_LENGTH + 1)], dst64[: BATCH * (SEQ_LENGTH + 1)]
    calls = 2000
    t0 = time.perf_counter()
    for _ in range(calls):
        numpy.copyto(small_dst, small_src)
    seconds = time.perf_counter() - t0
    out["widen_one_batch_in_cache"] = {
        "median_bytes_per_s": calls * (small_src.nbytes + small_dst.nbytes) / seconds,
        "us_per_call": seconds / calls * 1e6,
    }
    return out


def _touch_pages(buffer: Any) -> None:
    """Map every page of a reader's mmap (one read per 4 KiB), so the timed passes take no page faults."""
    view = numpy.frombuffer(buffer, dtype=numpy.uint8)
    int(view[::4096].sum())


def child_batch(job: dict[str, Any]) -> dict[str, Any]:
    """Batch assembly throughput, every variant in this process, passes in rotating order."""
    _quiet_megatron()
    import torch  # noqa: F401

    from statefulset.streams.opening import open_stream

    prefix = job["prefix"]
    warm(prefix)
    ours_m = open_stream(_ours_spec(prefix, "megatron"), "train")
    ours_n = open_stream(_ours_spec(prefix, "native"), "train")
    # A new empty path_to_cache: megatron-core builds its indices in memory, as ours are (with None it
    # would reuse or write "<prefix>/cache/GPTDataset_indices").
    with tempfile.TemporaryDirectory(prefix="megatron_batch_") as cache:
        megatron = _megatron_build(prefix, None, cache)
    for buffer in (
        ours_m.sources[0].dataset._bin_buffer,
        ours_n.sources[0].dataset._bin_buffer,
        megatron.dataset.bin_reader._bin_buffer,
    ):
        _touch_pages(buffer)

    rng = numpy.random.default_rng(job["seed"])
    batches, passes = job["batches"], job["passes"]
    length_m, length_n = len(ours_m), len(ours_n)
    # Check: the same 8 samples from both megatron-packed readers, token for token.
    check = rng.integers(0, length_m, BATCH)
    raw = numpy.stack([megatron._query_document_sample_shuffle_indices(int(i))[0] for i in check])
    same_raw = bool(numpy.array_equal(ours_m.gather(check), raw))
    same_getitem = bool(
        all(numpy.array_equal(megatron[int(i)]["tokens"].numpy(), row[:-1]) for i, row in zip(check, raw, strict=True))
    )

    def run(variant: str, pos: numpy.ndarray, pos_lists: list[list[int]]) -> float:
        t0 = time.perf_counter()
        if variant == "ours_megatron":
            for row in pos:
                ours_m.gather(row)
        elif variant == "ours_native":
            for row in pos:
                ours_n.gather(row)
        elif variant == "megatron_getitem":
            for ids in pos_lists:
                for i in ids:
                    megatron[i]
        else:
            query = megatron._query_document_sample_shuffle_indices
            for ids in pos_lists:
                for i in ids:
                    query(i)
        return time.perf_counter() - t0

    seconds: dict[str, list[float]] = {v: [] for v in BATCH_VARIANTS}
    for k in range(passes):
        pos = rng.integers(0, min(length_m, length_n), (batches, BATCH))
        pos_lists = pos.tolist()
        order = BATCH_VARIANTS[k % len(BATCH_VARIANTS) :] + BATCH_VARIANTS[: k % len(BATCH_VARIANTS)]
        for variant in order:
            # megatron's loops are ~10-40x slower: a tenth of the batches keeps the pass lengths comparable.
            n = batches if variant.startswith("ours") else max(1, batches // 10)
            seconds[variant].append(run(variant, pos[:n], pos_lists[:n]) / n)
    result: dict[str, Any] = {
        "seconds_per_batch": seconds,
        "same_tokens_as_megatron_raw": same_raw,
        "same_tokens_as_megatron_getitem": same_getitem,
        "bandwidth": _bandwidth(),
    }
    if job.get("profile"):
        result["profile_text"] = _profile_gather(ours_m, ours_n, rng, length_m)
    return result


def _profile_gather(ours_m: Any, ours_n: Any, rng: numpy.random.Generator, length: int) -> dict[str, str]:
    texts = {}
    for name, stream in (("ours_megatron", ours_m), ("ours_native", ours_n)):
        pos = rng.integers(0, length, (20_000, BATCH))
        profiler = cProfile.Profile()
        profiler.enable()
        for row in pos:
            stream.gather(row)
        profiler.disable()
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(14)
        texts[name] = buf.getvalue()
    return texts


def run_child(job: dict[str, Any]) -> None:
    kind = job["kind"]
    children = {"build": child_build, "native": child_native, "batch": child_batch, "firstuse": child_firstuse}
    result = children[kind](job)
    source, modules = _loaded_sources()
    print(json.dumps({**job, **result, "source": source if modules else None, "modules": modules}))


# -- parent side ------------------------------------------------------------------------------------
def _spawn(job: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one job in a fresh interpreter once the machine is quiet; redo it when others competed for the CPU.

    Adds ``foreign_cores``: CPU other processes used while it ran (cores), and how often it was redone.
    """
    for attempt in range(SETTINGS["retries"] + 1):
        waited = wait_for_quiet(SETTINGS["max_wait"], QUIET_CORES)
        result = _spawn_once(job, env)
        result.update(waited_s=waited, attempt=attempt, disturbed=result["foreign_cores"] > FOREIGN_LIMIT)
        if not result["disturbed"]:
            break
        _log(f"  (others used {result['foreign_cores']:.2f} cores during {job['kind']} run: redoing it)")
    return result


def child_env(out_dir: str) -> dict[str, str]:
    """The children's environment: bytecode caching on, in a folder under ``out_dir``.

    This machine sets PYTHONDONTWRITEBYTECODE=1, so every statefulset import would compile its
    source (an editable install has no .pyc) while megatron-core's installed modules load theirs;
    lazy imports inside a timed open (the kernels module) would pay for that.
    """
    env = {**os.environ, "PYTHONPYCACHEPREFIX": os.path.join(out_dir, "pycache")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _spawn_once(job: dict[str, Any], env: dict[str, str] | None) -> dict[str, Any]:
    before_busy, before_child = busy_cpu_s(), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(job)]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=env or CHILD_ENV).stdout
    wall = time.perf_counter() - t0
    after_child = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (after_child.ru_utime - before_child.ru_utime) + (after_child.ru_stime - before_child.ru_stime)
    result = json.loads(out.strip().splitlines()[-1])
    result.update(wall_s=wall, foreign_cores=max(busy_cpu_s() - before_busy - own, 0.0) / wall)
    return result


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_build(prefix: str, tokens: int, epochs_list: list[int], repeats: int, cache_root: str) -> list[dict]:
    runs = []
    for epochs in epochs_list:
        num_samples = num_samples_for(epochs, tokens)
        os.makedirs(cache_root, exist_ok=True)
        caches = {side: os.path.join(cache_root, f"{side}_{epochs}") for side in SIDES}
        for path in caches.values():
            shutil.rmtree(path, ignore_errors=True)
        # One build per side writes the cache entry the "cached" runs open.
        for side in SIDES:
            job = {"kind": "build", "side": side, "mode": "write_cache", "epochs": epochs, "prefix": prefix,
                   "num_samples": num_samples, "cache": caches[side], "cache_root": cache_root,
                   "round": -1}  # fmt: skip
            run = _spawn(job)
            runs.append(run)
            _log(f"build {epochs} ep {side} first open (writes the cache): {run['seconds']:.3f} s")
        for round_ in range(repeats):
            order = SIDES if round_ % 2 == 0 else SIDES[::-1]
            for mode in ("cold", "cached"):
                for side in order:
                    cache = caches[side] if mode == "cached" else None
                    if side == "megatron" and mode == "cold":
                        # megatron-core reads path_to_cache=None as "<prefix>/cache/GPTDataset_indices" and
                        # reuses what it finds there; the child points it at a new empty folder instead.
                        cache = "fresh"
                    job = {"kind": "build", "side": side, "mode": mode, "epochs": epochs, "prefix": prefix,
                           "num_samples": num_samples, "cache": cache, "cache_root": cache_root,
                           "round": round_}  # fmt: skip
                    if side == "ours" and mode == "cold":
                        # path_to_cache null keeps our indices in the node's default cache (<user cache>/indices),
                        # which earlier opens filled: a cold open gets an empty user cache of its own.
                        with tempfile.TemporaryDirectory(prefix="bench_stream_cold_", dir=cache_root) as empty:
                            run = _spawn(job, {**CHILD_ENV, "XDG_CACHE_HOME": empty})
                    else:
                        run = _spawn(job)
                    runs.append(run)
                    _log(
                        f"build {epochs} ep {mode} round {round_ + 1}/{repeats} {side}: {run['seconds']:.3f} s, "
                        f"peak {run['peak_rss_kib'] / 1024:,.0f} MiB (baseline {run['baseline_rss_kib'] / 1024:,.0f}),"
                        f" others {run['foreign_cores']:.2f} cores"
                    )
        for path in caches.values():
            shutil.rmtree(path, ignore_errors=True)
    return runs


def blend_prefixes(prefix: str, out_dir: str) -> list[str]:
    """Three prefixes for the blend: hard links to the shard (distinct paths, so three digests and opens)."""
    names = []
    for k in range(3):
        target = os.path.join(out_dir, f"bench_stream_blend{k}_text_document")
        for ext in (".bin", ".idx"):
            if os.path.exists(target + ext) and not os.path.samefile(target + ext, prefix + ext):
                os.remove(target + ext)
            if not os.path.exists(target + ext):
                os.link(prefix + ext, target + ext)
        names.append(target)
    return names


def run_native(prefix: str, out_dir: str, repeats: int) -> list[dict]:
    corpora = {
        "single": prefix,
        "blend3": dict(zip(blend_prefixes(prefix, out_dir), BLEND_WEIGHTS, strict=True)),
    }
    runs = []
    # A first open of every prefix fills the digest memo, as on any machine after the first use.
    for data_path in corpora.values():
        subprocess.run(
            [sys.executable, "-c", "import sys, json; from statefulset.streams.opening import open_stream; "
             "open_stream(json.loads(sys.argv[1]), 'train')", json.dumps(_ours_spec(data_path, "native"))],
            check=True, env=CHILD_ENV,
        )  # fmt: skip
    for round_ in range(repeats):
        for corpus_name, data_path in corpora.items():
            for epoch in NATIVE_EPOCHS:
                for traced in (False, True):
                    job = {"kind": "native", "corpus": corpus_name, "data_path": data_path, "epoch": epoch,
                           "tracemalloc": traced, "memo": "warm", "round": round_}  # fmt: skip
                    runs.append(_spawn(job))
            for traced in (False, True):
                with tempfile.TemporaryDirectory(prefix="bench_stream_memo_") as empty:
                    env = {**CHILD_ENV, "XDG_CACHE_HOME": empty}
                    job = {"kind": "native", "corpus": corpus_name, "data_path": data_path, "epoch": 1,
                           "tracemalloc": traced, "memo": "cold", "round": round_}  # fmt: skip
                    runs.append(_spawn(job, env))
        last = [r for r in runs if r["round"] == round_ and not r["tracemalloc"]]
        _log(f"native round {round_ + 1}/{repeats}: " + ", ".join(f"{r['seconds'] * 1e3:.1f}" for r in last) + " ms")
    return runs


def run_firstuse(prefix: str, repeats: int) -> list[dict]:
    runs = []
    for round_ in range(repeats):
        run = _spawn({"kind": "firstuse", "prefix": prefix, "round": round_})
        runs.append(run)
        _log(
            f"first-use round {round_ + 1}/{repeats}: kernels {1e3 * run['import_kernels_s']:.1f} + "
            f"{1e3 * run['load_kernel_library_s']:.1f} ms, validated open {1e3 * run['open_validated_s']:.1f} ms"
        )
    return runs


def run_batch(prefix: str, repeats: int, batches: int, passes: int, profile: bool) -> list[dict]:
    runs = []
    for round_ in range(repeats):
        job = {"kind": "batch", "prefix": prefix, "seed": 1000 + round_, "batches": batches, "passes": passes,
               "profile": profile and round_ == 0, "round": round_}  # fmt: skip
        run = _spawn(job)
        runs.append(run)
        _log(
            f"batch round {round_ + 1}/{repeats}: "
            + ", ".join(
                f"{v} {BATCH * SEQ_LENGTH / statistics.median(run['seconds_per_batch'][v]) / 1e6:,.1f}M tok/s"
                for v in BATCH_VARIANTS
            )
        )
    return runs


# -- summaries --------------------------------------------------------------------------------------
def _mib(kib: float) -> float:
    return kib / 1024


def _median_phases(runs: list[dict]) -> dict[str, float]:
    """Median seconds of each phase, and of "other" (the rest of each run's timed call), over runs."""
    out = {k: statistics.median(r["phases_s"][k] for r in runs) for k in runs[0]["phases_s"]}
    out["other"] = statistics.median(r["seconds"] - sum(r["phases_s"].values()) for r in runs)
    return out


def summarise_build(runs: list[dict]) -> list[dict[str, Any]]:
    rows = []
    for epochs in sorted({r["epochs"] for r in runs}):
        mine = [r for r in runs if r["epochs"] == epochs]
        row: dict[str, Any] = {"epochs": epochs, "num_samples": mine[0]["num_samples"]}
        for side in SIDES:
            for mode in ("cold", "cached", "write_cache"):
                picked = [r for r in mine if r["side"] == side and r["mode"] == mode]
                if not picked:
                    continue
                row[f"{side}_{mode}"] = {
                    "seconds": spread([r["seconds"] for r in picked]),
                    "peak_mib": spread([_mib(r["peak_rss_kib"]) for r in picked]),
                    "baseline_mib": spread([_mib(r["baseline_rss_kib"]) for r in picked]),
                    "delta_mib": spread([_mib(r["peak_rss_kib"] - r["baseline_rss_kib"]) for r in picked]),
                    "phases_s": _median_phases(picked),
                    "length": picked[0]["length"],
                    "dtypes": picked[0]["dtypes"],
                    "runs": len(picked),
                }
        cold = {s: [r for r in mine if r["side"] == s and r["mode"] == "cold"] for s in SIDES}
        paired = [
            m["seconds"] / o["seconds"]
            for m, o in zip(
                sorted(cold["megatron"], key=lambda r: r["round"]),
                sorted(cold["ours"], key=lambda r: r["round"]),
                strict=True,
            )
        ]
        row["speedup"] = row["megatron_cold"]["seconds"]["median"] / row["ours_cold"]["seconds"]["median"]
        row["paired_speedups"] = paired
        row["peak_ratio"] = row["megatron_cold"]["peak_mib"]["median"] / row["ours_cold"]["peak_mib"]["median"]
        row["delta_ratio"] = row["megatron_cold"]["delta_mib"]["median"] / row["ours_cold"]["delta_mib"]["median"]
        # Every ours run (cold, cached, first) against every megatron run: all digests must agree.
        reference = cold["megatron"][0]["digests"]
        row["identical"] = [r["digests"] == reference for r in mine]
        row["lengths_equal"] = len({r["length"] for r in mine}) == 1
        rows.append(row)
    return rows


def summarise_native(runs: list[dict]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(r["corpus"], r["memo"], r["epoch"]) for r in runs}, key=lambda k: (k[0] != "single", k[1], k[2]))
    for corpus_name, memo, epoch in keys:
        timed = [r for r in runs if (r["corpus"], r["memo"], r["epoch"]) == (corpus_name, memo, epoch)]
        plain = [r for r in timed if not r["tracemalloc"]]
        traced = [r for r in timed if r["tracemalloc"]]
        rows.append({
            "corpus": corpus_name,
            "memo": memo,
            "epoch": epoch,
            "positions": plain[0]["positions"],
            "open_s": spread([r["open_s"] for r in plain]),
            "gather_s": spread([r["gather_s"] for r in plain]),
            "seconds": spread([r["seconds"] for r in plain]),
            "traced_seconds": spread([r["seconds"] for r in traced]),
            "tracemalloc_peak_bytes": spread([r["tracemalloc_peak_bytes"] for r in traced]),
            "baseline_mib": spread([_mib(r["baseline_rss_kib"]) for r in plain]),
            "rss_delta_mib": spread([_mib(r["peak_rss_kib"] - r["baseline_rss_kib"]) for r in plain]),
            "anon_delta_mib": spread([_mib(r["anon_delta_kib"]) for r in plain]),
            "file_delta_mib": spread([_mib(r["file_delta_kib"]) for r in plain]),
            "phases_s": _median_phases(plain),
            "same_batch": len({r["batch_digest"] for r in timed}) == 1,
            "runs": len(plain),
        })  # fmt: skip
    return rows


def summarise_firstuse(runs: list[dict]) -> dict[str, Any]:
    keys = [k for k in runs[0] if k.endswith(("_s", "_bytes", "_kib")) and k not in ("wall_s", "waited_s")]
    return {k: spread([float(r[k]) for r in runs]) for k in keys}


def summarise_batch(runs: list[dict]) -> dict[str, Any]:
    per_variant: dict[str, Any] = {}
    tokens = BATCH * SEQ_LENGTH
    for v in BATCH_VARIANTS:
        # Median over passes within a run, then median (min-max) over runs.
        medians = [statistics.median(r["seconds_per_batch"][v]) for r in runs]
        per_variant[v] = {
            "seconds_per_batch": spread(medians),
            "tokens_per_s": tokens / statistics.median(medians),
            "all_passes_tokens_per_s": spread([tokens / s for r in runs for s in r["seconds_per_batch"][v]]),
        }
    for v in BATCH_VARIANTS:
        for ref in ("megatron_getitem", "megatron_raw"):
            per_variant[v][f"vs_{ref}"] = (
                per_variant[ref]["seconds_per_batch"]["median"] / per_variant[v]["seconds_per_batch"]["median"]
            )
            per_variant[v][f"vs_{ref}_per_run"] = [
                statistics.median(r["seconds_per_batch"][ref]) / statistics.median(r["seconds_per_batch"][v])
                for r in runs
            ]
    bandwidth = {
        name: spread([r["bandwidth"][name]["median_bytes_per_s"] for r in runs]) for name in runs[0]["bandwidth"]
    }
    # gather reads 2 B (uint16) and writes 8 B (int64) per token it returns (seq_length + 1 per sample).
    moved = BATCH * (SEQ_LENGTH + 1) * 10
    for v in ("ours_megatron", "ours_native"):
        rate = moved / per_variant[v]["seconds_per_batch"]["median"]
        per_variant[v]["bytes_per_s"] = rate
        per_variant[v]["share_of_copy"] = rate / bandwidth["copy_int64"]["median"]
        per_variant[v]["share_of_widen"] = rate / bandwidth["widen_uint16_int64"]["median"]
        per_variant[v]["share_of_widen_in_cache"] = rate / bandwidth["widen_one_batch_in_cache"]["median"]
    return {
        "variants": per_variant,
        "bandwidth": bandwidth,
        "widen_one_batch_us": spread([r["bandwidth"]["widen_one_batch_in_cache"]["us_per_call"] for r in runs]),
        "same_tokens": [r["same_tokens_as_megatron_raw"] and r["same_tokens_as_megatron_getitem"] for r in runs],
        "runs": len(runs),
    }


# -- markdown ---------------------------------------------------------------------------------------
def _range(s: dict[str, float], scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(s['median'] * scale)} ({fmt.format(s['min'] * scale)}–{fmt.format(s['max'] * scale)})"


def _code_line(result: dict[str, Any]) -> str:
    git = result["git_at_start"]
    dirty = [line[3:].rsplit("/", 1)[-1] for line in git.get("dirty", "").splitlines()]
    modules = sorted({m for part in PARTS for r in result.get(part, []) for m in r["modules"]})
    touched = [d for d in dirty if d in modules]
    code = f"statefulset at commit `{git.get('head', 'unknown')[:10]}`"
    if touched:
        code += f" plus uncommitted changes to {', '.join(touched)}"
    others = [d for d in dirty if d not in touched]
    if others:
        code += f" (also uncommitted: {', '.join(others)}, which these runs do not import)"
    sources = result["sources"]
    if len(sources) > 1:
        code += " (**warning: the package's sources changed during the run; figures mix versions**)"
    else:
        code += f"; every run imported the same module sources (digest `{sources[0]}`)"
    return code


def _markdown_build(result: dict[str, Any]) -> list[str]:
    rows = result["build_summary"]
    lines = [
        "#### Index build: `packing: megatron` against megatron-core's GPTDataset",
        "",
        "| Epochs (`num_samples`) | Samples | megatron-core cold, s | ours cold, s | speed-up | "
        "megatron-core peak RSS (import baseline) | ours peak RSS (import baseline) | "
        "megatron-core / ours, peak above baseline | cached open, megatron-core / ours | indices identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        m, o = row["megatron_cold"], row["ours_cold"]
        mc, oc = row["megatron_cached"], row["ours_cached"]
        ns = "unset" if row["num_samples"] is None else f"{row['num_samples']:,}"
        same = row["identical"]
        lines.append(
            f"| {row['epochs']} ({ns}) | {o['length']:,} | {_range(m['seconds'])} | {_range(o['seconds'])} "
            f"| **{row['speedup']:.2f}×** ({min(row['paired_speedups']):.2f}–{max(row['paired_speedups']):.2f}) "
            f"| {m['peak_mib']['median']:,.0f} MiB ({m['baseline_mib']['median']:,.0f}) "
            f"| {o['peak_mib']['median']:,.0f} MiB ({o['baseline_mib']['median']:,.0f}) "
            f"| {m['delta_mib']['median']:,.0f} / {o['delta_mib']['median']:,.0f} MiB = **{row['delta_ratio']:.2f}×** "
            f"| {mc['seconds']['median'] * 1e3:,.1f} / {oc['seconds']['median'] * 1e3:,.1f} ms "
            f"| {'yes' if all(same) and row['lengths_equal'] else '**NO**'} ({sum(same)}/{len(same)} runs) |"
        )
    lines += [
        "",
        'Where the time goes (median ms; "other" is the rest of the timed call; megatron-core\'s shard open '
        "is inside its other, with its `.npy` writes):",
        "",
        "| Epochs | Open | Side | open shard | shard digest | document index | sample index | shuffle index | other "
        "| total |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    phase_names = ("open_shard", "shard_digest", "document_index", "sample_index", "shuffle_index")
    for row in rows:
        for mode, side in [(mode, side) for mode in ("cold", "cached") for side in SIDES]:
            cell = row[f"{side}_{mode}"]
            ph = cell["phases_s"]
            cells = [f"{ph[k] * 1e3:,.1f}" if k in ph and (ph[k] or mode == "cold") else "–" for k in phase_names]
            lines.append(
                f"| {row['epochs']} | {mode} | {side} | " + " | ".join(cells)
                + f" | {ph['other'] * 1e3:,.1f} | {cell['seconds']['median'] * 1e3:,.1f} |"
            )  # fmt: skip
    lines += [
        "",
        "First open with `path_to_cache` set (builds the indices and writes the entry; ours fsyncs it, "
        "megatron-core does not), one run per side: "
        + "; ".join(
            f"{row['epochs']} ep: megatron-core {row['megatron_write_cache']['seconds']['median']:.3f} s, "
            f"ours {row['ours_write_cache']['seconds']['median']:.3f} s"
            for row in rows
        )
        + ".",
    ]
    return lines


def _markdown_native(result: dict[str, Any]) -> list[str]:
    lines = [
        "#### `packing: native`: open + first gather in a fresh process",
        "",
        "| Corpus | Digest memo | Epoch of the positions | open, ms | first gather (8 × 2049), ms | total, ms "
        "| tracemalloc peak | peak RSS above import baseline: total (anonymous / file-backed at the end) "
        "| < 10 ms | < 50 MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["native_summary"]:
        total = row["seconds"]["median"]
        peak = row["tracemalloc_peak_bytes"]["median"]
        rss = row["rss_delta_mib"]["median"]
        corpus_name = "1 shard" if row["corpus"] == "single" else "blend of 3"
        epoch = f"{row['epoch']:,}" if row["epoch"] < 10**6 else "10^6"
        memory = "traced: " + ("met" if peak < NATIVE_TARGET_BYTES else "**missed**")
        memory += ", RSS: " + ("met" if rss * MIB < NATIVE_TARGET_BYTES else "**missed**")
        lines.append(
            f"| {corpus_name} | {row['memo']} | {epoch} | {_range(row['open_s'], 1e3, '{:.1f}')} "
            f"| {_range(row['gather_s'], 1e3, '{:.2f}')} | **{total * 1e3:.1f}** "
            f"| {peak / 1e6:.1f} MB | {rss:.1f} MiB ({row['anon_delta_mib']['median']:.1f} / "
            f"{row['file_delta_mib']['median']:.1f}) "
            f"| {'met' if total < NATIVE_TARGET_S else '**missed**'} | {memory} |"
        )
    names = ("read_spec", "open_shard", "shard_digest", "numpy_unique", "permutation", "copy_tokens")
    lines += [
        "",
        "Where the native open + first gather goes (median ms of the timed runs; `numpy.unique` is called by "
        "`native.py`, and its first call imports `numpy.ma`):",
        "",
        "| Corpus | Digest memo | Epoch | " + " | ".join(f"`{n}`" for n in names) + " | other | total |",
        "|---|---|---|" + "---|" * (len(names) + 2),
    ]
    for row in result["native_summary"]:
        ph = row["phases_s"]
        total = row["seconds"]["median"]
        other = ph["other"]
        corpus_name = "1 shard" if row["corpus"] == "single" else "blend of 3"
        epoch = f"{row['epoch']:,}" if row["epoch"] < 10**6 else "10^6"
        lines.append(
            f"| {corpus_name} | {row['memo']} | {epoch} | "
            + " | ".join(f"{ph.get(n, 0.0) * 1e3:.1f}" for n in names)
            + f" | {other * 1e3:.1f} | {total * 1e3:.1f} |"
        )
    return lines


def _markdown_firstuse(result: dict[str, Any]) -> list[str]:
    f = result["firstuse_summary"]

    def ms(key: str) -> str:
        return _range(f[key], 1e3, "{:.1f}")

    return [
        "#### One-off costs of a first open (fresh process, imports done; median (min–max) ms)",
        "",
        "| What | ms | Where |",
        "|---|---|---|",
        f"| `import statefulset.index.compiled` | {ms('import_kernels_s')} | first index build in a process |",
        f"| loading the compiled kernel library (`kernels.available()`) | {ms('load_kernel_library_s')} | kernels.py |",
        f"| `IndexedDataset(prefix)`, whole index checked (default) | {ms('open_validated_s')} "
        f"| indexed.py → idx_format.check_all; tracemalloc peak "
        f"{f['open_validated_tracemalloc_peak_bytes']['median'] / 1e6:.1f} MB, "
        f"{f['open_validated_rss_file_delta_kib']['median'] / 1024:.1f} MiB of index pages mapped |",
        f"| `IndexedDataset(prefix, validate=False)` | {ms('open_unvalidated_s')} | indexed.py |",
        f"| megatron-core `IndexedDataset(prefix)` | {ms('megatron_open_s')} | (anchor) |",
        f"| `sequence_pointers // itemsize` (GPTSource's first tokens) | {ms('first_tokens_s')} | stream.py |",
        f"| `import numpy.ma` | {ms('import_numpy_ma_s')} | native.py's first `numpy.unique` |",
    ]


def _markdown_batch(result: dict[str, Any]) -> list[str]:
    s = result["batch_summary"]
    v = s["variants"]
    bw = s["bandwidth"]
    lines = [
        "#### Batch assembly: B = 8, seq_length 2048, random positions, warm page cache",
        "",
        "| Reader | tokens/s | µs per batch | vs `__getitem__` loop | vs raw query loop | "
        "bytes moved/s (share of copy / widening bandwidth) |",
        "|---|---|---|---|---|---|",
    ]
    for name in BATCH_VARIANTS:
        row = v[name]
        share = (
            f"{row['bytes_per_s'] / 1e9:.2f} GB/s ({row['share_of_copy']:.0%} / {row['share_of_widen']:.0%})"
            if "bytes_per_s" in row
            else "–"
        )
        per_run = row["vs_megatron_getitem_per_run"]
        lines.append(
            f"| {BATCH_LABELS[name]} | {row['tokens_per_s'] / 1e6:,.0f}M "
            f"| {_range(row['seconds_per_batch'], 1e6, '{:.0f}')} "
            f"| **{row['vs_megatron_getitem']:.1f}×** ({min(per_run):.1f}–{max(per_run):.1f}) "
            f"| {row['vs_megatron_raw']:.1f}× | {share} |"
        )
    lines += [
        "",
        f"Copy bandwidth of this machine (bytes read + written per second, median of runs): numpy copy of a "
        f"512 MiB int64 array {bw['copy_int64']['median'] / 1e9:.2f} GB/s; uint16 → int64 widening copy of 64 Mi "
        f"elements {bw['widen_uint16_int64']['median'] / 1e9:.2f} GB/s; the same widening at one batch's size "
        f"(8 × 2049 tokens, in cache) {bw['widen_one_batch_in_cache']['median'] / 1e9:.2f} GB/s "
        f"({s['widen_one_batch_us']['median']:.1f} µs per call). Same tokens as megatron-core in every run: "
        f"{'yes' if all(s['same_tokens']) else '**NO**'} ({sum(s['same_tokens'])}/{len(s['same_tokens'])}).",
    ]
    return lines


def part_markdown(result: dict[str, Any], part: str) -> str:
    """The tables of one part (build, native, firstuse, batch) without their heading (report.py's blocks)."""
    make = {"build": _markdown_build, "native": _markdown_native, "firstuse": _markdown_firstuse,
            "batch": _markdown_batch}[part]  # fmt: skip
    lines = make(result)
    while lines and (not lines[0] or lines[0].startswith("#")):
        lines = lines[1:]
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "### Sample streams: index build, open and batch assembly",
        "",
        environment_markdown(result["environment"]) + f" Code: {_code_line(result)}.",
        "",
        "Reproduce:",
        "",
        "```bash",
        result["command"],
        "```",
        "",
    ]
    if result.get("build_summary"):
        lines += [*_markdown_build(result), ""]
    if result.get("native_summary"):
        lines += [*_markdown_native(result), ""]
    if result.get("firstuse_summary"):
        lines += [*_markdown_firstuse(result), ""]
    if result.get("batch_summary"):
        lines += [*_markdown_batch(result), ""]
    every = [r for part in PARTS for r in result.get(part, [])]
    foreign = [r["foreign_cores"] for r in every]
    lines.append(
        f"Noise: each run started once other processes used under {QUIET_CORES} cores (median wait "
        f"{statistics.median(r['waited_s'] for r in every):.0f} s, longest {max(r['waited_s'] for r in every):.0f} s) "
        f"and was redone when they used more than {FOREIGN_LIMIT} cores while it ran: "
        f"{sum(r['attempt'] > 0 for r in every)} of {len(every)} runs were redone, "
        f"{sum(r['disturbed'] for r in every)} stayed disturbed after {result.get('retries', 2)} retries and are kept. "
        f"Other processes used {min(foreign):.2f}–{max(foreign):.2f} cores (median {statistics.median(foreign):.2f}) "
        f"during the kept runs; load average before / after: {result['load_average']['before']} / "
        f"{result['load_average']['after']}."
    )
    return "\n".join(lines)


def _summarise(result: dict[str, Any]) -> None:
    """(Re)compute every summary from the raw runs in ``result``."""
    summarisers = {
        "build": summarise_build, "native": summarise_native, "firstuse": summarise_firstuse, "batch": summarise_batch,
    }  # fmt: skip
    for part, summarise in summarisers.items():
        if result.get(part):
            result[f"{part}_summary"] = summarise(result[part])


def _write_report(result: dict[str, Any], out_dir: str) -> None:
    text = markdown(result)
    with open(os.path.join(out_dir, "bench_stream.md"), "w") as f:
        f.write(text + "\n")
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_docs_argument(parser)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts to run (default {','.join(PARTS)})")
    parser.add_argument("--epochs", default=",".join(map(str, EPOCHS)), help="build: epoch settings (1,4,100)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh-process runs per measurement (default 3)")
    parser.add_argument("--batches", type=int, default=2000, help="batch: batches per pass for ours (default 2000)")
    parser.add_argument("--passes", type=int, default=7, help="batch: passes per variant and run (default 7)")
    parser.add_argument("--profile", action="store_true", help="batch: also cProfile our gather (not timed)")
    parser.add_argument("--retries", type=int, default=2, help="redo a run disturbed by other processes (default 2)")
    parser.add_argument("--max-wait", type=float, default=600, help="seconds to wait for a quiet machine per run")
    parser.add_argument("--out-dir", default=OUT_DIR, help="where the shard, caches and results go")
    parser.add_argument("--render", action="store_true", help="only rebuild bench_stream.md from bench_stream.json")
    add_plot_argument(parser)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    apply_quick(
        args, "bench_stream", docs=20_000, epochs="1", repeats=1, batches=200, passes=1, retries=0, max_wait=1.0,
    )  # fmt: skip
    if args.child:
        run_child(json.loads(args.child))
        return
    out_dir = os.path.abspath(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    if args.render:
        with open(os.path.join(out_dir, "bench_stream.json")) as f:
            result = json.load(f)
        _summarise(result)
        _write_report(result, out_dir)
        publish_result("bench_stream", result, not args.no_plot, quick=args.quick)
        return
    SETTINGS.update(retries=args.retries, max_wait=args.max_wait)
    parts = [p for p in args.parts.split(",") if p]
    if not set(parts) <= set(PARTS):
        parser.error(f"--parts: choose from {', '.join(PARTS)}")

    git_before = git_state()
    CHILD_ENV.clear()
    CHILD_ENV.update(child_env(out_dir))
    package = os.path.join(REPO, "statefulset")
    subprocess.run([sys.executable, "-m", "compileall", "-q", package], check=True, env=CHILD_ENV)
    prefix, written = find_or_write_shard(out_dir, args.docs)
    from statefulset import IndexedDataset
    from statefulset.index import compiled as kernels

    kernels.available()  # compiles the kernels once here, never inside a timed child
    tokens = IndexedDataset(prefix, validate=False).num_tokens
    warm(prefix)
    _log(f"shard {prefix} ({'written now' if written else 'reused'}), {tokens:,} tokens")
    result: dict[str, Any] = {
        "script": "benchmarks/bench_stream.py",
        "command": " ".join(["python", "benchmarks/bench_stream.py", *sys.argv[1:]]),
        "environment": environment(),
        "git_at_start": git_before,
        "load_average": {"before": load_average()},
        "prefix": os.path.relpath(prefix, REPO),
        "docs": args.docs,
        "tokens": tokens,
        "repeats": args.repeats,
        "retries": args.retries,
    }
    if "build" in parts:
        epochs_list = [int(e) for e in args.epochs.split(",") if e]
        cache_root = os.path.join(out_dir, "bench_stream_cache")
        result["build"] = run_build(prefix, tokens, epochs_list, args.repeats, cache_root)
    if "native" in parts:
        warm(prefix)
        result["native"] = run_native(prefix, out_dir, args.repeats)
    if "firstuse" in parts:
        result["firstuse"] = run_firstuse(prefix, args.repeats)
    if "batch" in parts:
        warm(prefix)
        result["batch"] = run_batch(prefix, args.repeats, args.batches, args.passes, args.profile)
        for name, text in result["batch"][0].get("profile_text", {}).items():
            _log(f"--- cProfile of {name} gather, 20,000 batches ---\n{text}")
    _summarise(result)
    result["load_average"]["after"] = load_average()
    result["git_at_end"] = git_state()
    result["sources"] = sorted({r["source"] for part in PARTS for r in result.get(part, []) if r["source"]})
    if len(result["sources"]) > 1:
        _log(f"WARNING: statefulset's sources changed during the benchmark ({result['sources']}); rerun it")
    with open(os.path.join(out_dir, "bench_stream.json"), "w") as f:
        json.dump(result, f, indent=2)
    _write_report(result, out_dir)
    publish_result("bench_stream", result, not args.no_plot, quick=args.quick)
    bad = [row["epochs"] for row in result.get("build_summary", []) if not all(row["identical"])]
    if bad:
        raise SystemExit(f"index arrays differ from megatron-core's for epochs {bad}")


if __name__ == "__main__":
    main()
