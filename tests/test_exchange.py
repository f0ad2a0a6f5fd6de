"""The fixed-slot exchange on real gloo ranks: a payload or error that does not fit never leaves a rank behind.

Before, a source rank whose payload overflowed its 4 KiB slot (a 3,000-character non-ASCII error,
cut by characters, is ~6,000 bytes of UTF-8) raised before the collective and its peers waited
in it until the process group's timeout. Now every rank takes part and every receiver raises.
"""

from __future__ import annotations

import os

import msgpack
import numpy
import torch
from ranks import init_rank, spawn

from statefulset import IndexedDatasetWriter, StatefulsetError, WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.parallel.exchange import PAYLOAD, fit_message, gather_bytes, scatter_bytes

LONG = "é" * 3000  # 3,000 characters, 6,000 bytes of UTF-8


def _outcome(call):
    try:
        return ("ok", call())
    except StatefulsetError as exc:
        return ("error", str(exc))


def _ranks(rank: int, world: int, init_file: str, out: str) -> None:
    init_rank(rank, world, init_file)
    results = {}
    # What the loader sent before: an error record, msgpacked, of 3,000 non-ASCII characters.
    oversized = [msgpack.packb({"error": LONG})] * world if rank == 0 else None
    results["oversized_item"] = _outcome(lambda: scatter_bytes(oversized, 0))
    results["error"] = _outcome(lambda: scatter_bytes(None, 0, error=LONG if rank == 0 else None))
    items = [f"to {r}".encode() for r in range(world)] if rank == 1 else None
    results["after"] = _outcome(lambda: scatter_bytes(items, 1))
    mine = b"x" * (PAYLOAD + 1) if rank == 1 else f"from {rank}".encode()
    results["gather_oversized"] = _outcome(lambda: gather_bytes(mine, 0))
    results["gather"] = _outcome(lambda: gather_bytes(f"from {rank}".encode(), 2))
    torch.save(results, f"{out}/{rank}.pt")  # no destroy_process_group: on torch 2.4.1 it hung a rank


def test_an_oversized_payload_or_error_raises_on_every_rank_instead_of_hanging(tmp_path):
    spawn(_ranks, 3, tmp_path, str(tmp_path), timeout=240)
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(3)]
    for rank, got in enumerate(results):
        kind, text = got["oversized_item"]
        assert kind == "error" and "exceeds the 4092-byte exchange slot" in text and "global rank 0" in text, rank
        kind, text = got["error"]
        assert kind == "error" and text.startswith("éé") and text.endswith("(sent by global rank 0)"), rank
        assert "truncated to fit the exchange slot" in text
        assert len(text.split(" [...")[0].encode()) <= PAYLOAD  # cut on a character: decodes cleanly
        assert got["after"] == ("ok", f"to {rank}".encode())  # the ranks are still in step
        assert got["gather"] == ("ok", [b"from 0", b"from 1", b"from 2"] if rank == 2 else None)
    # A gather's payload that does not fit: its own rank and the destination raise, naming it.
    for rank in (0, 1):
        kind, text = results[rank]["gather_oversized"]
        assert kind == "error" and "on rank 1" in text and text.endswith("(sent by global rank 1)"), rank
    assert results[2]["gather_oversized"] == ("ok", None)


def test_fit_message_cuts_utf8_on_a_character_boundary():
    for text in ("a" * 5000, "é" * 3000, "数" * 2000, "😀" * 1500, "a" + "😀" * 1500):
        data = fit_message(text)
        assert len(data) <= PAYLOAD
        data.decode("utf-8")  # no broken character at the cut
    assert fit_message("short ü") == "short ü".encode()


def _restore_from_rank_0(rank: int, world: int, init_file: str, out: str, spec: dict) -> None:
    init_rank(rank, world, init_file)
    wc = WorkerConfig(rank=rank, world_size=world, num_workers=0)
    loader = get_savable_loader(get_train_dataset(spec, batch_size=2, worker_config=wc))
    states = None
    if rank == 0:  # a damaged state whose error message is ~6,000 bytes of UTF-8
        states = [{**loader.save_state_rank(), "format": LONG} for _ in range(world)]
    torch.save(_outcome(lambda: loader.restore_state_global(states, src_rank=0)), f"{out}/{rank}.pt")


def test_a_long_restore_error_at_the_source_rank_is_raised_on_every_rank(tmp_path):
    with IndexedDatasetWriter(tmp_path / "a") as w:
        for _ in range(50):
            w.add_document(numpy.arange(30))
    spec = {"data_path": str(tmp_path / "a"), "seq_length": 16, "packing": "native", "path_to_cache": str(tmp_path)}
    spawn(_restore_from_rank_0, 2, tmp_path, str(tmp_path), spec, timeout=240)
    for rank in range(2):
        kind, text = torch.load(tmp_path / f"{rank}.pt")
        assert kind == "error" and text.startswith("global state, entry 0: not a statefulset loader state"), rank
        assert text.endswith("(sent by DP rank 0, which checked it)"), rank


def _one_rank_leaves_the_collective(rank: int, world: int, init_file: str, out: str) -> None:
    """Rank 1 never enters the gather (as a rank stopped or killed after the meeting): rank 0 waits
    until the process group's timeout, 3 s here."""
    import datetime
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=3))  # fmt: skip
    done = f"{out}/rank0-done"
    if rank == 0:
        got = _outcome(lambda: gather_bytes(b"mine", 0, what="save_state_global"))
        torch.save(got, f"{out}/0.pt")
        open(done, "w").close()
    else:
        deadline = time.monotonic() + 120
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)


def test_a_peer_gone_inside_the_collective_is_a_named_error(tmp_path):
    """Seed 100026 of the reliability campaign: a rank stopped after the meeting of save_state_global
    left its peers with gloo's bare "Timed out waiting 60000ms for recv operation" RuntimeError. Saw
    this test fail before the fix (a RuntimeError, not a StatefulsetError)."""
    spawn(_one_rank_leaves_the_collective, 2, tmp_path, str(tmp_path), timeout=120)
    kind, text = torch.load(tmp_path / "0.pt")
    assert kind == "error", text
    assert text.startswith(
        "save_state_global: the gather over the data-parallel group (2 ranks) failed on global rank 0"
    )
    assert "process group's timeout" in text
