"""Framework integrations, each imported only when used: Megatron-LM (``megatron``), Nanotron
(``nanotron``), Lightning / NeMo / BioNeMo (``lightning``), torchtitan (``torchtitan``), torchft (``torchft``).
"""
