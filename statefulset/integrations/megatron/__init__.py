"""Megatron-LM: batch formats (``batch``), the external iterators (``iterators``), the builder called on every
rank (``builder``), Megatron's dataloader state files and args (``state_files``), and the determinism
contract for user datasets (``determinism``)."""

from statefulset.integrations.megatron.batch import (
    MEGATRON_PAD_TOKEN,
    GPTBatch,
    GPTBatchConfig,
    GPTDocumentBatch,
    gpt_batch,
)
from statefulset.integrations.megatron.builder import MegatronData, build_megatron_iterators
from statefulset.integrations.megatron.iterators import MegatronIterator
from statefulset.integrations.megatron.metrics_logging import log_loader_metrics
from statefulset.integrations.megatron.state_files import (
    add_statefulset_args,
    layout_from_megatron_args,
    load_megatron_dataloader_state,
    load_megatron_dataloader_state_from_args,
    megatron_dataloader_state_path,
    save_megatron_dataloader_state,
)

__all__ = [
    "MEGATRON_PAD_TOKEN",
    "GPTBatch",
    "GPTBatchConfig",
    "GPTDocumentBatch",
    "MegatronData",
    "MegatronIterator",
    "add_statefulset_args",
    "build_megatron_iterators",
    "gpt_batch",
    "layout_from_megatron_args",
    "load_megatron_dataloader_state",
    "load_megatron_dataloader_state_from_args",
    "log_loader_metrics",
    "megatron_dataloader_state_path",
    "save_megatron_dataloader_state",
]
