"""Progress display for long jobs: a tqdm bar on a terminal, plain lines in a log file.

tqdm is a core dependency (small, pure Python, no dependencies of its own), so every install
shows progress. A bar redrawn with carriage returns is unreadable in a batch job's log, so when
stderr is not a terminal the same figures go out as one plain line every ``LINE_EVERY_S``
seconds and a last line when the job ends.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

LINE_EVERY_S = 10.0


class Progress:
    """Counts documents, tokens and input bytes and shows their rates."""

    def __init__(
        self, description: str, total_bytes: int | None, enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self.documents = 0
        self.tokens = 0
        self.bytes = 0
        self.total_bytes = total_bytes
        self.note = ""  # shown after the rates, e.g. "12/40 tasks" for --executor ray
        self._start = time.perf_counter()
        self._last_line = self._start
        self._bar: Any = None
        self._enabled = enabled
        self._description = description
        self._stream = stream if stream is not None else sys.stderr
        if enabled and _is_terminal(self._stream):
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_bytes,
                desc=description,
                unit="B",
                unit_scale=True,
                mininterval=0.5,
                file=self._stream,
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
            note = f", {self.note}" if self.note else ""
            self._bar.set_postfix_str(f"{self.documents:,} docs, {self.rates()}{note}", refresh=False)
            return
        now = time.perf_counter()
        if now - self._last_line >= LINE_EVERY_S:
            self._last_line = now
            self._line()

    def _line(self, end: str = "") -> None:
        shown = self.total_bytes if end.startswith("done") else self.bytes
        done = f"{shown / self.total_bytes:.0%} of input, " if self.total_bytes else ""
        print(
            f"{self._description}: {done}{self.documents:,} docs, {self.tokens:,} tokens, {self.rates()}"
            + (f", {self.note}" if self.note else "")
            + (f", {end}" if end else ""),
            file=self._stream,
            flush=True,
        )

    def close(self, completed: bool = True) -> None:
        """The last line or bar: 100% and "done" when the job read all its input (a Parquet file's
        footer is input no unit counts), else what it reached and "stopped" (an error, Ctrl-C)."""
        if self._bar is not None:
            if completed and self.total_bytes:
                self._bar.update(max(self.total_bytes - self._bar.n, 0))
            elif not completed:
                self._bar.set_description(f"{self._description} (stopped)", refresh=True)
            self._bar.close()
        elif self._enabled:
            self._line(f"done in {self.seconds:.1f} s" if completed else f"stopped after {self.seconds:.1f} s")


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or file-like stream without a descriptor
        return False
