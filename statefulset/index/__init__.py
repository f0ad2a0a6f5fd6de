"""Sample indices, from shards to the order of samples: ``megatron`` (GPTDataset/BlendedDataset
indices, exact) and ``native`` (keyed permutation, windows, blend tree, O(1)); the content-keyed
cache of built indices; ``kernels.c`` and its build/load helper (``compiled``), used by both.
"""
