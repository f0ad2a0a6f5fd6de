""":class:`MegatronIterator`: the object Megatron-LM's ``--dataloader-type external`` passes through.

One micro-batch per ``next()`` on the ranks that hold one, with ``save_state()`` for
``maybe_save_dataloader_state``; TP peers receive TP rank 0's batch (or read it themselves), the
last pipeline stage receives the raw ``text`` over its :class:`~statefulset.parallel.transfer.StageLink`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch

from statefulset.errors import StatefulsetError
from statefulset.integrations.megatron.batch import Format, GPTBatchConfig, format_batch
from statefulset.loading.loader import SavableLoader
from statefulset.parallel.transfer import StageLink
from statefulset.streams.label_masks import link_fields

TensorParallelMode = Literal["broadcast", "read"]
SPLIT_TAGS = {"train": 0, "valid": 1, "test": 2}  # tags of each split's stage link


class MegatronIterator:
    """One micro-batch per ``next()``: the object ``--dataloader-type external`` passes through.

    Megatron wraps it as ``RerunDataIterator(it)`` and calls ``next(it)`` once per micro-batch on
    the ranks that hold one; ``maybe_save_dataloader_state`` calls ``it.save_state()``.

    Two kinds, made by :func:`build_megatron_iterators`:

    - a *reading* iterator (first stage) draws from a :class:`~statefulset.loading.loader.SavableLoader`
      and, when the pipeline has a later stage, sends the raw ``text`` rows to its last stage;
    - a *receiving* iterator (last stage, PP > 1) gets those rows and derives the same batch.
      It holds no position of its own, so its :meth:`save_state` returns None (Megatron only
      saves on the first stage).

    Validation and test iterators cycle: after the last whole global batch of the split they
    start again from its beginning, as Megatron's cyclic validation iterator does.
    """

    def __init__(
        self,
        split: str,
        fmt: Format,
        config: GPTBatchConfig,
        *,
        loader: Any = None,
        link: StageLink | None = None,
        receive: bool = False,
        cyclic: bool = False,
        fanout: list[StageLink] | None = None,
    ) -> None:
        self.split = split
        self.format = fmt
        self.batch_config = config
        self.loader = loader
        self.link = link
        # Links to the middle stages (document boundaries only, with inter_document_masking).
        self.fanout = list(fanout or [])
        self.receive = receive
        self.cyclic = cyclic
        self._source: Iterator[dict[str, torch.Tensor]] | None = None
        self.batches = 0
        """Micro-batches handed out by this iterator since it was built."""

    @property
    def reads(self) -> bool:
        """True on a rank that reads samples from disk (a first-stage loader)."""
        return self.loader is not None

    def __iter__(self) -> MegatronIterator:
        return self

    def _next_raw(self) -> dict[str, torch.Tensor]:
        if self.receive:
            if self.link is None:
                raise StatefulsetError(f"{self.split} iterator: a receiving iterator needs a StageLink")
            return self.link.recv()
        if self._source is None:
            self._source = iter(self.loader)
        try:
            return next(self._source)
        except StopIteration:
            if not self.cyclic:
                raise
        self._source = iter(self.loader)  # a fresh pass over the (never savable) eval split
        try:
            return next(self._source)
        except StopIteration:
            raise StatefulsetError(
                f"{self.split} iterator: the {self.split} split has no whole global batch; "
                "lower the micro-batch size or give the split more data"
            ) from None

    def __next__(self) -> dict[str, torch.Tensor]:
        raw = self._next_raw()
        if not self.receive:
            for link in ([self.link] if self.link is not None else []) + self.fanout:
                link.send(link_fields(raw, link.specs))
        self.batches += 1
        if "text" not in raw:  # a middle stage: the document boundaries are its whole batch
            return dict(raw)
        return format_batch(raw, self.format, self.batch_config)

    # -- state -----------------------------------------------------------------------------
    def save_state(self) -> dict[str, Any] | None:
        """This DP rank's loader state (Energon-style): what ``maybe_save_dataloader_state`` stores.

        None on a receiving iterator or an eval iterator: nothing to resume there. Waits for
        the text rows still in flight to the last stage first, so a checkpoint never races a send.
        """
        self.flush()
        if isinstance(self.loader, SavableLoader):
            return self.loader.save_state_rank()
        return None

    def save_state_rank(self) -> dict[str, Any] | None:
        """Energon's name for :meth:`save_state`."""
        return self.save_state()

    @property
    def consumed_samples(self) -> int | None:
        """Megatron's ``consumed_train_samples`` after the micro-batches this rank took (reading train only)."""
        if isinstance(self.loader, SavableLoader):
            return self.loader.consumed_samples
        return None

    def flush(self) -> None:
        """Wait for every text row still in flight to later stages (before exit or a checkpoint)."""
        if not self.receive:
            for link in ([self.link] if self.link is not None else []) + self.fanout:
                link.flush()

    def __repr__(self) -> str:
        kind = "receiving" if self.receive else "reading"
        return f"MegatronIterator({self.split}, {kind}, format={self.format!r}, batches={self.batches})"
