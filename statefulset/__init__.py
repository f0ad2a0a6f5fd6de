"""statefulset: deterministic, savable data loading for LLM pre-training on Megatron bin/idx shards."""

from .errors import StatefulsetError
from .indexed import IndexedDataset
from .writer import IndexedDatasetWriter, merge_datasets

__all__ = ["IndexedDataset", "IndexedDatasetWriter", "StatefulsetError", "merge_datasets"]
__version__ = "0.1.0"
