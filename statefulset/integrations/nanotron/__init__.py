"""Nanotron: its CLM micro-batch format (``batch``), its ParallelContext as a layout (``context``), one
rank's micro-batch iterator and its state (``loader``) and the drop-in train dataloader's builder (``dataloader``)."""

from statefulset.integrations.nanotron.batch import NANOTRON_KEYS, TensorPointer, clm_micro_batch
from statefulset.integrations.nanotron.context import ParallelContextLike, layout_from_parallel_context
from statefulset.integrations.nanotron.dataloader import NanotronDataLoader, build_nanotron_dataloader

__all__ = [
    "NANOTRON_KEYS",
    "NanotronDataLoader",
    "ParallelContextLike",
    "TensorPointer",
    "build_nanotron_dataloader",
    "clm_micro_batch",
    "layout_from_parallel_context",
]
