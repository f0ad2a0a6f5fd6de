"""statefulset: deterministic, savable data loading for LLM pre-training on Megatron bin/idx shards."""

from .datasets import StreamDataset, get_train_dataset, get_val_dataset
from .errors import StatefulsetError
from .indexed import IndexedDataset
from .loader import Loader, SavableLoader, get_loader, get_savable_loader
from .parallel import ParallelLayout, PlaceholderLoader, create_data_parallel_groups, create_parallel_groups
from .spec import DatasetSpec, load_spec
from .stream import SampleStream, open_stream
from .workers import WorkerConfig
from .writer import IndexedDatasetWriter, merge_datasets

__all__ = [
    "DatasetSpec",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "Loader",
    "ParallelLayout",
    "PlaceholderLoader",
    "SampleStream",
    "SavableLoader",
    "StatefulsetError",
    "StreamDataset",
    "WorkerConfig",
    "create_data_parallel_groups",
    "create_parallel_groups",
    "get_loader",
    "get_savable_loader",
    "get_train_dataset",
    "get_val_dataset",
    "load_spec",
    "merge_datasets",
    "open_stream",
]
__version__ = "0.1.0"
