"""statefulset: deterministic, savable data loading for LLM pre-training on Megatron bin/idx shards.

Data flows one way, and the subpackages follow it:

    spec → shards → index → streams → loading → integrations
                                  parallel ↗        tools (CLI, preprocessing, demo) use them all

The names below are the public surface (CONTRACT §1 and what the docs use). The framework
integrations (Megatron-LM, Nanotron, Lightning) and the loaders (torch) are imported on first
use, so ``import statefulset`` never imports lightning or megatron, and opening a spec
(``open_stream``, ``statefulset prepare`` / ``inspect``) never imports torch: its import costs
more CPU than opening an unprepared 100B-token spec whose work another process already did
(benchmarks/bench_concurrent_open.py).
"""

from statefulset.errors import StatefulsetError
from statefulset.loading.datasets import StreamDataset, get_train_dataset, get_val_dataset
from statefulset.loading.placeholder import PlaceholderLoader
from statefulset.loading.worker_config import WorkerConfig
from statefulset.parallel.groups import create_data_parallel_groups, create_parallel_groups
from statefulset.parallel.layout import ParallelLayout
from statefulset.shards.merge import merge_datasets
from statefulset.shards.reader import IndexedDataset
from statefulset.shards.writer import IndexedDatasetWriter
from statefulset.spec.model import DatasetSpec, load_spec
from statefulset.streams.base import SampleStream
from statefulset.streams.opening import open_stream

# Public names of the integrations and the loaders, by the module that defines them (imported on
# first use).
_LAZY = {
    "Loader": "statefulset.loading.loader",
    "SavableLoader": "statefulset.loading.loader",
    "get_loader": "statefulset.loading.loader",
    "get_savable_loader": "statefulset.loading.loader",
    "GPTBatchConfig": "statefulset.integrations.megatron.batch",
    "gpt_batch": "statefulset.integrations.megatron.batch",
    "MegatronIterator": "statefulset.integrations.megatron.iterators",
    "MegatronData": "statefulset.integrations.megatron.builder",
    "build_megatron_iterators": "statefulset.integrations.megatron.builder",
    "NanotronDataLoader": "statefulset.integrations.nanotron.dataloader",
    "build_nanotron_dataloader": "statefulset.integrations.nanotron.dataloader",
    "StatefulsetDataModule": "statefulset.integrations.lightning.datamodule",
    "TokenSample": "statefulset.transforms.sample",
    "stateless": "statefulset.transforms.keyed",
}

__all__ = [
    "DatasetSpec",
    "GPTBatchConfig",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "Loader",
    "MegatronData",
    "MegatronIterator",
    "NanotronDataLoader",
    "ParallelLayout",
    "PlaceholderLoader",
    "SampleStream",
    "SavableLoader",
    "StatefulsetError",
    "StreamDataset",
    "TokenSample",
    "WorkerConfig",
    "build_megatron_iterators",
    "build_nanotron_dataloader",
    "create_data_parallel_groups",
    "create_parallel_groups",
    "get_loader",
    "get_savable_loader",
    "get_train_dataset",
    "get_val_dataset",
    "gpt_batch",
    "load_spec",
    "merge_datasets",
    "open_stream",
    "stateless",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'statefulset' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
