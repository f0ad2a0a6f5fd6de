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
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from statefulset.errors import StatefulsetError
from statefulset.shards.writer import IndexedDatasetWriter
from statefulset.tools import locations
from statefulset.tools import preprocess as local
from statefulset.tools.locations import Folder, StagedOutput
from statefulset.tools.progress import Progress
from statefulset.tools.worker_pool import no_news_limit

logger = logging.getLogger("statefulset")
LOG_EVERY_S = 60.0

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


def _units(task: Task, chunk_bytes: int) -> Iterator[Any]:
    """The task's units; a gzip file streamed in pieces of about ``chunk_bytes``, so memory stays bounded."""
    for chunk in task.chunks:
        if chunk.gzip:
            yield from local._gzip_chunks(chunk.path, chunk_bytes)
        else:
            yield chunk


def run_task(task: Task, parts_path: str, init_args: tuple, chunk_bytes: int) -> dict[str, Any]:
    """Tokenise one task into its committed part; returns (and leaves) its summary."""
    if not local._WORKER:
        local._init_worker(*init_args)
    keys, dtype = init_args[1], init_args[3]
    parts = Folder(parts_path)
    staged = {k: StagedOutput(parts.join(f"part-{task.number:06d}_{k}_document")) for k in keys}
    writers = {k: IndexedDatasetWriter(staged[k].local, dtype) for k in keys}
    summary: dict[str, Any] = {"documents": 0, "tokens": dict.fromkeys(keys, 0), "units": [], "bytes": 0}
    try:
        for chunk in _units(task, chunk_bytes):
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
            summary["bytes"] += chunk.nbytes
    except BaseException:
        for key, writer in writers.items():
            writer.abort()
            staged[key].discard()
        raise
    for key, writer in writers.items():
        writer.close()
        staged[key].publish()
    parts.write_text(f"part-{task.number:06d}.done", json.dumps(summary))  # the part is committed
    return summary


def _manifest(paths: list[str], arguments: dict[str, Any]) -> dict[str, Any]:
    return {"version": MANIFEST_VERSION, "inputs": [locations.version(p) for p in paths], **arguments}


def _check_manifest(parts: Folder, wanted: dict[str, Any]) -> None:
    """Starts a new run's folder; refuses a folder of another run, naming what differs."""
    if not parts.exists("manifest.json"):
        parts.make()
        parts.write_text("manifest.json", json.dumps(wanted))
        return
    found = json.loads(parts.read_text("manifest.json"))
    differs = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
    if differs:
        raise StatefulsetError(
            f"{parts.path}: holds the parts of a run with other {', '.join(differs)}; never mixing the two, this "
            f"run stops. Remove {parts.path} to start clean, or rerun with the same inputs and arguments to resume it"
        )


@dataclass
class RayRun:
    tasks: int
    skipped: int


def run_with_ray(
    tasks: list[Task], parts: Folder, init_args: tuple, chunk_bytes: int, address: str | None, show_progress: bool
) -> RayRun:
    try:
        import ray
    except ImportError:
        raise StatefulsetError("--executor ray needs ray: pip install 'statefulset[ray]'") from None
    done = {int(n[5:11]) for n in parts.names() if n.startswith("part-") and n.endswith(".done")}
    todo = [t for t in tasks if t.number not in done]
    total = sum(c.nbytes for t in todo for c in t.chunks)
    progress = Progress("preprocess", total, enabled=show_progress)
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    pending: dict[Any, Task] = {}
    try:
        remote = ray.remote(max_retries=3, retry_exceptions=False)(run_task)  # a lost worker or node: retried
        pending = {remote.remote(task, parts.path, init_args, chunk_bytes): task for task in todo}
        limit, last_news = no_news_limit(), time.monotonic()
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(LOG_EVERY_S, limit))
            if not ready:
                waiting = ", ".join(t.describe() for t in list(pending.values())[:3])
                if time.monotonic() - last_news >= limit:
                    raise StatefulsetError(
                        f"--executor ray: no task finished in {limit:g} s (STATEFULSET_TASK_TIMEOUT); "
                        f"waiting for {len(pending)} tasks: {waiting}"
                    )
                logger.info("statefulset: %d Ray tasks running or queued, e.g. %s", len(pending), waiting)
                continue
            task = pending.pop(ready[0])
            try:
                summary = ray.get(ready[0])
            except ray.exceptions.RayError as exc:
                raise StatefulsetError(f"{task.describe()}: failed on the Ray cluster: {exc}") from None
            last_news = time.monotonic()
            progress.note = f"{len(tasks) - len(pending)}/{len(tasks)} tasks"
            progress.update(summary["documents"], sum(summary["tokens"].values()), summary["bytes"])
    finally:
        progress.close()
        for ref in pending:  # an error above: nothing of this run keeps running on the cluster
            ray.cancel(ref, force=True)
        if started_here:
            ray.shutdown()
    return RayRun(len(tasks), len(done))


def _merge_parts(parts: Folder, names: list[str], output: str, dtype: Any) -> None:
    """The parts, in order, into ``output`` (what ``merge_datasets`` does, one part at a time when they are remote)."""
    out = StagedOutput(output)
    try:
        with IndexedDatasetWriter(out.local, dtype) as writer:
            for name in names:
                with parts.local_shard(name) as prefix:
                    writer.add_index(prefix)
    except BaseException:
        out.discard()
        raise
    out.publish()


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
    parts = Folder(output_prefix + ".parts")
    arguments = {"keys": list(keys), "tokenizer": repr(spec), "append_eod": append_eod, "dtype": str(out_dtype),
                 "chunk_bytes": chunk_bytes, "task_bytes": task_bytes}  # fmt: skip
    _check_manifest(parts, _manifest(paths, arguments))
    tasks = plan(paths, keys, chunk_bytes, task_bytes)
    # Each Ray task holds one CPU: the Rust tokenizer must not add threads of its own (as with --workers).
    init_args = (spec, keys, append_eod, out_dtype, True)
    run = run_with_ray(tasks, parts, init_args, chunk_bytes, ray_address, show_progress)
    line_of: dict[str, int] = {}
    for task in tasks:
        summary = json.loads(parts.read_text(f"part-{task.number:06d}.done"))
        result.documents += summary["documents"]
        for key, count in summary["tokens"].items():
            result.tokens[key] = result.tokens.get(key, 0) + count
        for unit in summary["units"]:
            first = line_of.get(unit["path"], 0) + 1
            line_of[unit["path"]] = first - 1 + unit["lines"]
            result.blank_lines += unit["blank"]
            result.input_bytes += unit["bytes"]
            hint = f"; the committed parts in {parts.path} are kept for that rerun"
            local.count_bad_lines(result, unit["path"], unit["parquet"], first, unit["bad"], skip_bad_lines, hint)
    for key in keys:
        _merge_parts(parts, [f"part-{t.number:06d}_{key}_document" for t in tasks], result.outputs[key], out_dtype)
    parts.remove()
    result.seconds = time.perf_counter() - began
    result.skipped_tasks = run.skipped
    return result
