"""What a refused loader state says, in words: which field differs, which sources, which stage.

:func:`statefulset.loading.state.check_identity` decides whether a state fits the dataset; this
module phrases the refusal (the members that differ by name, a past stage that changed, the
shards whose content changed, and what a state saved by statefulset 0.1.0 cannot do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from statefulset.streams.members import differences


@dataclass(frozen=True)
class RefusalWords:
    """What a refusal can say about two identities."""

    saved: dict[str, Any]
    identity: dict[str, Any]
    named: str  # the shards whose content changed, where "shards" tells
    legacy: bool  # the state was saved by statefulset 0.1.0
    names: dict[str, str]

    def field(self, key: str) -> str:
        saved, identity = self.saved, self.identity
        if key == "stages":
            if "stages" in saved:
                return "stages: the state was saved on a data schedule, this spec has none"
            why = "this spec is a data schedule, the state's was not"
            if self.legacy:
                why += (" (statefulset 0.1.0 read a plain data_path of packing native or bestfit differently; this "
                        "version reads it as the one-stage schedule, whose source orders differ: "
                        "restore_consumed_samples starts at the state's position)")  # fmt: skip
            return f"stages: {why}"
        if key != "data":
            return f"{key}: state has {saved.get(key)!r}, this loader {identity.get(key)!r}"
        said = self.members(saved.get("members"), identity.get("members"))
        return (
            "data: the shards, their split ranges or weights differ"
            + (f": {said}" if said else "")
            + (f" ({self.named})" if self.named else "")
        )

    def members(self, before: Any, after: Any) -> str:
        if before is None or after is None:
            return ""
        return differences(before, after, self.names)

    def stage(self, k: int) -> str:
        before, after = self.saved.get("stage_members"), self.identity.get("stage_members")
        if before is None or after is None or k >= len(before) or k >= len(after):
            return ""
        return self.members(before[k], after[k])


def past_stages_problem(saved: list[Any], current: list[Any], position: int, words: RefusalWords) -> str | None:
    """What differs in the stages that began before ``position`` (they must be identical), or None."""
    past = [list(entry) for entry in saved if entry[0] < position]
    now = [list(entry) for entry in current if entry[0] < position]
    if past == now:
        return None
    k = next(i for i in range(max(len(past), len(now))) if i >= len(past) or i >= len(now) or past[i] != now[i])
    if k >= len(now):
        what = f"stage {k} (start {past[k][0]}) is gone"
    elif k >= len(past):
        what = f"stage {k} (start {now[k][0]}) is new but begins before that position"
    elif past[k][0] != now[k][0]:
        what = f"stage {k} starts at {now[k][0]}, the state's at {past[k][0]}"
    else:
        what = f"stage {k} (start {now[k][0]}) reads other sources or weights"
        said = words.stage(k)
        what += (f": {said}" if said else "") + (f" ({words.named})" if words.named else "")
        if words.legacy:
            what += (
                " (or the state was saved by statefulset 0.1.0, which keyed a schedule's sources by their .idx alone:"
                " its source orders cannot be continued exactly; restore_consumed_samples starts at its position)"
            )
    return (
        f"the state was saved at position {position}, and the stages that began before it must stay as "
        f"they were: {what}. Change the mixture from a position at or after {position} with a new stage instead"
    )
