"""``statefulset preprocess --executor ray``: tokenisation as tasks that each commit a part, merged in input order.

The inputs (local paths or fsspec URLs) are cut into the units the local run uses (byte ranges of
plain JSON lines, a gzip file, Parquet row groups), grouped in input order into tasks of about
``--task-bytes`` (by default 64 MiB, or less on a small input, so that every CPU of the cluster gets
several tasks). Task
``i`` tokenises its units into the part shards ``<output>.parts/part-<i>_<key>_document`` and then
writes ``part-<i>.done`` (counts, lines, bad lines): a part exists only once it is complete (the
marker is written last, a rename locally, one ``put`` on object storage). A gzip file is streamed
inside its task in ``chunk_bytes`` pieces, so a task's memory is bounded whatever the input size.

The driver appends committed parts to the outputs in input order while later tasks still run,
into exactly the bytes a one-process run writes, and removes the parts folder at the end.

A rerun with the same arguments (after a crash, a SIGKILL, a lost node) finds the manifest,
keeps every committed part and runs only the rest; a rerun whose inputs or arguments differ is
refused, naming what differs, so parts of two runs never mix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from statefulset.errors import StatefulsetError
from statefulset.shards.writer import IndexedDatasetWriter
from statefulset.tools import chunk_encoding, fault_gate, input_chunks, locations, segments
from statefulset.tools import preprocess as local
from statefulset.tools.locations import Folder, StagedOutput
from statefulset.tools.part_merge import DONE, OrderedMerge, committed_numbers, part_name
from statefulset.tools.progress import Progress
from statefulset.tools.ray_guardian import RayGuardian
from statefulset.tools.worker_pool import no_news_limit

logger = logging.getLogger("statefulset")
LOG_EVERY_S = 60.0
TASKS_PER_CPU = 8
MIN_TASK_BYTES = 4 << 20
DEFAULT_TASK_BYTES = 64 << 20
PLAN_THREADS = 32
IN_FLIGHT_PER_CPU = 2  # tasks submitted ahead per CPU of the cluster: every CPU busy, the queue short

MANIFEST_VERSION = 1


@dataclass(frozen=True)
class Task:
    number: int
    chunks: tuple[Any, ...]  # input_chunks.Chunk, in input order

    def describe(self) -> str:
        first, last = self.chunks[0], self.chunks[-1]
        return f"task {self.number} ({first.path}" + ("" if first.path == last.path else f" .. {last.path}") + ")"


def _file_units(path: str, keys: tuple[str, ...], task_bytes: int) -> list[Any]:
    """A file's units as the planner sees them: row groups (from the footer), a gzip file whole, or raw
    byte ranges of ``task_bytes`` whose tasks find the line ends: no per-MiB probing of remote files."""
    try:
        if input_chunks.is_parquet(path):
            return list(input_chunks.parquet_chunks(path, keys))
        size = locations.size(path)
        if input_chunks.is_gzip(path):
            return [input_chunks.Chunk(path, size, gzip=True)]
        return [
            input_chunks.Chunk(path, min(task_bytes, size - s), offset=s, span=True) for s in range(0, size, task_bytes)
        ]
    except OSError as exc:
        raise StatefulsetError(f"{path}: cannot read: {exc}") from exc


def plan(paths: list[str], keys: tuple[str, ...], task_bytes: int) -> list[Task]:
    """Units in input order, grouped into tasks of about ``task_bytes``. The files are looked at by
    ``PLAN_THREADS`` threads (on object storage each look is a request or two)."""
    with ThreadPoolExecutor(min(PLAN_THREADS, max(len(paths), 1))) as pool:
        per_file = list(pool.map(lambda p: _file_units(p, keys, task_bytes), paths))
    tasks: list[Task] = []
    group: list[Any] = []
    size = 0
    for chunk in (c for units in per_file for c in units):
        group.append(chunk)
        size += chunk.nbytes
        if size >= task_bytes:
            tasks.append(Task(len(tasks), tuple(group)))
            group, size = [], 0
    if group:
        tasks.append(Task(len(tasks), tuple(group)))
    return tasks


def span_chunks(path: str, start: int, nbytes: int, chunk_bytes: int) -> Iterator[Any]:
    """The lines that start in bytes ``[start, start + nbytes)`` of a plain file (a line belongs to the
    range it starts in), in runs of about ``chunk_bytes``, read in blocks: memory stays bounded."""
    end = start + nbytes
    with locations.open_read(path) as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # the line running into the range began before it: the previous range's
        # Each block is searched once and appended to a bytearray: a line spanning many blocks costs
        # linear time (``bytes +=`` and rescanning from the start were quadratic in its length).
        pos, data = f.tell(), bytearray()
        while pos < end:
            block = f.read(chunk_bytes)
            seen = len(data)  # data[:seen] holds no newline from the search start on
            data += block
            limit = end - pos  # where the range ends, relative to data
            if len(data) >= limit:  # the range's last line ends at the first newline from its last byte on
                stop = data.find(b"\n", max(limit - 1, seen))
                if stop >= 0 or not block:
                    yield _lines_unit(path, bytes(data if stop < 0 else data[: stop + 1]))
                    return
                continue
            if not block:  # the end of the file
                if data:
                    yield _lines_unit(path, bytes(data))
                return
            last = block.rfind(b"\n")  # data[:seen] ends after the previous cut: no newline in it
            if last >= 0:
                cut = seen + last + 1
                yield _lines_unit(path, bytes(data[:cut]))
                pos, data = pos + cut, data[cut:]


def _lines_unit(path: str, data: bytes) -> Any:
    lines = data.split(b"\n")
    if not lines[-1]:
        lines.pop()  # the newline ending the last line
    return input_chunks.Chunk(path, len(data), lines=lines)


def _units(task: Task, chunk_bytes: int) -> Iterator[Any]:
    """The task's units; a gzip file streamed in pieces of about ``chunk_bytes``, so memory stays bounded."""
    for chunk in task.chunks:
        if chunk.gzip:
            yield from input_chunks.gzip_chunks(chunk.path, chunk_bytes)
        elif chunk.span:
            yield from span_chunks(chunk.path, chunk.offset, chunk.nbytes, chunk_bytes)
        else:
            yield chunk


def run_task(task: Task, parts_path: str, init_args: tuple, chunk_bytes: int) -> dict[str, Any]:
    """Tokenise one task into its committed part; returns (and leaves) its summary."""
    chunk_encoding.ensure_worker(init_args)  # set up again when this run's settings differ from an earlier run's (C2)
    fault_gate.hold(task.number)  # tests only: a kill lands while later tasks are held
    keys, dtype = init_args[1], init_args[3]
    parts = Folder(parts_path)
    staged = {k: StagedOutput(parts.join(f"{part_name(task.number)}_{k}_document")) for k in keys}
    writers = {k: IndexedDatasetWriter(staged[k].local, dtype) for k in keys}
    masks = segments.MaskOutputs({k: parts.join(f"{part_name(task.number)}_{k}_document") for k in keys})
    summary: dict[str, Any] = {"documents": 0, "tokens": dict.fromkeys(keys, 0), "units": [], "bytes": 0}
    try:
        for chunk in _units(task, chunk_bytes):
            encoded = chunk_encoding.encode(chunk)
            for key, arrays in encoded.keys.items():
                masks.add(key, arrays, writers[key])  # first: a new mask part copies the token part's shape
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
        locations.discard_all(writers, staged)
        masks.discard()
        raise
    try:
        masks.publish()
    except BaseException:
        locations.discard_all(writers, staged)
        raise
    locations.publish_all(writers, staged)
    summary["loss_masks"] = sorted(masks.writers)  # the keys whose part has a mask shard
    summary["peak_rss"] = _peak_rss()
    summary["node"] = _node_id()
    parts.write_text(part_name(task.number) + DONE, json.dumps(summary))  # the part is committed
    return summary


def _node_id() -> str:
    """The Ray node this task runs on ("" outside Ray)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return ""
    return str(ray.get_runtime_context().get_node_id())


def _peak_rss() -> int:
    """This process's peak resident memory in bytes (0 where ``resource`` is missing)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _manifest(paths: list[str], arguments: dict[str, Any]) -> dict[str, Any]:
    return {"version": MANIFEST_VERSION, "inputs": [locations.version(p) for p in paths], **arguments}


def _check_manifest(parts: Folder, wanted: dict[str, Any], task_size: int) -> int:
    """The task size of this run: ``task_size`` for a new run's folder, the one recorded by the run being
    resumed (a cluster of another size must not change the plan); refuses a folder of another run."""
    if not parts.exists("manifest.json"):
        parts.make()
        parts.write_text("manifest.json", json.dumps({**wanted, "planned_task_bytes": task_size}))
        return task_size
    found = json.loads(parts.read_text("manifest.json"))
    planned = found.pop("planned_task_bytes", None)
    differs = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
    if differs or not isinstance(planned, int):
        raise StatefulsetError(
            f"{parts.path}: holds the parts of a run with other {', '.join(differs) or 'plan'}; never mixing the "
            f"two, this run stops. Remove {parts.path} to start clean, or rerun with the same inputs and arguments "
            "to resume it"
        )
    return planned


def task_size(task_bytes: int | None, total: int, cpus: int) -> int:
    """``--task-bytes`` when given; else ``DEFAULT_TASK_BYTES``, or less so that each CPU gets
    ``TASKS_PER_CPU`` tasks (a short tail when the last tasks run alone), but never below
    ``MIN_TASK_BYTES`` (per-task costs stay small)."""
    if task_bytes is not None:
        return task_bytes
    return min(DEFAULT_TASK_BYTES, max(MIN_TASK_BYTES, total // (TASKS_PER_CPU * max(cpus, 1))))


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[Any]:
    """Ray, started here (and stopped at the end) unless this process is already connected."""
    try:
        import ray
    except ImportError:
        raise StatefulsetError("--executor ray needs ray: pip install 'statefulset[ray]'") from None
    if ray.is_initialized():
        yield ray
        return
    # A local Ray started here ends with this process, however it ends (tools/ray_guardian.py).
    guardian = RayGuardian.start() if address is None else None
    try:
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise StatefulsetError(f"--ray-address {address}: cannot connect to the Ray cluster: {exc}") from None
        try:
            yield ray
        finally:
            ray.shutdown()
    finally:
        if guardian is not None:
            guardian.stop()


def run_tasks(
    ray: Any, tasks: list[Task], parts: Folder, init_args: tuple, chunk_bytes: int, merge: OrderedMerge,
    window: int, show_progress: bool,
) -> int:  # fmt: skip
    """Runs the tasks not yet committed, at most ``window`` in flight and submitted in input order (so the
    merge follows close behind, and the driver's bookkeeping stays small with 100,000 tasks); feeds the
    merge as parts commit; returns how many parts an earlier run had committed."""
    committed = committed_numbers(parts.names())
    kept = len(committed)
    merge.advance(committed)
    todo = iter([t for t in tasks if t.number not in committed])
    progress = Progress("preprocess", sum(c.nbytes for t in tasks if t.number not in committed for c in t.chunks),
                        enabled=show_progress)  # fmt: skip
    remote = ray.remote(max_retries=3, retry_exceptions=False)(run_task)  # a lost worker or node: retried
    shared = ray.put(init_args)  # the tokenizer's text, stored once rather than sent with every task
    pending: dict[Any, Task] = {}
    nodes: set[str] = set()
    completed = False
    try:
        limit = no_news_limit()
        last_news = last_log = time.monotonic()
        while True:
            while len(pending) < window and (task := next(todo, None)) is not None:
                pending[remote.remote(task, parts.path, shared, chunk_bytes)] = task
            if not pending:
                break
            # Every task finished within a second, in one call: O(window) per second, not per task.
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=1.0)
            now = time.monotonic()
            if not ready:
                waiting = ", ".join(t.describe() for t in list(pending.values())[:3])
                if now - last_news >= limit:
                    raise StatefulsetError(
                        f"--executor ray: no task finished in {limit:g} s (STATEFULSET_TASK_TIMEOUT); "
                        f"waiting for {len(pending)} tasks: {waiting}"
                    )
                if now - last_log >= LOG_EVERY_S:
                    logger.info("statefulset: %d Ray tasks running or queued, e.g. %s", len(pending), waiting)
                    last_log = now
                continue
            last_news = now
            for ref in ready:
                task = pending.pop(ref)
                try:
                    summary = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    raise StatefulsetError(f"{task.describe()}: failed on the Ray cluster: {exc}") from None
                committed.add(task.number)
                nodes.add(summary.get("node", ""))
                progress.note = f"{len(committed)}/{len(tasks)} tasks"
                progress.update(summary["documents"], sum(summary["tokens"].values()), summary["bytes"])
            merge.advance(committed)
        completed = True
    finally:
        progress.close(completed)
        for ref in pending:  # stopped early: nothing of this run keeps running on the cluster
            ray.cancel(ref, force=True)
    merge.result.ray_nodes = len(nodes)
    return kept


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
    task_bytes: int | None = None,
    ray_address: str | None = None,
    show_progress: bool = True,
    chat: Any = None,
) -> local.PreprocessResult:
    """``statefulset preprocess --executor ray``: see the module docstring."""
    if task_bytes is not None and task_bytes < 1:
        raise StatefulsetError(f"--task-bytes must be positive, got {task_bytes}")
    began = time.perf_counter()
    spec, paths, keys, out_dtype, result = local.setup(
        inputs, output_prefix, json_keys, tokenizer, append_eod, dtype, chunk_bytes
    )
    parts = Folder(output_prefix + ".parts")
    arguments = {"keys": list(keys), "tokenizer": spec.fingerprint(), "append_eod": append_eod, "dtype": str(out_dtype),
                 "chunk_bytes": chunk_bytes, "task_bytes": task_bytes,
                 "chat_template": None if chat is None else chat.fingerprint()}  # fmt: skip
    wanted = _manifest(paths, arguments)
    # Each Ray task holds one CPU: the Rust tokenizer must not add threads of its own (as with --workers).
    init_args = (spec.shipped(), keys, append_eod, out_dtype, True, chat)  # nodes need not have the tokenizer file
    with ray_session(ray_address) as ray:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        size = task_size(task_bytes, sum(locations.size(p) for p in paths), cpus)
        tasks = plan(paths, keys, _check_manifest(parts, wanted, size))
        merge = OrderedMerge(parts, tasks, result, out_dtype, skip_bad_lines)
        try:
            window = max(IN_FLIGHT_PER_CPU * cpus, 4)
            result.skipped_tasks = run_tasks(ray, tasks, parts, init_args, chunk_bytes, merge, window, show_progress)
        except BaseException:
            merge.abort()
            raise
    merge.publish()  # on failure it drops every key's staging itself; the committed parts stay for a rerun
    parts.remove()
    result.seconds = time.perf_counter() - began
    return result
