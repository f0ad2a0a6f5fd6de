"""Transforms that resume exactly: task encoders over token samples, keyed randomness, and built-in
transforms such as fill-in-the-middle (CONTRACT §15; docs/transforms.md)."""

from statefulset.transforms.fim import FillInTheMiddle
from statefulset.transforms.sample import TokenSample

__all__ = ["FillInTheMiddle", "TokenSample"]
