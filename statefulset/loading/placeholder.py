"""The stand-in loader of ranks that load no data (later pipeline stages)."""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

from statefulset.errors import StatefulsetError


class PlaceholderLoader:
    """Stands in for the loader on ranks that do not load data (``loads_data`` is False).

    Yields ``placeholder`` (None by default) ``length`` times, or forever when ``length`` is
    None, so pipeline stages call ``next()`` in lockstep with the first stage. Its state methods
    mirror the savable loader's and carry nothing, so one checkpoint hook runs on every rank.
    """

    def __init__(self, length: int | None = None, placeholder: Any = None) -> None:
        if length is not None:
            if isinstance(length, bool):
                raise StatefulsetError(f"PlaceholderLoader: length must be a non-negative integer, got {length!r}")
            try:
                length = operator.index(length)
            except TypeError:
                raise StatefulsetError(
                    f"PlaceholderLoader: length must be a non-negative integer or None, got {length!r}"
                ) from None
            if length < 0:
                raise StatefulsetError(f"PlaceholderLoader: length must be non-negative, got {length}")
        self.length = length
        self.placeholder = placeholder

    def __iter__(self) -> Iterator[Any]:
        if self.length is None:
            while True:
                yield self.placeholder
        for _ in range(self.length):
            yield self.placeholder

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("PlaceholderLoader without a length is endless and has no len()")
        return self.length

    def save_state_rank(self) -> None:
        """Nothing to save: a placeholder rank contributes no state."""
        return None

    def restore_state_rank(self, state: Any) -> None:
        """Accept and ignore any state (normally None) so restore hooks run unchanged."""

    def save_state_global(self, global_dst_rank: int = 0) -> None:
        """Returns None without communicating: a placeholder's DP group holds only placeholders."""
        return None

    def restore_state_global(self, state: Any, src_rank: int | None = None) -> None:
        """Accept and ignore any state, without communicating (see :meth:`save_state_global`)."""

    def state_dict(self) -> dict[str, Any]:
        """Empty, for torch.distributed.checkpoint's Stateful protocol."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accept and ignore (the Stateful counterpart of :meth:`restore_state_rank`)."""
