"""The task encoder a state was saved with (CONTRACT §15): recorded, and compared at restore.

A state records the encoder's identity (``module.QualifiedName@version``) as ``identity.task_encoder``;
a state without it was saved without an encoder (every state before encoders existed). Restoring
with another encoder, another ``version`` of it, or none where there was one is refused naming
both, since the batches after the restore would not be those of an uninterrupted run; with
``get_savable_loader(ds, allow_changed_task_encoder=True)`` it is allowed, logged at WARNING.
"""

from __future__ import annotations

import logging
from typing import Any

from statefulset.errors import StatefulsetError

_log = logging.getLogger("statefulset")
_MAX_CHARS = 512  # a state travels in a fixed 4 KiB slot (statefulset.parallel.exchange)


def with_encoder(identity: dict[str, Any], encoder: str | None) -> dict[str, Any]:
    """The identity a state records: the stream's, plus the encoder's when there is one."""
    if encoder is None:
        return identity
    if len(encoder) > _MAX_CHARS:
        raise StatefulsetError(f"task encoder identity {encoder[:80]!r}... is over {_MAX_CHARS} characters")
    return {**identity, "task_encoder": encoder}


def _named(identity: Any) -> str:
    return f"task encoder {identity}" if identity is not None else "no task encoder"


def check_encoder(states: Any, encoder: str | None, allow_changed: bool, where: str) -> None:
    """Refuse (or, when allowed, log) a state or list of states saved with another encoder than ``encoder``.

    Structure is checked elsewhere (statefulset.loading.state); an entry that is not a state is left to it.
    """
    entries = states if isinstance(states, list | tuple) else [states]
    for i, state in enumerate(entries):
        identity = state.get("identity") if isinstance(state, dict) else None
        if not isinstance(identity, dict):
            continue
        saved = identity.get("task_encoder")
        if saved == encoder:
            continue
        entry = f"{where}, entry {i}" if isinstance(states, list | tuple) else where
        said = f"the state was saved with {_named(saved)}, this loader runs {_named(encoder)}"
        if not allow_changed:
            raise StatefulsetError(
                f"{entry}: {said}: the batches after the restore would not be those of an uninterrupted run; "
                "restore with the same encoder and version, or pass get_savable_loader(ds, "
                "allow_changed_task_encoder=True) to continue with the new one"
            )
        _log.warning(
            "statefulset: %s: %s; continuing with it (allow_changed_task_encoder=True): the positions continue "
            "exactly, the encoded samples are the new encoder's",
            entry,
            said,
        )
        return
