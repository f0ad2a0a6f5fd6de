"""``log_loader_metrics``: the loader's metrics into Megatron-LM's TensorBoard writer and wandb at ``--log-interval``.

Call it in ``training_log`` (or after each ``train_step``) on every rank::

    log_loader_metrics(train_data_iterator, iteration, args.log_interval)

Megatron's writers exist on its last rank only (``get_tensorboard_writer()`` and
``get_wandb_writer()`` return None elsewhere), so other ranks compute and write nothing, unless
``across_ranks=True``: then every rank that reads data takes part in one collective over its DP
group (``loader.metrics(across_ranks=True)``), so call it on all of them. docs/observability.md
lists the metrics.
"""

from __future__ import annotations

from typing import Any

from statefulset.errors import StatefulsetError
from statefulset.loading.metrics import log_metrics


def _megatron_writers() -> tuple[Any, Any]:
    try:
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
    except ImportError:
        return None, None
    return get_tensorboard_writer(), get_wandb_writer()


def log_loader_metrics(
    source: Any,
    iteration: int,
    log_interval: int,
    writer: Any = None,
    wandb_writer: Any = None,
    across_ranks: bool = False,
    prefix: str = "data/",
) -> dict[str, float] | None:
    """Every ``log_interval`` iterations: the loader's metrics, written to ``writer`` (``add_scalar``) and
    ``wandb_writer`` (``log``); both default to Megatron-LM's. Returns them (None when not logged here).

    ``source``: a :class:`~statefulset.integrations.megatron.MegatronIterator` (as Megatron passes it,
    perhaps wrapped in its ``RerunDataIterator``) or a loader.
    """
    if isinstance(log_interval, bool) or not isinstance(log_interval, int) or log_interval < 1:
        raise StatefulsetError(f"log_loader_metrics: log_interval must be a positive int, got {log_interval!r}")
    if iteration % log_interval:
        return None
    source = getattr(source, "iterable", source)  # Megatron's RerunDataIterator keeps the iterator here
    loader = getattr(source, "loader", source)
    if loader is None or not hasattr(loader, "metrics"):
        return None  # a stage that receives its batches: it reads nothing
    if writer is None and wandb_writer is None:
        writer, wandb_writer = _megatron_writers()
    if writer is None and wandb_writer is None and not across_ranks:
        return None
    values = loader.metrics(across_ranks) if across_ranks else loader.metrics()
    if writer is not None:
        log_metrics(values, writer, iteration, prefix)
    if wandb_writer is not None:
        wandb_writer.log({prefix + k: v for k, v in values.items()}, iteration)
    return values
