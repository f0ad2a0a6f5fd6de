"""The test harness's ranks: a rank that is done right after ``init_rank`` must not break a peer's start."""

from __future__ import annotations

from ranks import init_rank, spawn


def _leave_at_once(rank: int, world: int, init_file: str) -> None:
    init_rank(rank, world, init_file)


def test_ranks_that_leave_at_once_do_not_break_their_peers_rendezvous(tmp_path):
    # Gloo's init returns on one rank before its peers have finished connecting; a rank that exits
    # then made a peer fail with "Gloo connectFullMesh failed ... Connection closed by peer".
    for _ in range(8):
        spawn(_leave_at_once, 3, tmp_path)
