"""The Nanotron drop-in on real gloo ranks: whole ordered streams per rank, TensorPointers, labels, resume.

Every rank records each micro-batch it yields (tensors as they are, pointers as ``("ptr", group_rank)``)
with ``torch.save``; the checks run here against the contract's layout read through ``open_stream``:
DP rank ``r`` of ``W``, micro-batch ``t``, row ``j`` is global position ``c0 + (t*W + r)*B + j``.
"""

from __future__ import annotations

import os
import types

import numpy
import pytest
import torch
from ranks import init_rank, spawn

from statefulset import (
    IndexedDatasetWriter,
    ParallelLayout,
    StatefulsetError,
    create_parallel_groups,
    get_train_dataset,
    open_stream,
)
from statefulset.integrations.nanotron.batch import NANOTRON_KEYS, TensorPointer, clm_micro_batch
from statefulset.integrations.nanotron.context import layout_from_parallel_context
from statefulset.integrations.nanotron.dataloader import build_nanotron_dataloader
from statefulset.tools.demo import demo_spec

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

SEQ = 16


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> str:
    return demo_spec(str(tmp_path_factory.mktemp("corpus")), documents=300, seq_length=SEQ)


def _record(batch: dict) -> dict:
    """A micro-batch as plain data for ``torch.load(weights_only=True)``."""
    out = {}
    for key, value in batch.items():
        if isinstance(value, TensorPointer):
            out[key] = ("ptr", value.group_rank)
        else:
            out[key] = value
    return out


def _rows(spec: str, positions) -> torch.Tensor:
    return torch.from_numpy(open_stream(spec).gather(numpy.asarray(positions, dtype=numpy.int64)))


def _expected_text(spec: str, consumed: int, dp_rank: int, dp_size: int, mbs: int, count: int) -> list[torch.Tensor]:
    """Text rows ``[mbs, S+1]`` of micro-batches ``0 .. count-1`` of one DP rank, from the stream layout."""
    out = []
    for t in range(count):
        first = consumed + (t * dp_size + dp_rank) * mbs
        out.append(_rows(spec, range(first, first + mbs)))
    return out


def _check_stream(records: list[dict], texts: list[torch.Tensor], pp_rank: int, inp: int, outp: int) -> None:
    """Each record is exactly Nanotron's collator output for the expected text on ``pp_rank``."""
    assert len(records) == len(texts)
    for got, text in zip(records, texts, strict=True):
        assert [k for k in got if k != "sample_id"] == list(NANOTRON_KEYS)
        if pp_rank == inp:
            assert torch.equal(got["input_ids"], text[:, :-1])
            assert got["input_mask"].dtype == torch.bool and bool(got["input_mask"].all())
            assert got["input_mask"].shape == (text.shape[0], SEQ)
        else:
            assert got["input_ids"] == ("ptr", inp) and got["input_mask"] == ("ptr", inp)
        if pp_rank == outp:
            assert torch.equal(got["label_ids"], text[:, 1:])
            assert got["label_mask"].dtype == torch.bool and bool(got["label_mask"].all())
            assert got["label_mask"].shape == (text.shape[0], SEQ)
        else:
            assert got["label_ids"] == ("ptr", outp) and got["label_mask"] == ("ptr", outp)


# --- 8 ranks: TP2 PP2 DP2 ----------------------------------------------------------------------


def _tp2pp2dp2(rank: int, world: int, init_file: str, spec: str, out: str) -> None:
    import torch.distributed as dist

    init_rank(rank, world, init_file)
    layout = ParallelLayout(world, tp=2, pp=2)
    # One input rank with a worker process, to show workers do not change the stream.
    dl = build_nanotron_dataloader(
        spec, layout, micro_batch_size=2, n_micro_batches_per_batch=3, num_workers=1 if rank == 0 else 0
    )
    seen = []
    for _ in range(3):
        # The input stage draws a whole step before the output stage draws anything: the trainer's
        # lazy generator may be consumed in any interleaving, and this is the one that would
        # deadlock a link that waited for the receiver.
        if dl.is_input_stage:
            seen.extend(_record(mb) for mb in dl.micro_batches())
            dist.barrier()
        else:
            dist.barrier()
            seen.extend(_record(mb) for mb in dl.micro_batches())
    consumed = dl.consumed_train_samples
    dl.flush()
    # Nanotron's resume: a fresh loader from the metadata integer after step 2 (2 * mbs * n * dp = 24).
    resumed = build_nanotron_dataloader(
        spec, layout, micro_batch_size=2, n_micro_batches_per_batch=3, consumed_train_samples=24
    )
    again = [_record(mb) for mb in resumed.micro_batches()]
    resumed.flush()
    torch.save({"seen": seen, "again": again, "consumed": consumed}, f"{out}/{rank}.pt")
    dist.barrier()


def test_tp2_pp2_dp2_streams_pointers_labels_and_resume(tmp_path, spec):
    spawn(_tp2pp2dp2, 8, tmp_path, spec, str(tmp_path))
    layout = ParallelLayout(8, tp=2, pp=2)
    by_rank = {rank: torch.load(tmp_path / f"{rank}.pt") for rank in range(8)}
    for rank, got in by_rank.items():
        info = layout.rank_info(rank)
        texts = _expected_text(spec, 0, info.dp_rank, 2, 2, 9)
        _check_stream(got["seen"], texts, info.pp_rank, 0, 1)
        _check_stream(got["again"], texts[6:], info.pp_rank, 0, 1)
        assert got["consumed"] == 3 * 2 * 3 * 2  # Nanotron's metadata after 3 steps
        if info.pp_rank == 1:
            # The last stage's labels are the first stage's inputs shifted, for the same pipeline.
            first = by_rank[info.first_stage_rank]["seen"]
            for mine, theirs in zip(got["seen"], first, strict=True):
                assert torch.equal(mine["label_ids"][:, :-1], theirs["input_ids"][:, 1:])
    # TP peers read the same samples; DP ranks read different ones.
    assert all(
        torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(by_rank[0]["seen"], by_rank[1]["seen"], strict=True)
    )
    assert not torch.equal(by_rank[0]["seen"][0]["input_ids"], by_rank[2]["seen"][0]["input_ids"])


# --- 6 ranks: PP3 (a middle stage) TP1 DP2 -----------------------------------------------------


def _pp3dp2(rank: int, world: int, init_file: str, spec: str, out: str) -> None:
    import torch.distributed as dist

    init_rank(rank, world, init_file)
    layout = ParallelLayout(world, pp=3)
    groups = create_parallel_groups(layout, ("dp", "pp", "tp"))
    context = types.SimpleNamespace(
        tensor_parallel_size=1,
        pipeline_parallel_size=3,
        data_parallel_size=2,
        context_parallel_size=1,
        expert_parallel_size=1,
        tp_pg=groups["tp"],
        pp_pg=groups["pp"],
        dp_pg=groups["dp"],
    )
    record: dict = {}
    # A context whose pp_pg and dp_pg are swapped: ranks 1, 2, 4, 5 get a wrong coordinate from them.
    wrong = types.SimpleNamespace(**{**vars(context), "pp_pg": groups["dp"], "dp_pg": groups["pp"]})
    try:
        build_nanotron_dataloader(spec, wrong, micro_batch_size=2)
    except StatefulsetError as error:
        record["wrong_context"] = str(error)
    # Resume from an elastic count: 6 is no multiple of this job's global batch (2 * 2 * 2 = 8).
    options = {"micro_batch_size": 2, "n_micro_batches_per_batch": 2, "include_sample_id": True}
    dl = build_nanotron_dataloader(spec, context, consumed_train_samples=6, **options)
    record["repr"] = repr(dl)
    seen = [_record(mb) for mb in dl.micro_batches()]  # step 1, ranks interleave freely
    state = dl.state_dict()
    record["consumed_at_save"] = dl.consumed_train_samples
    seen.extend(_record(mb) for mb in dl.micro_batches())  # step 2, uninterrupted
    dl.flush()
    restored = build_nanotron_dataloader(spec, layout, **options)
    restored.load_state_dict(state)
    record["again"] = [_record(mb) for mb in restored.micro_batches()]
    try:
        restored.restore_state_rank(state[f"rank_{rank}"])
    except StatefulsetError as error:
        record["late_restore"] = str(error)
    restored.flush()
    record["seen"] = seen
    torch.save(record, f"{out}/{rank}.pt")
    dist.barrier()


def test_pp3_middle_stage_pointers_state_dict_and_elastic_count(tmp_path, spec):
    spawn(_pp3dp2, 6, tmp_path, spec, str(tmp_path))
    layout = ParallelLayout(6, pp=3)
    for rank in range(6):
        got = torch.load(tmp_path / f"{rank}.pt")
        info = layout.rank_info(rank)
        texts = _expected_text(spec, 6, info.dp_rank, 2, 2, 4)
        _check_stream(got["seen"], texts, info.pp_rank, 0, 2)
        _check_stream(got["again"], texts[2:], info.pp_rank, 0, 2)
        assert got["consumed_at_save"] == 6 + 8
        assert "already yielded" in got["late_restore"]
        for t, mb in enumerate(got["seen"]):
            if info.pp_rank == 1:
                assert mb["sample_id"] == ("ptr", 0)
            else:
                first = 6 + (t * 2 + info.dp_rank) * 2
                assert mb["sample_id"].tolist() == [first, first + 1]
        role = {0: "input", 1: "pointers", 2: "output"}[info.pp_rank]
        assert f"role={role}" in got["repr"]
        # Ranks 1, 2, 4, 5 see the swap (0 and 3 have group ranks equal to their coordinates);
        # every rank raises, naming the first rank that saw it and counting the others.
        assert "global rank 1 is " in got["wrong_context"], got["wrong_context"]
        assert "the context uses another layout" in got["wrong_context"]
        assert got["wrong_context"].endswith("(and 3 more)")


# --- one process: TP1 PP1, DP2 -> DP1 resume, state, bad inputs ---------------------------------


def test_single_process_stream_resume_from_dp2_and_state(spec):
    layout = ParallelLayout(1)
    dl = build_nanotron_dataloader(spec, layout, micro_batch_size=3, n_micro_batches_per_batch=2)
    assert dl.is_input_stage and dl.is_output_stage and dl.global_batch_size == 6
    records = [_record(next(dl)) for _ in range(4)]
    _check_stream(records, _expected_text(spec, 0, 0, 1, 3, 4), 0, 0, 0)
    assert records[0]["input_mask"].data_ptr() != records[0]["label_mask"].data_ptr()
    assert dl.consumed_train_samples == 12
    assert dl.metrics()["batches"] == 4 and dl.metrics()["position"] == 12  # the input stage's loader
    state = dl.save_state_rank()
    fresh = build_nanotron_dataloader(spec, layout, micro_batch_size=3, n_micro_batches_per_batch=2)
    fresh.restore_state_rank(state)
    assert fresh.consumed_train_samples == 12
    _check_stream([_record(next(fresh))], _expected_text(spec, 12, 0, 1, 3, 1), 0, 0, 0)

    # The 8-rank test's job (DP2, mbs 2, n 3) after 2 steps left consumed_train_samples = 24; a DP1 job
    # with another micro-batch size continues at position 24.
    dp1 = build_nanotron_dataloader(spec, layout, micro_batch_size=4, consumed_train_samples=24)
    _check_stream([_record(next(dp1)) for _ in range(2)], _expected_text(spec, 24, 0, 1, 4, 2), 0, 0, 0)

    with pytest.raises(StatefulsetError, match="dp_size 1, this job has 2"):
        dp2 = build_nanotron_dataloader(spec, ParallelLayout(2), 1, micro_batch_size=3)
        dp2.restore_state_rank(state)
    with pytest.raises(StatefulsetError, match="already yielded"):
        dl.restore_state_rank(state)
    with pytest.raises(StatefulsetError, match="key 'rank_0' is missing"):
        fresh.load_state_dict({})
    with pytest.raises(StatefulsetError, match="not a statefulset Nanotron loader state"):
        build_nanotron_dataloader(spec, layout, micro_batch_size=3).restore_state_rank({"consumed": 3})
    # A state from other data is refused by the loader's fingerprint.
    other = demo_spec(os.path.dirname(spec), documents=300, seq_length=SEQ, seed=99)
    with pytest.raises(StatefulsetError, match="seed"):
        build_nanotron_dataloader(other, layout, micro_batch_size=3).restore_state_rank(state)


def test_clm_micro_batch_matches_nanotron_collator_with_context_parallel():
    text = torch.arange(2 * 9, dtype=torch.int64).view(2, 9)
    whole = clm_micro_batch(text)
    assert torch.equal(whole["input_ids"], text[:, :-1]) and torch.equal(whole["label_ids"], text[:, 1:])
    parts = [clm_micro_batch(text, cp_rank=c, cp_size=4) for c in range(4)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], dim=1), text[:, :-1])
    assert torch.equal(torch.cat([p["label_ids"] for p in parts], dim=1), text[:, 1:])
    assert all(p["input_mask"].shape == (2, 2) for p in parts)
    middle = clm_micro_batch(None, pp_rank=1, input_pp_rank=0, output_pp_rank=2)
    assert middle == {
        "input_ids": TensorPointer(0),
        "input_mask": TensorPointer(0),
        "label_ids": TensorPointer(2),
        "label_mask": TensorPointer(2),
    }
    last = clm_micro_batch(text, pp_rank=2, input_pp_rank=0, output_pp_rank=2)
    assert last["input_ids"] == TensorPointer(0) and torch.equal(last["label_ids"], text[:, 1:])
    for bad, match in (
        (dict(text=text[0]), "2-D tensor"),
        (dict(text=text.float()), "int64"),
        (dict(text=text, cp_size=3), "not divisible by cp_size 3"),
        (dict(text=text, cp_rank=2, cp_size=2), "cp_rank 2 is outside"),
        (dict(text=None), "2-D tensor"),
    ):
        with pytest.raises(StatefulsetError, match=match):
            clm_micro_batch(**bad)


def test_layout_from_parallel_context():
    ctx = types.SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    layout = layout_from_parallel_context(ctx)
    assert (layout.world_size, layout.tp, layout.pp, layout.dp) == (8, 2, 2, 2)
    # Nanotron's reshape(ep, pp, dp, cp, tp): rank = tp + 2*dp + 4*pp.
    assert [(i.tp_rank, i.dp_rank, i.pp_rank) for i in map(layout.rank_info, range(8))] == [
        (r % 2, r // 2 % 2, r // 4) for r in range(8)
    ]
    with pytest.raises(StatefulsetError, match="expert_parallel_size 2"):
        layout_from_parallel_context(types.SimpleNamespace(**vars(ctx), expert_parallel_size=2))
    with pytest.raises(StatefulsetError, match="no attribute 'data_parallel_size'"):
        layout_from_parallel_context(types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))


@pytest.mark.parametrize(
    ("parallel", "kwargs", "match"),
    [
        (ParallelLayout(1), {"micro_batch_size": 0}, "micro_batch_size must be an integer >= 1, got 0"),
        (ParallelLayout(1), {"micro_batch_size": True}, "micro_batch_size must be an integer"),
        (ParallelLayout(1), {"micro_batch_size": 2, "n_micro_batches_per_batch": 0}, "n_micro_batches_per_batch"),
        (ParallelLayout(1), {"micro_batch_size": 2, "consumed_train_samples": -1}, "consumed_train_samples"),
        (ParallelLayout(1), {"micro_batch_size": 2, "consumed_train_samples": 2.0}, "consumed_train_samples"),
        (ParallelLayout(1), {"micro_batch_size": 2, "input_pp_rank": 1}, r"input_pp_rank 1 is outside .* pp 1"),
        (ParallelLayout(1), {"micro_batch_size": 2, "output_pp_rank": 3}, "output_pp_rank 3 is outside"),
        (ParallelLayout(1), {"micro_batch_size": 2, "rank": 1}, r"rank 1 is outside \[0, world_size 1\)"),
        (ParallelLayout(1), {"micro_batch_size": 2, "num_workers": -1}, "num_workers"),
        (
            ParallelLayout(1),
            {"micro_batch_size": 2, "sequence_length": 32},
            r"sequence_length 32 .* seq_length 16 \(.*\.yaml\)",
        ),
        (ParallelLayout(1), {"micro_batch_size": 2, "prefetch": 2}, "unknown keyword argument.*prefetch"),
        (ParallelLayout(3, cp=3), {"micro_batch_size": 2}, r"seq_length 16 is not divisible by cp 3 \(.*\.yaml;"),
        (ParallelLayout(2, pp=2), {"micro_batch_size": 2}, "needs torch.distributed"),
        ("tp=2", {"micro_batch_size": 2}, "must be a ParallelLayout or a Nanotron ParallelContext, got str"),
    ],
)
def test_bad_inputs_raise(spec, parallel, kwargs, match):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("needs a process without a default group")
    with pytest.raises(StatefulsetError, match=match):
        build_nanotron_dataloader(spec, parallel, **kwargs)


def test_bad_spec_raises_before_any_role(tmp_path):
    # The spec is parsed before roles are assigned, so middle stages (which read no shard) refuse it too.
    (tmp_path / "bad.yaml").write_text("seq_length: 16\nbogus: 1\n")
    with pytest.raises(StatefulsetError, match="bogus"):
        build_nanotron_dataloader(str(tmp_path / "bad.yaml"), ParallelLayout(1), micro_batch_size=2)


def _corrupt_shard(rank: int, world: int, init_file: str, spec: str, out: str) -> None:
    init_rank(rank, world, init_file)
    try:
        build_nanotron_dataloader(spec, ParallelLayout(world, pp=2), micro_batch_size=2)
        message = "built"
    except StatefulsetError as error:
        message = str(error)
    torch.save(message, f"{out}/{rank}.pt")


def test_a_corrupt_shard_fails_every_stage_instead_of_hanging_the_output_stage(tmp_path):
    path = demo_spec(str(tmp_path / "corpus"), documents=60, seq_length=SEQ)
    idx = next(p for p in (tmp_path / "corpus").iterdir() if p.name.startswith("part_a") and p.suffix == ".idx")
    idx.write_bytes(idx.read_bytes()[:-8])  # only the input stage opens shards
    spawn(_corrupt_shard, 2, tmp_path, path, str(tmp_path))
    for rank in range(2):
        message = torch.load(tmp_path / f"{rank}.pt")
        assert message.startswith("rank 0: ") and idx.name in message, message


def _nanotron_collator_with_position_ids(examples: list[dict], sequence_length: int) -> dict:
    """Nanotron's DataCollatorForCLMWithPositionIds on one stage holding inputs and labels (transcribed)."""
    input_ids = numpy.vstack([e["input_ids"] for e in examples])
    position_ids = numpy.vstack([e["position_ids"] for e in examples])
    label_mask = numpy.vstack([e["label_mask"] for e in examples])
    return {
        "input_ids": input_ids[:, :-1],
        "position_ids": position_ids[:, :-1],
        "label_ids": input_ids[:, 1:],
        "label_mask": label_mask[:, 1:],
    }


@pytest.mark.parametrize("packing", ["native", "bestfit"])
def test_position_ids_format_equals_nanotrons_collator(tmp_path, packing):
    """Examples of seq_length + 1 tokens whose positions restart at each document (read off the tokens here)."""
    stride, seq = 10_000, 32
    prefix = str(tmp_path / "docs")
    rng = numpy.random.default_rng(2)
    with IndexedDatasetWriter(prefix, numpy.int32) as writer:
        for d in range(300):
            writer.add_document(d * stride + numpy.arange(int(rng.geometric(1 / 12))))
    spec = {"data_path": prefix, "seq_length": seq, "split": "1", "packing": packing}
    dl = build_nanotron_dataloader(spec, ParallelLayout(1), micro_batch_size=4, position_ids=True)
    for step in range(5):
        batch = next(dl)
        assert list(batch) == ["input_ids", "position_ids", "label_ids", "label_mask"]
        text = open_stream(spec).gather(numpy.arange(step * 4, step * 4 + 4))
        examples = []
        for row in text:
            positions, mask = numpy.zeros(seq + 1, dtype=numpy.int64), row != -1
            for i in range(1, seq + 1):
                continues = row[i] == row[i - 1] + 1 or (row[i] == -1 and row[i - 1] == -1)
                positions[i] = positions[i - 1] + 1 if continues else 0
            examples.append({"input_ids": row, "position_ids": positions, "label_mask": mask})
        expected = _nanotron_collator_with_position_ids(examples, seq)
        for key, value in expected.items():
            assert batch[key].dtype == torch.from_numpy(value).dtype, key
            numpy.testing.assert_array_equal(batch[key].numpy(), value, err_msg=key)


@pytest.mark.parametrize("packing", ["native", "bestfit"])
def test_label_mask_takes_the_loss_mask_shard(tmp_path, packing):
    """A source with a loss-mask shard: label_mask is False on the labels of loss=false segments (and padding)."""
    prefix = str(tmp_path / "sft")
    rng = numpy.random.default_rng(3)
    with (
        IndexedDatasetWriter(prefix, numpy.uint16) as tokens,
        IndexedDatasetWriter(prefix + "_loss_mask", numpy.uint8) as mask,
    ):
        for _ in range(200):
            prompt, answer = int(rng.integers(1, 12)), int(rng.integers(1, 12))
            tokens.add_document(rng.integers(0, 1000, prompt + answer))
            mask.add_document(numpy.r_[numpy.zeros(prompt, numpy.uint8), numpy.ones(answer, numpy.uint8)])
    spec = {"data_path": prefix, "seq_length": 32, "split": "1", "packing": packing}
    dl = build_nanotron_dataloader(spec, ParallelLayout(1), micro_batch_size=4)
    ds = get_train_dataset(spec, batch_size=4)
    for step in range(3):
        batch = next(dl)
        want = numpy.stack([ds[p]["loss_mask"] for p in range(step * 4, step * 4 + 4)]) != 0
        numpy.testing.assert_array_equal(batch["label_mask"].numpy(), want)
        assert not want.all()
