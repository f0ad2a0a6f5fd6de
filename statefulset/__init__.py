"""statefulset: deterministic, savable data loading for LLM pre-training on Megatron bin/idx shards."""

from .datasets import StreamDataset, get_train_dataset, get_val_dataset
from .errors import StatefulsetError
from .indexed import IndexedDataset
from .loader import Loader, SavableLoader, get_loader, get_savable_loader
from .megatron_lm import GPTBatchConfig, MegatronData, MegatronIterator, build_megatron_iterators, gpt_batch
from .nanotron import NanotronDataLoader, build_nanotron_dataloader
from .parallel import ParallelLayout, PlaceholderLoader, create_data_parallel_groups, create_parallel_groups
from .spec import DatasetSpec, load_spec
from .stream import SampleStream, open_stream
from .workers import WorkerConfig
from .writer import IndexedDatasetWriter, merge_datasets

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
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The Lightning data module imports lightning (seconds, and an optional extra): only on use.
    if name == "StatefulsetDataModule":
        from .datamodule import StatefulsetDataModule

        return StatefulsetDataModule
    raise AttributeError(f"module 'statefulset' has no attribute {name!r}")
