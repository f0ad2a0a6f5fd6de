"""torchtitan 0.3 config-registry functions that train on a statefulset spec.

torchtitan 0.3 picks its whole configuration with ``--module M --config F``: it imports
``M.config_registry`` (or ``M``) and calls ``F()`` for a ``Trainer.Config``; every field can then
be overridden on the command line (``--dataloader.dataset spec.yaml``, ``--training.seq_len``).
So::

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module statefulset.integrations.torchtitan --config statefulset_llama3_debugmodel \\
        --dataloader.dataset /data/spec.yaml --training.seq_len 2048

runs torchtitan's llama3 debug model on the spec. For another model or your own registry,
:func:`with_statefulset` swaps the loader of any ``Trainer.Config``::

    from torchtitan.models.llama3.config_registry import llama3_8b
    from statefulset.integrations.torchtitan.config_registry import with_statefulset

    def llama3_8b_bin_idx():
        return with_statefulset(llama3_8b(), dataset="/data/spec.yaml")

torchtitan is imported inside the functions, so importing this module costs nothing.
"""

from __future__ import annotations

from typing import Any

__all__ = ["statefulset_llama3_debugmodel", "with_statefulset"]


def with_statefulset(config: Any, **fields: Any) -> Any:
    """``config`` (a torchtitan ``Trainer.Config``) with ``StatefulsetDataLoader.Config(**fields)`` as its dataloader.

    The validator keeps its own dataloader config (torchtitan builds it separately).
    """
    from statefulset.integrations.torchtitan.dataloader import StatefulsetDataLoader

    config.dataloader = StatefulsetDataLoader.Config(**fields)
    return config


def statefulset_llama3_debugmodel() -> Any:
    """torchtitan's ``llama3_debugmodel`` reading a statefulset spec (set ``--dataloader.dataset``)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return with_statefulset(llama3_debugmodel())
