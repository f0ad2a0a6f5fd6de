"""A stand-in for torchft's Manager, as FaultTolerantLoader reads it, for tests that script the quorum."""

from __future__ import annotations


class ScriptedQuorum:
    """Answers what FaultTolerantLoader asks a torchft Manager, as torchft does, for quorums the test
    scripts (no lighthouse: the quorum changes exactly at the step the test chose): each commit adds
    the participants to ``batches_committed``; a failed one adds nothing."""

    def __init__(self, participants: int, rank: int) -> None:
        self.participants, self.rank, self.step, self.committed = participants, rank, 0, 0

    def start_quorum(self) -> None:
        pass

    def num_participants(self) -> int:
        return self.participants

    def participating_rank(self) -> int:
        return self.rank

    def is_participating(self) -> bool:
        return True

    def batches_committed(self) -> int:
        return self.committed

    def current_step(self) -> int:
        return self.step

    def commit(self, ok: bool = True) -> None:
        if ok:
            self.step += 1
            self.committed += self.participants
