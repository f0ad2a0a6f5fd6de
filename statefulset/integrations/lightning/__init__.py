"""Lightning / NeMo 2 / BioNeMo: ``StatefulsetDataModule`` (``datamodule``, imports lightning), the
loaders it hands to the Trainer (``stage_loaders``) and its checkpoint entry (``checkpoint``).
"""
