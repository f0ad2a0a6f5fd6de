"""torchft: :class:`FaultTolerantLoader` serves a replica group whose quorum changes mid-run, exactly once
(docs/torchft.md). Needs no torchft import of its own: it asks the trainer's ``torchft.Manager``."""

from statefulset.integrations.torchft.loader import FaultTolerantLoader, Served

__all__ = ["FaultTolerantLoader", "Served"]
