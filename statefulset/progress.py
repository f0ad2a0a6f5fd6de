"""Progress display for long jobs: tqdm when installed (the ``progress`` extra), else plain lines."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """Counts documents, tokens and input bytes and shows their rates."""

    def __init__(self, description: str, total_bytes: int | None, enabled: bool = True) -> None:
        self.documents = 0
        self.tokens = 0
        self.bytes = 0
        self._start = time.perf_counter()
        self._last_line = self._start
        self._bar: Any = None
        self._enabled = enabled
        self._description = description
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(
                total=total_bytes,
                desc=description,
                unit="B",
                unit_scale=True,
                mininterval=0.5,
                file=sys.stderr,
            )

    @property
    def seconds(self) -> float:
        return max(time.perf_counter() - self._start, 1e-9)

    def rates(self) -> str:
        s = self.seconds
        return f"{self.documents / s:,.0f} docs/s, {self.tokens / s:,.0f} tokens/s"

    def update(self, documents: int, tokens: int, nbytes: int) -> None:
        self.documents += documents
        self.tokens += tokens
        self.bytes += nbytes
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.update(nbytes)
            self._bar.set_postfix_str(f"{self.documents:,} docs, {self.rates()}", refresh=False)
            return
        now = time.perf_counter()
        if now - self._last_line >= 2.0:
            self._last_line = now
            print(f"{self._description}: {self.documents:,} docs, {self.rates()}", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
