"""The worker side of ``preprocess``: a process set up once for a run's tokenizer and keys, then
parsing and tokenising whole chunks into compact arrays (any executor: the local pool or Ray tasks)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy

from statefulset.shards.tokenizers import TokenizerSpec
from statefulset.tools import segments
from statefulset.tools.chat import ChatRenderer, ChatSpec
from statefulset.tools.input_chunks import Chunk, lines_of, rows
from statefulset.tools.key_arrays import KeyArrays, KeyTexts


@dataclass
class Encoded:
    documents: int
    keys: dict[str, KeyArrays]
    bad: list[tuple[int, str]]  # (line within the chunk, 0-based; reason)
    lines: int
    blank: int
    nbytes: int


_WORKER: dict = {}


def init_worker(
    spec: TokenizerSpec,
    keys: tuple[str, ...],
    append_eod: bool,
    dtype: numpy.dtype,
    quiet_threads: bool,
    chat: ChatSpec | None = None,
) -> None:
    if quiet_threads:
        # N worker processes already use the cores; the Rust tokenizer must not add threads.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    renderer = None if chat is None else ChatRenderer(chat)
    _WORKER.update(tokenizer=spec.build(), keys=keys, append_eod=append_eod, dtype=dtype, chat=renderer)


def setup_key(
    spec: TokenizerSpec,
    keys: tuple[str, ...],
    append_eod: bool,
    dtype: numpy.dtype,
    quiet_threads: bool,
    chat: ChatSpec | None = None,
) -> str:
    """Everything a worker's setup depends on, the tokenizer file's and the chat template's bytes included."""
    template = None if chat is None else chat.fingerprint()
    return repr((spec.fingerprint(), keys, append_eod, numpy.dtype(dtype).str, quiet_threads, template))


def ensure_worker(init_args: tuple) -> None:
    """Sets this process up for ``init_args`` unless it already is: a Ray worker process serves the
    tasks of every run of its driver, and a second run's settings must never meet the first's tokenizer."""
    key = setup_key(*init_args)
    if _WORKER.get("key") != key:
        _WORKER.clear()
        init_worker(*init_args)
        _WORKER["key"] = key


def texts_of(obj: object, keys: tuple[str, ...], chat: ChatRenderer | None = None) -> dict[str, segments.Value] | str:
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    out = {}
    for key in keys:
        if key not in obj:
            return f"missing key {key!r}"
        value = segments.parse_value(obj[key], key, chat)
        if isinstance(value, str):
            return value
        out[key] = value
    return out


def encode(chunk: Chunk) -> Encoded:
    tokenizer, keys = _WORKER["tokenizer"], _WORKER["keys"]
    texts = {k: KeyTexts() for k in keys}
    bad: list[tuple[int, str]] = []
    blank = documents = 0
    lines: list = rows(chunk, keys) if chunk.parquet else lines_of(chunk)
    for number, raw in enumerate(lines):
        if chunk.parquet:
            parsed = texts_of(raw, keys, _WORKER.get("chat"))
        elif not raw.strip():
            blank += 1
            continue
        else:
            try:
                parsed = texts_of(json.loads(raw), keys, _WORKER.get("chat"))
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
                parsed = f"invalid JSON: {exc}"
        if isinstance(parsed, str):
            bad.append((number, parsed))
            continue
        for key, value in parsed.items():
            texts[key].add(value, documents)
        documents += 1
    eod = tokenizer.eod if _WORKER["append_eod"] else None
    arrays = {key: texts[key].encode(tokenizer, documents, eod, _WORKER["dtype"]) for key in keys}
    return Encoded(documents, arrays, bad, len(lines), blank, chunk.nbytes)
