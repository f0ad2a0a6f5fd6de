"""JSON lines or Parquet → ``<prefix>_<key>_document.{bin,idx}``, as Megatron's preprocess_data.py names them.

The reader cuts the input into chunks of about ``chunk_bytes`` (a Parquet file into its row
groups); workers parse and tokenise a whole chunk in one batch and return compact arrays; the
main process writes them in input order with the vectorised writer. At most a few chunks are in
flight, so memory stays flat however large the input. A Parquet row's ``json_keys`` columns are
read as a JSON line's keys are, so the same texts give the same bytes either way.

Document semantics follow preprocess_data.py: a string value is one sequence, a list of
strings is one sequence per element; empty sequences are dropped; ``append_eod`` adds the
end-of-document token to each non-empty document (extending its last sequence). A list of
segments ``[{"text": ..., "loss": bool}, ...]`` is one sequence, and adds a loss-mask shard beside
the key's shard (:mod:`statefulset.tools.segments`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy

from statefulset.errors import StatefulsetError
from statefulset.shards import idx_format
from statefulset.shards.tokenizers import TokenizerSpec
from statefulset.shards.writer import IndexedDatasetWriter
from statefulset.tools import fault_gate, input_chunks, locations, segments
from statefulset.tools.chat import ChatSpec
from statefulset.tools.chunk_encoding import Encoded, encode, init_worker
from statefulset.tools.input_chunks import Chunk
from statefulset.tools.progress import Progress
from statefulset.tools.worker_pool import WorkerDied, ordered_map


@dataclass
class PreprocessResult:
    """What a run produced and how fast."""

    outputs: dict[str, str]
    documents: int = 0
    tokens: dict[str, int] = field(default_factory=dict)
    bad_lines: int = 0
    first_bad: list[str] = field(default_factory=list)
    blank_lines: int = 0
    input_bytes: int = 0
    seconds: float = 0.0
    eod: int | None = None  # the end-of-document token appended to each document, None when not asked
    eod_text: str | None = None  # its string in the vocabulary (None for the byte tokenizer's 256)
    skipped_tasks: int = 0  # --executor ray: committed parts of an earlier run that were kept
    peak_task_rss: int = 0  # --executor ray: the largest peak resident memory of a task's process, bytes
    loss_masks: dict[str, str] = field(default_factory=dict)  # key -> its mask shard's prefix, where one was written
    ray_nodes: int = 0  # --executor ray: the Ray nodes whose tasks committed parts in this run
    store_copied: int = 0  # --executor ray to S3: bytes of the merged .bin the store copied from the parts
    store_uploaded: int = 0  # ... and bytes that came through this machine (parts under 5 MiB, tails)

    def summary(self) -> str:
        total = sum(self.tokens.values())
        s = max(self.seconds, 1e-9)
        lines = [
            f"{self.documents:,} documents, {total:,} tokens in {self.seconds:.2f} s "
            f"({self.documents / s:,.0f} docs/s, {total / s:,.0f} tokens/s)"
        ]
        lines += [f"  {key}: {prefix}.{{bin,idx}}" for key, prefix in self.outputs.items()]
        lines += [f"  {key} loss mask: {prefix}.{{bin,idx}}" for key, prefix in self.loss_masks.items()]
        if self.eod is None:
            lines.append("  appended no end-of-document token (--append-eod adds one)")
        else:
            name = repr(self.eod_text) if self.eod_text is not None else "(the byte tokenizer's end of document)"
            lines.append(f"  appended EOD token {self.eod} {name} to each document")
        if self.bad_lines:
            lines.append(f"  skipped {self.bad_lines} bad lines, first: " + "; ".join(self.first_bad))
        if self.blank_lines:
            lines.append(f"  ignored {self.blank_lines} blank lines")
        if self.skipped_tasks:
            lines.append(f"  resumed: kept {self.skipped_tasks} tasks committed by an earlier run")
        if self.ray_nodes:
            lines.append(f"  tasks of this run ran on {self.ray_nodes} Ray node{'s' if self.ray_nodes > 1 else ''}")
        if self.store_copied or self.store_uploaded:
            lines.append(
                f"  merged .bin assembled on the object store: {self.store_copied / 2**20:,.1f} MiB copied by the "
                f"store, {self.store_uploaded / 2**20:,.1f} MiB through this machine"
            )
        if self.peak_task_rss:
            lines.append(f"  largest task memory: {self.peak_task_rss / 2**20:,.0f} MiB (peak RSS of a Ray worker)")
        return "\n".join(lines)


def _encode_unit(chunk: Chunk) -> Encoded:
    fault_gate.hold()  # tests only: a kill lands while the units are held
    return encode(chunk)


def _results(chunks: Iterator[Chunk], workers: int, init_args: tuple) -> Iterator[tuple[Chunk, Encoded]]:
    """(chunk, encoded chunk) in input order, with a bounded number in flight."""
    if workers <= 1:
        init_worker(*init_args)
        for chunk in chunks:
            yield chunk, _encode_unit(chunk)
        return
    # Our own pool (statefulset.tools.worker_pool): ProcessPoolExecutor was measured to hang when
    # its workers are killed, multiprocessing.Pool to lose the killed worker's chunk for good.
    try:
        yield from ordered_map(
            _encode_unit, chunks, workers=workers, initializer=init_worker, initargs=init_args,
            describe=_describe_chunk,
        )  # fmt: skip
    except WorkerDied as exc:
        raise StatefulsetError(
            f"{exc}; a tokeniser worker process died, so nothing was written; run again (with fewer --workers "
            "if memory ran out)"
        ) from None


def _describe_chunk(chunk: Chunk) -> str:
    if chunk.parquet:
        return f"{chunk.path} (row group {chunk.offset})"
    return f"{chunk.path} (bytes {chunk.offset}..{chunk.offset + chunk.nbytes})" if chunk.lines is None else chunk.path


def setup(
    inputs: Sequence[str],
    output_prefix: str,
    json_keys: Sequence[str],
    tokenizer: TokenizerSpec | None,
    append_eod: bool,
    dtype: object,
    chunk_bytes: int,
) -> tuple[TokenizerSpec, list[str], tuple[str, ...], numpy.dtype, PreprocessResult]:
    """The checked arguments of a run (any executor): tokenizer, input files, keys, token dtype, an empty result."""
    if not json_keys:
        raise StatefulsetError("--json-keys needs at least one key")
    if len(set(json_keys)) != len(json_keys):
        raise StatefulsetError(f"--json-keys lists a key twice: {list(json_keys)}")
    if chunk_bytes < 1:
        raise StatefulsetError(f"--chunk-bytes must be positive, got {chunk_bytes}")
    spec = tokenizer or TokenizerSpec()
    paths = input_chunks.expand_inputs(inputs)
    probe = spec.build()  # fail fast in this process on a bad tokenizer path
    if append_eod and probe.eod is None:
        raise StatefulsetError(f"{spec.name}: no end-of-document token found; pass --eod-token")
    out_dtype = idx_format.token_dtype(dtype) if dtype is not None else idx_format.optimal_dtype(probe.vocab_size)
    keys = tuple(json_keys)
    result = PreprocessResult(outputs={k: f"{output_prefix}_{k}_document" for k in keys})
    if append_eod:
        result.eod, result.eod_text = probe.eod, probe.token_text(probe.eod)
    return spec, paths, keys, out_dtype, result


def count_bad_lines(
    result: PreprocessResult,
    path: str,
    parquet: bool,
    first_line: int,
    bad: list[tuple[int, str]],
    skip_bad_lines: bool,
    hint: str = "",
) -> None:
    """Stop at a unit's first bad line (``file:line``, ``file:row N`` for Parquet), or count them when skipping."""
    if not bad:
        return
    unit = "row " if parquet else ""  # a line of a JSON lines file; a row of a Parquet file (1-based, whole file)
    if not skip_bad_lines:
        line, reason = bad[0]
        raise StatefulsetError(
            f"{path}:{unit}{first_line + line}: {reason} (use --skip-bad-lines to skip such lines{hint})"
        )
    result.bad_lines += len(bad)
    room = 3 - len(result.first_bad)
    result.first_bad += [f"{path}:{unit}{first_line + n}: {r}" for n, r in bad[:room]]


def preprocess(
    inputs: Sequence[str],
    output_prefix: str,
    *,
    json_keys: Sequence[str] = ("text",),
    tokenizer: TokenizerSpec | None = None,
    append_eod: bool = False,
    workers: int = 1,
    skip_bad_lines: bool = False,
    dtype: object = None,
    chunk_bytes: int = 1 << 20,
    show_progress: bool = True,
    chat: ChatSpec | None = None,
) -> PreprocessResult:
    """Tokenise JSON lines into one bin/idx pair per key; see the module docstring. ``chat``
    (:func:`statefulset.tools.chat.load`) renders conversations into segments."""
    if workers < 1:
        raise StatefulsetError(f"--workers must be at least 1, got {workers}")
    spec, paths, keys, out_dtype, result = setup(
        inputs, output_prefix, json_keys, tokenizer, append_eod, dtype, chunk_bytes
    )
    staged = {k: locations.StagedOutput(p) for k, p in result.outputs.items()}
    writers = {k: IndexedDatasetWriter(staged[k].local, out_dtype) for k in keys}
    masks = segments.MaskOutputs(result.outputs)
    progress = Progress("preprocess", sum(locations.size(p) for p in paths), enabled=show_progress)
    init_args = (spec, keys, append_eod, out_dtype, workers > 1, chat)
    line_of: dict[str, int] = {}  # lines seen so far in each input, for file:line messages
    try:
        for chunk, encoded in _results(input_chunks.chunks(paths, chunk_bytes, keys), workers, init_args):
            first_line = line_of.get(chunk.path, 0) + 1
            line_of[chunk.path] = first_line - 1 + encoded.lines
            count_bad_lines(result, chunk.path, chunk.parquet, first_line, encoded.bad, skip_bad_lines)
            result.blank_lines += encoded.blank
            tokens = 0
            for key, arrays in encoded.keys.items():
                masks.add(key, arrays, writers[key])  # first: a new mask shard copies the token shard's shape so far
                writers[key].add_documents(
                    arrays.tokens,
                    arrays.sequence_lengths,
                    sequences_per_document=arrays.sequences_per_document,
                )
                tokens += arrays.tokens.size
                result.tokens[key] = result.tokens.get(key, 0) + arrays.tokens.size
            result.documents += encoded.documents
            progress.update(encoded.documents, tokens, encoded.nbytes)
    except BaseException:
        progress.close(completed=False)
        locations.discard_all(writers, staged)
        masks.discard()
        raise
    progress.close()
    try:
        masks.publish()  # the masks before their token shards: a reader never finds new tokens beside old masks
    except BaseException:
        locations.discard_all(writers, staged)
        raise
    locations.publish_all(writers, staged)
    result.loss_masks = {k: masks.prefixes[k] for k in masks.writers}
    result.input_bytes = progress.bytes
    result.seconds = progress.seconds
    return result
