"""What a case can end as, and the one exception a case raises when the data differ."""

from __future__ import annotations

PASS = "pass"  # exactly the expected bytes / batches
NAMED = "named_error"  # a StatefulsetError (or the CLI's "statefulset ...: error:") within the bound
HANG = "hang"  # the hard timeout fired, or processes outlived the process that owned them
SILENT = "silent_difference"  # it finished without an error and the data differ
UNNAMED = "unnamed_error"  # it failed with some other exception: not a hang, not silent, but not named either
VERDICTS = (PASS, NAMED, HANG, SILENT, UNNAMED)
FINDINGS = (HANG, SILENT, UNNAMED)


class Mismatch(Exception):
    """The case finished without an error, and what it produced differs from the fault-free reference."""


class Orphans(Exception):
    """Processes outlived the process that started them (a wait without an end, for whoever reaps them)."""
