"""The tests' bounded wait for something another process or thread does: ``wait_for(predicate, what, seconds)``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], what: str, seconds: float = 60.0) -> None:
    """Returns once ``predicate()`` is true (polled every 5 ms); after ``seconds``, an AssertionError
    naming ``what`` it waited for and the bound."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds} s waiting for {what}")
        time.sleep(0.005)
