"""A test-only hold on preprocess units, so that a fault test's kill always lands mid-run.

``STATEFULSET_TEST_GATE`` names a file. While it exists, a unit about to start waits: a Ray task
when its number is at least the whole number the file holds (blank: every task), a local worker's
unit always. A test lets a few tasks commit, kills what it kills while the rest are held, then
removes the file. Unset (always, outside tests), it costs one environment lookup per unit.
"""

from __future__ import annotations

import time

from statefulset import settings
from statefulset.errors import StatefulsetError

POLL_SECONDS = 0.05


def _held(path: str, number: int | None) -> bool:
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return False
    if number is None or not text:
        return True
    try:
        return number >= int(text)
    except ValueError:
        raise StatefulsetError(f"STATEFULSET_TEST_GATE file {path}: holds {text!r}, not a whole number") from None


def hold(number: int | None = None) -> None:
    """Waits while the gate holds unit ``number`` (None: a local worker's unit), at most STATEFULSET_TASK_TIMEOUT."""
    path = settings.TEST_GATE.get()
    if not path:
        return
    limit = settings.TASK_TIMEOUT.get()
    deadline = time.monotonic() + limit
    while _held(path, number):
        if time.monotonic() > deadline:
            raise StatefulsetError(
                f"STATEFULSET_TEST_GATE {path}: still closed after {limit:g} s (STATEFULSET_TASK_TIMEOUT)"
            )
        time.sleep(POLL_SECONDS)
