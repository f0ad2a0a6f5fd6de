"""The loaders a Lightning ``Trainer`` iterates: plain for validation and test, and a training one that
looks stateful to Lightning while its state lives in the data module's checkpoint entry.

Lightning restores a stateful loader itself; ours must be restored exactly once, by the data
module (the double count of NeMo #11481), so the training loader's ``state_dict`` is a marker and
its ``load_state_dict`` only checks that marker. These classes need no Lightning import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from statefulset.errors import StatefulsetError
from statefulset.loading.loader import Loader, SavableLoader


class StageLoader:
    """What the data module hands to Lightning: a loader, its stage as NeMo's ``mode``, and ``len()``.

    ``mode`` is ``"train"``, ``"validation"`` or ``"test"`` as on NeMo's ``WrappedDataLoader``, so
    code that branches on it sees the truth. ``loader`` is the statefulset loader underneath.
    """

    def __init__(
        self, loader: SavableLoader | Loader, mode: str, length: int, renew: Callable[[Any], Any] | None = None
    ) -> None:
        self.loader = loader
        self.mode = mode
        self._length = length
        self._renew = renew

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.loader)

    def __len__(self) -> int:
        return self._length

    def release_workers(self) -> None:
        """Swap in an equivalent loader whose workers have not started (same position); the old workers stop now.

        Lightning's trainer and data module reference each other, so a loader left to the cyclic
        garbage collector takes torch's 5 s worker-join timeout per loader to shut down.
        """
        if self._renew is not None:
            self.loader = self._renew(self.loader)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mode={self.mode!r}, len={self._length}, {self.loader!r})"


class TrainStageLoader(StageLoader):
    """The training loader as Lightning sees it: stateful to Lightning, restored by the data module only.

    Lightning saves ``state_dict()`` of a stateful training loader in its loop state and loads it
    back on resume. Here that state is only a marker: the real state is in the data module's
    checkpoint entry (all DP ranks' states, not just the saving rank's), and loading the marker
    does nothing, so the stream is restored exactly once.
    """

    _MARKER: ClassVar[dict[str, str]] = {"statefulset": "restored by StatefulsetDataModule.load_state_dict"}

    def state_dict(self) -> dict[str, Any]:
        return dict(self._MARKER)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict and state_dict != self._MARKER:
            raise StatefulsetError(
                "the training loader's Lightning loop state is not a StatefulsetDataModule marker; was the "
                "checkpoint written with another training dataloader?"
            )
