"""``statefulset preprocess --executor ray``: tokenisation as tasks that each commit a part, merged in input order.

The inputs are cut into the units the local run uses (byte ranges of plain JSON lines, a gzip
file whole, Parquet row groups), grouped in input order into tasks of about ``task_bytes``. Task
``i`` tokenises its units into the part shards ``<output>.parts/part-<i>_<key>_document`` and then
writes ``part-<i>.done`` (counts, lines, bad lines): a part exists only once it is complete
(the writer renames into place, the marker last). The parts are then merged in order into
exactly the bytes a one-process run writes, and the parts folder is removed.

A rerun with the same arguments (after a crash, a SIGKILL, a lost node) finds the manifest,
keeps every committed part and runs only the rest; a rerun whose inputs or arguments differ is
refused, naming what differs, so parts of two runs never mix.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from statefulset.errors import StatefulsetError
from statefulset.shards.merge import merge_datasets
from statefulset.shards.writer import IndexedDatasetWriter
from statefulset.tools import preprocess as local

MANIFEST_VERSION = 1


@dataclass(frozen=True)
class Task:
    number: int
    chunks: tuple[Any, ...]  # preprocess._Chunk, in input order

    def describe(self) -> str:
        first, last = self.chunks[0], self.chunks[-1]
        return f"task {self.number} ({first.path}" + ("" if first.path == last.path else f" .. {last.path}") + ")"


def plan(paths: list[str], keys: tuple[str, ...], chunk_bytes: int, task_bytes: int) -> list[Task]:
    """Units in input order, grouped into tasks of about ``task_bytes`` (a gzip file is one unit, read whole)."""
    tasks: list[Task] = []
    group: list[Any] = []
    size = 0
    for chunk in local._chunks(paths, chunk_bytes, keys, whole_gzip=True):
        group.append(chunk)
        size += chunk.nbytes
        if size >= task_bytes:
            tasks.append(Task(len(tasks), tuple(group)))
            group, size = [], 0
    if group:
        tasks.append(Task(len(tasks), tuple(group)))
    return tasks


def run_task(task: Task, parts: str, init_args: tuple) -> dict[str, Any]:
    """Tokenise one task into its committed part; returns (and leaves) its summary."""
    if not local._WORKER:
        local._init_worker(*init_args)
    keys, dtype = init_args[1], init_args[3]
    writers = {
        k: IndexedDatasetWriter(os.path.join(parts, f"part-{task.number:06d}_{k}_document"), dtype) for k in keys
    }
    summary: dict[str, Any] = {"documents": 0, "tokens": dict.fromkeys(keys, 0), "units": []}
    try:
        for chunk in task.chunks:
            encoded = local._encode(chunk)
            for key, arrays in encoded.keys.items():
                writers[key].add_documents(
                    arrays.tokens, arrays.sequence_lengths, sequences_per_document=arrays.sequences_per_document
                )
                summary["tokens"][key] += int(arrays.tokens.size)
            summary["documents"] += encoded.documents
            summary["units"].append(
                {
                    "path": chunk.path,
                    "parquet": chunk.parquet,
                    "lines": encoded.lines,
                    "blank": encoded.blank,
                    "bad": encoded.bad,
                    "bytes": chunk.nbytes,
                }
            )
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    for writer in writers.values():
        writer.close()
    marker = os.path.join(parts, f"part-{task.number:06d}.done")
    with open(marker + ".tmp", "w") as f:
        json.dump(summary, f)
    os.replace(marker + ".tmp", marker)  # the part is committed
    return summary


def _manifest(paths: list[str], arguments: dict[str, Any]) -> dict[str, Any]:
    inputs = []
    for path in paths:
        st = os.stat(path)
        inputs.append([os.path.abspath(path), st.st_size, st.st_mtime_ns])
    return {"version": MANIFEST_VERSION, "inputs": inputs, **arguments}


def _check_manifest(parts: str, wanted: dict[str, Any]) -> int:
    """Committed parts to keep: 0 for a new run; refuses a folder of another run, naming what differs."""
    path = os.path.join(parts, "manifest.json")
    if not os.path.exists(path):
        os.makedirs(parts, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(wanted, f)
        os.replace(path + ".tmp", path)
        return 0
    with open(path) as f:
        found = json.load(f)
    differs = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
    if differs:
        raise StatefulsetError(
            f"{parts}: holds the parts of a run with other {', '.join(differs)}; never mixing the two, this run "
            f"stops. Remove {parts} to start clean, or rerun with the same inputs and arguments to resume it"
        )
    return sum(1 for n in os.listdir(parts) if n.endswith(".done"))


@dataclass
class RayRun:
    tasks: int
    skipped: int
    retried: int = 0


def run_with_ray(tasks: list[Task], parts: str, init_args: tuple, address: str | None, show_progress: bool) -> RayRun:
    try:
        import ray
    except ImportError:
        raise StatefulsetError("--executor ray needs ray: pip install 'statefulset[ray]'") from None
    done = {int(n[5:11]) for n in os.listdir(parts) if n.endswith(".done")}
    todo = [t for t in tasks if t.number not in done]
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        remote = ray.remote(max_retries=3, retry_exceptions=False)(run_task)  # a lost worker or node: retried
        pending = {remote.remote(task, parts, init_args): task for task in todo}
        finished = 0
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=600)
            if not ready:
                waiting = ", ".join(t.describe() for t in list(pending.values())[:3])
                raise StatefulsetError(f"--executor ray: no task finished in 600 s (waiting for {waiting})")
            task = pending.pop(ready[0])
            try:
                ray.get(ready[0])
            except ray.exceptions.RayError as exc:
                raise StatefulsetError(f"{task.describe()}: failed on the Ray cluster: {exc}") from None
            finished += 1
            if show_progress:
                print(f"preprocess: {finished + len(done)}/{len(tasks)} tasks committed", flush=True)
    finally:
        if started_here:
            ray.shutdown()
    return RayRun(len(tasks), len(done))


def preprocess_ray(
    inputs: Sequence[str],
    output_prefix: str,
    *,
    json_keys: Sequence[str] = ("text",),
    tokenizer: Any = None,
    append_eod: bool = False,
    skip_bad_lines: bool = False,
    dtype: object = None,
    chunk_bytes: int = 1 << 20,
    task_bytes: int = 64 << 20,
    ray_address: str | None = None,
    show_progress: bool = True,
) -> local.PreprocessResult:
    """``statefulset preprocess --executor ray``: see the module docstring."""
    if task_bytes < 1:
        raise StatefulsetError(f"--task-bytes must be positive, got {task_bytes}")
    began = time.perf_counter()
    spec, paths, keys, out_dtype, result = local.setup(
        inputs, output_prefix, json_keys, tokenizer, append_eod, dtype, chunk_bytes
    )
    parts = output_prefix + ".parts"
    arguments = {"keys": list(keys), "tokenizer": repr(spec), "append_eod": append_eod, "dtype": str(out_dtype),
                 "chunk_bytes": chunk_bytes, "task_bytes": task_bytes}  # fmt: skip
    _check_manifest(parts, _manifest(paths, arguments))
    tasks = plan(paths, keys, chunk_bytes, task_bytes)
    # Each Ray task holds one CPU: the Rust tokenizer must not add threads of its own (as with --workers).
    run = run_with_ray(tasks, parts, (spec, keys, append_eod, out_dtype, True), ray_address, show_progress)
    line_of: dict[str, int] = {}
    for task in tasks:
        with open(os.path.join(parts, f"part-{task.number:06d}.done")) as f:
            summary = json.load(f)
        result.documents += summary["documents"]
        for key, count in summary["tokens"].items():
            result.tokens[key] = result.tokens.get(key, 0) + count
        for unit in summary["units"]:
            first = line_of.get(unit["path"], 0) + 1
            line_of[unit["path"]] = first - 1 + unit["lines"]
            result.blank_lines += unit["blank"]
            result.input_bytes += unit["bytes"]
            hint = f"; the committed parts in {parts} are kept for that rerun"
            local.count_bad_lines(result, unit["path"], unit["parquet"], first, unit["bad"], skip_bad_lines, hint)
    for key in keys:
        merge_datasets([os.path.join(parts, f"part-{t.number:06d}_{key}_document") for t in tasks],
                       result.outputs[key])  # fmt: skip
    shutil.rmtree(parts, ignore_errors=True)
    result.seconds = time.perf_counter() - began
    result.skipped_tasks = run.skipped
    return result
