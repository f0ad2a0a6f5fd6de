"""``get_train_dataset`` / ``get_val_dataset``: a spec's stream cut into this rank's micro-batches.

Same names and keywords as Megatron-Energon. Keywords that exist for Energon's sequential
webdataset reading (``shuffle_buffer_size``, ``max_samples_per_sequence``, ``packing_buffer_size``,
``virtual_epoch_length``, ``shuffle_over_epochs_multiplier``) are accepted and ignored: samples
here are read by random access from a stream that is already globally shuffled, so there is no
buffer to fill and no sequential run to cut.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy

from statefulset.errors import StatefulsetError
from statefulset.loading.state import Cursor
from statefulset.loading.worker_config import WorkerConfig
from statefulset.spec.model import DatasetSpec
from statefulset.streams.base import SampleStream
from statefulset.streams.documents import FieldSpec, field_layout, gather_fields
from statefulset.streams.opening import open_stream
from statefulset.streams.provenance import Provenance, source_prefixes

_SPLIT_NAMES = {"train": "train", "val": "valid", "valid": "valid", "validation": "valid", "test": "test"}


class StreamDataset:
    """A split's stream with this rank's layout: what ``get_savable_loader`` turns into batches."""

    def __init__(
        self,
        stream: SampleStream,
        batch_size: int,
        worker_config: WorkerConfig,
        repeat: bool,
        limit: int | None = None,
        document_boundaries: bool = False,
        task_encoder: Any = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise StatefulsetError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(document_boundaries, bool):
            raise StatefulsetError(f"document_boundaries must be True or False, got {document_boundaries!r}")
        self.stream = stream
        self.document_boundaries = document_boundaries
        self.batch_size = batch_size
        self.worker_config = worker_config
        self.repeat = repeat
        self.limit = limit
        # The encoder as the workers run it (statefulset.transforms.encoder), or None.
        self.encoder = _runner(task_encoder, stream)

    @property
    def split(self) -> str:
        return self.stream.split

    def layout(self, base: int = 0, batches: int = 0) -> Cursor:
        wc = self.worker_config
        return Cursor(base, batches, wc.rank, wc.world_size, self.batch_size)

    def stop_batch(self, cursor: Cursor) -> int | None:
        """First batch index (from ``cursor.base``) that is not served, or None for an endless stream.

        Without repeat only whole global batches are served, so every rank gets the same count
        (a rank with one batch more would hang the others' collectives).
        """
        if self.repeat:
            return None
        global_batch = cursor.dp_size * cursor.batch_size
        end = len(self.stream)
        stop = max(0, (end - cursor.base) // global_batch)
        return stop if self.limit is None else min(stop, self.limit)

    def fields(self, wire: bool = False) -> list[FieldSpec]:
        """What each row of a batch holds: ``text``, then ``loss_mask`` (bestfit) and the document fields
        (``wire``: as their pieces, how a worker without a task encoder sends them)."""
        stream = self.stream
        return field_layout(
            stream.seq_length, stream.token_dtype, self.document_boundaries, stream.padded or stream.masked, wire
        )

    @property
    def task_encoder(self) -> Any:
        """The task encoder the dataset was built with, or None."""
        return None if self.encoder is None else self.encoder.encoder

    def __getitem__(self, position: int) -> Any:
        """``{"text": int64 [seq_length + 1], "sample_id": p, ...}``: the sample at global position ``p``.

        With a task encoder: what its ``encode_sample`` returns for the TokenSample at ``p`` (keyed as
        in the loader, so the same as the loader's row).

        A pure function of the spec and ``p``, the same in every process, worker and rank. A finite
        (megatron) stream that repeats reads position ``p`` as ``p % len(stream)``, as the loader does.
        Packing bestfit adds ``loss_mask``; ``document_boundaries=True`` adds ``cu_seqlens``,
        ``max_seqlen`` and ``position_ids`` (docs/packing.md).
        """
        if isinstance(position, bool) or not isinstance(position, int | numpy.integer):
            raise TypeError(f"dataset positions are ints, not {type(position).__name__}")
        p = int(position)
        read = numpy.array([self._read_position(p)], dtype=numpy.int64)
        rows = gather_fields(self.stream, read, self.document_boundaries)
        if self.encoder is not None:
            source = source_prefixes(self.stream, read)[0]
            return self.encoder.sample(rows, 0, p, source)
        sample: dict[str, Any] = {name: value[0] for name, value in rows.items()}
        sample["sample_id"] = p
        return sample

    def _read_position(self, p: int) -> int:
        return p % len(self.stream) if self.repeat and not self.stream.unbounded and p >= 0 else p

    def explain(self, position: int, tokenizer: Any = None) -> Provenance:
        """Where ``self[position]`` came from: split, source prefix, epoch and the pieces of sequences it was cut from.

        ``tokenizer`` (``"bytes"``, a tokenizer.json path, or an object with ``decode``) adds each
        piece's decoded text. O(1) per sample; see docs/provenance.md for every field.
        """
        if isinstance(position, bool) or not isinstance(position, int | numpy.integer):
            raise TypeError(f"dataset positions are ints, not {type(position).__name__}")
        p = int(position)
        read = self._read_position(p)
        found = self.stream.explain(read, tokenizer)
        encoder = None if self.encoder is None else self.encoder.describe()
        return replace(found, position=p, wrap=(p - read) // len(self.stream) if read != p else 0, task_encoder=encoder)

    def __len__(self) -> int:
        """Micro-batches per rank in one pass over the stream."""
        count = len(self.stream) // (self.worker_config.world_size * self.batch_size)
        return count if self.limit is None else min(count, self.limit)

    def __repr__(self) -> str:
        wc = self.worker_config
        return (
            f"StreamDataset({self.stream!r}, batch_size={self.batch_size}, dp_rank={wc.rank}/{wc.world_size}, "
            f"num_workers={wc.num_workers}, repeat={self.repeat}"
            + (f", task_encoder={self.encoder.identity}" if self.encoder is not None else "")
            + ")"
        )


def _runner(task_encoder: Any, stream: SampleStream) -> Any:
    """The encoder checked (refused hooks name themselves) and keyed by the spec's seed; None without one.

    Imported here, not at the top: the runner needs torch, which ``import statefulset`` must not import.
    """
    if task_encoder is None:
        return None
    from statefulset.transforms.encoder import TaskEncoderRunner

    return TaskEncoderRunner(task_encoder, stream.spec.seed, f"{stream.split} dataset")


def _split(name: str) -> str:
    try:
        return _SPLIT_NAMES[name]
    except KeyError:
        raise StatefulsetError(f"split_part must be one of {sorted(_SPLIT_NAMES)}, got {name!r}") from None


def get_train_dataset(
    path: str | os.PathLike[str] | Mapping[str, Any] | DatasetSpec,
    *,
    split_part: str = "train",
    worker_config: WorkerConfig | None = None,
    batch_size: int,
    batch_drop_last: bool = False,
    packing_buffer_size: int | None = None,
    shuffle_buffer_size: int | None = None,
    max_samples_per_sequence: int | None = None,
    virtual_epoch_length: int = 0,
    shuffle_over_epochs_multiplier: int | None = 1,
    task_encoder: Any = None,
    repeat: bool = True,
    document_boundaries: bool = False,
    **kwargs: Any,
) -> StreamDataset:
    """The training stream of a YAML spec (path, mapping or ``DatasetSpec``) for this rank; repeats by default.

    ``document_boundaries=True`` adds ``cu_seqlens``, ``max_seqlen`` and ``position_ids`` to every
    sample and batch (docs/packing.md).
    """
    _refuse_unknown(kwargs)
    _check_drop_last(batch_drop_last)
    wc = worker_config if worker_config is not None else WorkerConfig.default_worker_config()
    stream = open_stream(path, _split(split_part))
    return StreamDataset(
        stream, batch_size, wc, repeat=repeat, document_boundaries=document_boundaries, task_encoder=task_encoder
    )


def get_val_dataset(
    path: str | os.PathLike[str] | Mapping[str, Any] | DatasetSpec,
    *,
    split_part: str = "val",
    worker_config: WorkerConfig | None = None,
    batch_size: int,
    batch_drop_last: bool = False,
    packing_buffer_size: int | None = None,
    limit: int | None = None,
    task_encoder: Any = None,
    document_boundaries: bool = False,
    **kwargs: Any,
) -> StreamDataset:
    """The validation stream for this rank: one pass, never repeats; ``limit`` caps the batches."""
    _refuse_unknown(kwargs)
    _check_drop_last(batch_drop_last)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise StatefulsetError(f"limit must be a non-negative int or None, got {limit!r}")
    wc = worker_config if worker_config is not None else WorkerConfig.default_worker_config()
    stream = open_stream(path, _split(split_part))
    return StreamDataset(
        stream, batch_size, wc, repeat=False, limit=limit, document_boundaries=document_boundaries,
        task_encoder=task_encoder,
    )  # fmt: skip


# Energon keywords that configure features this design has no use for; accepted so calls port unchanged.
_IGNORED = {"split_config", "dataset_config", "parallel_shard_iters", "sample_type", "subflavors", "handler"}


def _refuse_unknown(kwargs: dict[str, Any]) -> None:
    unknown = sorted(set(kwargs) - _IGNORED)
    if unknown:
        raise StatefulsetError(f"unknown keyword argument(s): {', '.join(unknown)}")


def _check_drop_last(batch_drop_last: Any) -> None:
    if batch_drop_last not in (False, True):
        raise StatefulsetError(f"batch_drop_last must be a bool, got {batch_drop_last!r}")
