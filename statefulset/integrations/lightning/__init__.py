"""Lightning / NeMo 2 / BioNeMo: ``StatefulsetDataModule`` (``datamodule``, imports lightning) and the
loaders it hands to the Trainer (``stage_loaders``).
"""
