"""torchtitan (0.3): a drop-in train dataloader (``dataloader``), its DCP checkpoint layout (``dcp_layout``) and
config-registry functions for ``--module statefulset.integrations.torchtitan --config ...`` (``config_registry``)."""

from statefulset.integrations.torchtitan.dataloader import IGNORE_INDEX, StatefulsetDataLoader

__all__ = ["IGNORE_INDEX", "StatefulsetDataLoader"]
