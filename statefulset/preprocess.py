"""JSON lines → ``<prefix>_<key>_document.{bin,idx}``, as Megatron's preprocess_data.py names them.

The reader cuts the input into chunks of about ``chunk_bytes``; workers parse and tokenise a
whole chunk in one batch and return compact arrays; the main process writes them in input
order with the vectorised writer. At most a few chunks are in flight, so memory stays flat
however large the input.

Document semantics follow preprocess_data.py: a string value is one sequence, a list of
strings is one sequence per element; empty sequences are dropped; ``append_eod`` adds the
end-of-document token to each non-empty document (extending its last sequence).
"""

from __future__ import annotations

import glob
import gzip
import json
import multiprocessing
import os
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy

from . import idx_format
from .errors import StatefulsetError
from .progress import Progress
from .tokenization import TokenizerSpec
from .writer import IndexedDatasetWriter, natural_key


@dataclass(frozen=True)
class _Chunk:
    path: str
    first_line: int  # 1-based number of the chunk's first line
    lines: list[bytes]
    nbytes: int


@dataclass
class _KeyArrays:
    tokens: numpy.ndarray
    sequence_lengths: numpy.ndarray
    sequences_per_document: numpy.ndarray


@dataclass
class _Encoded:
    documents: int
    keys: dict[str, _KeyArrays]
    bad: list[tuple[str, int, str]]
    blank: int
    nbytes: int


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

    def summary(self) -> str:
        total = sum(self.tokens.values())
        s = max(self.seconds, 1e-9)
        lines = [
            f"{self.documents:,} documents, {total:,} tokens in {self.seconds:.2f} s "
            f"({self.documents / s:,.0f} docs/s, {total / s:,.0f} tokens/s)"
        ]
        lines += [f"  {key}: {prefix}.{{bin,idx}}" for key, prefix in self.outputs.items()]
        if self.bad_lines:
            lines.append(f"  skipped {self.bad_lines} bad lines, first: " + "; ".join(self.first_bad))
        if self.blank_lines:
            lines.append(f"  ignored {self.blank_lines} blank lines")
        return "\n".join(lines)


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Files and glob patterns, each pattern's matches in natural order."""
    paths: list[str] = []
    for item in inputs:
        if any(c in item for c in "*?["):
            matches = sorted(glob.glob(item), key=natural_key)
            if not matches:
                raise StatefulsetError(f"{item}: the pattern matches no file")
            paths += matches
        elif os.path.isfile(item):
            paths.append(item)
        else:
            raise StatefulsetError(f"{item}: no such input file")
    return paths


def _open(path: str):
    raw = open(path, "rb")  # noqa: SIM115 - closed by the caller through the wrapper
    magic = raw.read(2)
    raw.seek(0)
    if path.endswith(".gz") or magic == b"\x1f\x8b":
        return raw, gzip.GzipFile(fileobj=raw)
    return raw, raw


def _chunks(paths: list[str], chunk_bytes: int) -> Iterator[_Chunk]:
    for path in paths:
        raw, stream = _open(path)
        line = 1
        try:
            with raw, stream:
                position = 0
                while True:
                    try:
                        lines = stream.readlines(chunk_bytes)
                    except (OSError, EOFError, zlib.error) as exc:
                        raise StatefulsetError(f"{path}: cannot decompress after line {line - 1}: {exc}") from exc
                    if not lines:
                        break
                    now = raw.tell()
                    yield _Chunk(path, line, lines, now - position)
                    position = now
                    line += len(lines)
        except OSError as exc:
            raise StatefulsetError(f"{path}: cannot read: {exc}") from exc


# -- worker side ----------------------------------------------------------------------------
_WORKER: dict = {}


def _init_worker(spec: TokenizerSpec, keys: tuple[str, ...], append_eod: bool, quiet_threads: bool) -> None:
    if quiet_threads:
        # N worker processes already use the cores; the Rust tokenizer must not add threads.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tokenizer=spec.build(), keys=keys, append_eod=append_eod)


def _texts_of(obj: object, keys: tuple[str, ...]) -> dict[str, list[str]] | str:
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    out = {}
    for key in keys:
        if key not in obj:
            return f"missing key {key!r}"
        value = obj[key]
        if isinstance(value, str):
            out[key] = [value]
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            out[key] = value
        else:
            return f"key {key!r} must be a string or a list of strings, got {type(value).__name__}"
    return out


def _assemble(tokens, lengths, owner, documents, eod) -> _KeyArrays:
    """Drop empty sequences and append the end-of-document token, all vectorised."""
    keep = lengths > 0
    seq_lengths, seq_owner = lengths[keep], owner[keep]
    per_doc = numpy.bincount(seq_owner, minlength=documents).astype(numpy.int64)
    if eod is not None and seq_lengths.size:
        last = numpy.flatnonzero(numpy.r_[seq_owner[1:] != seq_owner[:-1], True])
        doc_ends = numpy.cumsum(seq_lengths)[last]
        tokens = numpy.insert(tokens, doc_ends, eod)
        seq_lengths = seq_lengths.copy()
        seq_lengths[last] += 1
    return _KeyArrays(tokens, seq_lengths, per_doc)


def _encode(chunk: _Chunk) -> _Encoded:
    tokenizer, keys = _WORKER["tokenizer"], _WORKER["keys"]
    texts: dict[str, list[str]] = {k: [] for k in keys}
    owners: dict[str, list[int]] = {k: [] for k in keys}
    bad: list[tuple[str, int, str]] = []
    blank = documents = 0
    for number, raw in enumerate(chunk.lines, start=chunk.first_line):
        if not raw.strip():
            blank += 1
            continue
        try:
            parsed = _texts_of(json.loads(raw), keys)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            parsed = f"invalid JSON: {exc}"
        if isinstance(parsed, str):
            bad.append((chunk.path, number, parsed))
            continue
        for key, values in parsed.items():
            texts[key] += values
            owners[key] += [documents] * len(values)
        documents += 1
    eod = tokenizer.eod if _WORKER["append_eod"] else None
    arrays = {}
    for key in keys:
        tokens, lengths = tokenizer.encode_batch(texts[key])
        owner = numpy.asarray(owners[key], dtype=numpy.int64)
        arrays[key] = _assemble(tokens, lengths, owner, documents, eod)
    return _Encoded(documents, arrays, bad, blank, chunk.nbytes)


def _results(chunks: Iterator[_Chunk], workers: int, init_args: tuple) -> Iterator[_Encoded]:
    """Encoded chunks in input order, with a bounded number in flight."""
    if workers <= 1:
        _init_worker(*init_args)
        yield from map(_encode, chunks)
        return
    # fork starts workers in milliseconds; elsewhere fall back to the platform's default.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    with multiprocessing.get_context(method).Pool(workers, _init_worker, init_args) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode, (chunk,)))
            if len(pending) >= 2 * workers + 2:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


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
) -> PreprocessResult:
    """Tokenise JSON lines into one bin/idx pair per key; see the module docstring."""
    if workers < 1:
        raise StatefulsetError(f"--workers must be at least 1, got {workers}")
    if not json_keys:
        raise StatefulsetError("--json-keys needs at least one key")
    if len(set(json_keys)) != len(json_keys):
        raise StatefulsetError(f"--json-keys lists a key twice: {list(json_keys)}")
    if chunk_bytes < 1:
        raise StatefulsetError(f"--chunk-bytes must be positive, got {chunk_bytes}")
    spec = tokenizer or TokenizerSpec()
    paths = expand_inputs(inputs)
    probe = spec.build()  # fail fast in this process on a bad tokenizer path
    if append_eod and probe.eod is None:
        raise StatefulsetError(f"{spec.name}: no end-of-document token found; pass --eod-token")
    out_dtype = idx_format.token_dtype(dtype) if dtype is not None else idx_format.optimal_dtype(probe.vocab_size)
    keys = tuple(json_keys)
    result = PreprocessResult(outputs={k: f"{output_prefix}_{k}_document" for k in keys})
    writers = {k: IndexedDatasetWriter(p, out_dtype) for k, p in result.outputs.items()}
    progress = Progress("preprocess", sum(os.path.getsize(p) for p in paths), enabled=show_progress)
    init_args = (spec, keys, append_eod, workers > 1)
    try:
        for encoded in _results(_chunks(paths, chunk_bytes), workers, init_args):
            if encoded.bad:
                if not skip_bad_lines:
                    path, line, reason = encoded.bad[0]
                    raise StatefulsetError(f"{path}:{line}: {reason} (use --skip-bad-lines to skip such lines)")
                result.bad_lines += len(encoded.bad)
                room = 3 - len(result.first_bad)
                result.first_bad += [f"{p}:{n}: {r}" for p, n, r in encoded.bad[:room]]
            result.blank_lines += encoded.blank
            tokens = 0
            for key, arrays in encoded.keys.items():
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
        for writer in writers.values():
            writer.abort()
        raise
    finally:
        progress.close()
    for writer in writers.values():
        writer.close()
    result.input_bytes = progress.bytes
    result.seconds = progress.seconds
    return result
