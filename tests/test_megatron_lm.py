"""The Megatron-LM drop-in: batches against megatron-core 0.16.1, iterators on real TP2 x PP2 x DP2 gloo ranks.

Every distributed check compares whole ordered streams with a single-process reference built
from the stream layout (DP rank r, micro-batch t, row j = global position (t*W + r)*B + j).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import warnings

import numpy
import pytest
import torch
from ranks import init_rank, spawn

from statefulset import (
    IndexedDatasetWriter,
    ParallelLayout,
    StatefulsetError,
    WorkerConfig,
    get_savable_loader,
    get_train_dataset,
)
from statefulset.integrations.megatron.batch import GPTBatchConfig, GPTDocumentBatch, gpt_batch
from statefulset.integrations.megatron.builder import build_megatron_iterators
from statefulset.integrations.megatron.state_files import (
    load_megatron_dataloader_state,
    megatron_dataloader_state_path,
    save_megatron_dataloader_state,
)
from statefulset.parallel.groups import create_parallel_groups
from statefulset.streams.opening import open_stream
from statefulset.tools.demo import demo_spec

B, SEQ, STEPS, CUT = 2, 32, 6, 3
CFG = GPTBatchConfig(
    eod_token=256, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True, create_attention_mask=True
)
FIRST_KEYS = ("tokens", "attention_mask", "position_ids", "sample_id")
LAST_KEYS = ("labels", "loss_mask", "attention_mask", "sample_id")


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return demo_spec(str(tmp_path_factory.mktemp("demo")), seq_length=SEQ)


# -- batches: megatron-core's GPTDataset.__getitem__ as the oracle --------------------------------
@pytest.fixture(scope="module")
def eod_corpus(tmp_path_factory):
    """Tiny vocabulary with EOD id 3 inside documents too, so every window holds several EODs."""
    prefix = str(tmp_path_factory.mktemp("eod") / "corpus")
    rng = numpy.random.default_rng(0)
    with IndexedDatasetWriter(prefix, numpy.uint16) as writer:
        for _ in range(120):
            writer.add_document(numpy.append(rng.integers(0, 20, int(rng.geometric(1 / 25))), 3))
    return prefix


def _megatron_gpt(prefix, flags, pad, inter_document_masking=False):
    from megatron.core.datasets import blended_megatron_dataset_builder as builder
    from megatron.core.datasets import gpt_dataset as gpt
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    class PadTokenizer(NullTokenizer):
        @property
        def pad(self):
            return 5  # a real token id of the corpus: exercises megatron-core's pad masking

    logging.disable(logging.WARNING)
    reset_position_ids, reset_attention_mask, eod_mask_loss, create_attention_mask = flags
    config = gpt.GPTDatasetConfig(
        random_seed=7, sequence_length=16, tokenizer=PadTokenizer(3) if pad else NullTokenizer(3),
        reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss, create_attention_mask=create_attention_mask,
        blend=([prefix], None), split="90,10,0", path_to_cache=None,
        **({"inter_document_masking": True} if inter_document_masking else {}),
    )  # fmt: skip
    train = builder.BlendedMegatronDatasetBuilder(gpt.GPTDataset, [None, None, None], lambda: True, config).build()[0]
    # megatron-core 0.16.1 caches the masks when no reset/eod option is set and then zeroes the
    # cached loss mask in place at pad labels, so with a real pad id every later sample inherits
    # earlier samples' zeros (in access order, per worker). We reproduce the per-sample meaning.
    train.masks_and_position_ids_are_cacheable = False
    return config, train


@pytest.mark.parametrize("pad", [False, True], ids=["no-pad", "pad5"])
@pytest.mark.parametrize(
    "flags",
    list(itertools.product([False, True], repeat=4)),
    ids=lambda f: "".join("PAEM"[i] if f[i] else "-" for i in range(4)),
)
@pytest.mark.oracle
def test_gpt_batch_equals_megatron_core(eod_corpus, flags, pad):
    config, theirs = _megatron_gpt(eod_corpus, flags, pad)
    ours = GPTBatchConfig.from_gpt_dataset_config(config)
    stream = open_stream({"data_path": eod_corpus, "seq_length": 16, "split": "90,10,0", "seed": 7})
    assert len(stream) == len(theirs) > 50
    got = gpt_batch(torch.from_numpy(stream.gather(numpy.arange(len(stream)))), ours)
    items = [theirs[i] for i in range(len(theirs))]
    assert set(got) == set(items[0])
    for key in items[0]:
        expected = torch.stack([item[key] for item in items])
        assert got[key].dtype == expected.dtype and got[key].shape == expected.shape, key
        assert torch.equal(got[key], expected), key


@pytest.mark.oracle
@pytest.mark.parametrize("pad", [False, True], ids=["no-pad", "pad5"])
@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_inter_document_masking_batch_equals_megatron_core(eod_corpus, eod_mask_loss, pad):
    """megatron-core 0.19's batch with inter_document_masking: tokens, labels, loss_mask, position_ids, cu_seqlens,
    max_seqlen, from the loader's batch fields (document_boundaries=True), through the Megatron builder too."""
    config, theirs = _megatron_gpt(eod_corpus, (False, False, eod_mask_loss, False), pad, inter_document_masking=True)
    ours = GPTBatchConfig.from_gpt_dataset_config(config)
    assert ours.inter_document_masking
    spec = {"data_path": eod_corpus, "seq_length": 16, "split": "90,10,0", "seed": 7}
    ds = get_train_dataset(spec, batch_size=len(theirs), document_boundaries=True)
    batch = next(iter(get_savable_loader(ds)))
    got = gpt_batch(batch["text"], ours, batch)
    items = [theirs[i] for i in range(len(theirs))]
    assert set(got) == set(items[0]) == {"tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "max_seqlen"}
    for key in items[0]:
        expected = torch.stack([item[key] for item in items])
        assert got[key].dtype == expected.dtype and got[key].shape == expected.shape, key
        assert torch.equal(got[key], expected), key
    with pytest.raises(StatefulsetError, match="document_boundaries=True"):
        gpt_batch(batch["text"], ours, {})
    data = build_megatron_iterators(spec, ParallelLayout(1), rank=0, micro_batch_size=4, batch_config=ours,
                                    num_workers=0, valid=False, test=False)  # fmt: skip
    got = data.get_batch()
    assert isinstance(got, GPTDocumentBatch) and got.attention_mask is None
    for key in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "max_seqlen"):
        expected = torch.stack([items[i][key] for i in range(4)])
        assert torch.equal(getattr(got, key), expected), key


@pytest.mark.oracle
def test_pad_token_follows_megatron_core(eod_corpus):
    """A pad id that collides with EOD falls back to -1, as in megatron-core's MegatronDataset."""
    from megatron.core.datasets import gpt_dataset as gpt
    from megatron.core.datasets.utils import Split
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    class EodPad(NullTokenizer):
        @property
        def pad(self):
            return self.eod

    for tokenizer, allow in ((EodPad(3), False), (EodPad(3), True), (NullTokenizer(3), False)):
        config = gpt.GPTDatasetConfig(
            random_seed=7, sequence_length=16, tokenizer=tokenizer, reset_position_ids=False,
            reset_attention_mask=False, eod_mask_loss=False, blend=([eod_corpus], None), split="1",
            allow_ambiguous_pad_tokens=allow,
        )  # fmt: skip
        theirs = gpt.GPTDataset.__new__(gpt.GPTDataset)
        with warnings.catch_warnings():  # megatron-core warns about the collision
            warnings.simplefilter("ignore")
            super(gpt.GPTDataset, theirs).__init__(None, None, numpy.arange(1), None, Split.train, config)
        assert GPTBatchConfig.from_gpt_dataset_config(config).pad_token == theirs._pad_token_id


def test_batch_config_checks_its_fields():
    with pytest.raises(StatefulsetError, match="reset_position_ids, eod_mask_loss needs eod_token"):
        GPTBatchConfig(reset_position_ids=True, eod_mask_loss=True)
    with pytest.raises(StatefulsetError, match="create_attention_mask must be True or False"):
        GPTBatchConfig(create_attention_mask=1)
    with pytest.raises(StatefulsetError, match="eod_token must be an int"):
        GPTBatchConfig(eod_token="2")
    with pytest.raises(StatefulsetError, match=r"\[batch, seq_length \+ 1\]"):
        gpt_batch(torch.zeros(5, dtype=torch.int64))

    class Args:
        reset_position_ids, reset_attention_mask, eod_mask_loss, create_attention_mask_in_dataloader = (
            True, False, True, True,
        )  # fmt: skip

    assert GPTBatchConfig.from_args(Args(), eod_token=7) == GPTBatchConfig(
        eod_token=7, reset_position_ids=True, eod_mask_loss=True, create_attention_mask=True
    )
    text = torch.tensor([[1, 2, 3, 4]])
    plain = gpt_batch(text)
    assert plain["tokens"].tolist() == [[1, 2, 3]] and plain["labels"].tolist() == [[2, 3, 4]]
    assert plain["loss_mask"].dtype == torch.float32 and "attention_mask" not in plain


# -- single process: PP=1, resume rules, eval cycling, state files ---------------------------------
def _reference(spec, base, dp_size, dp_rank, steps, fmt_config=CFG):
    """What DP rank ``dp_rank`` of ``dp_size`` gets for its micro-batches 0..steps-1, from ds[p]."""
    ds = get_train_dataset(spec, batch_size=B, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    out = []
    for t in range(steps):
        positions = [base + (t * dp_size + dp_rank) * B + j for j in range(B)]
        text = torch.from_numpy(numpy.stack([ds[p]["text"] for p in positions]))
        batch = gpt_batch(text, fmt_config)
        batch["sample_id"] = torch.tensor(positions)
        batch["text"] = text
        out.append(batch)
    return out


def test_single_process_pp1(spec, tmp_path):
    layout = ParallelLayout(1)
    data = build_megatron_iterators(spec, layout, 0, micro_batch_size=B, batch_config=CFG, num_workers=0)
    assert data.test is None  # the demo spec's test split is empty, as Megatron's do_test=False
    ref = _reference(spec, 0, 1, 0, 4)
    for t in range(4):
        got = data.get_batch()
        for key in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids", "sample_id"):
            assert torch.equal(getattr(got, key), ref[t][key]), key
    assert data.train.consumed_samples == 4 * B
    state = data.save_state()
    assert save_megatron_dataloader_state(data.train, tmp_path, 4, 0, pipeline_parallel=False) == str(
        tmp_path / "iter_0000004" / "mp_rank_00" / "train_dataloader_dprank000.pt"
    )
    saved = torch.load(tmp_path / "iter_0000004" / "mp_rank_00" / "train_dataloader_dprank000.pt")
    assert saved == {"dataloader_state_dict": state}

    # Resume: from the state, from consumed_train_samples, from both; as Megatron's "text" format.
    for kwargs in ({"state": saved}, {"consumed_train_samples": 4 * B}, {"state": state, "consumed_train_samples": 8}):
        again = build_megatron_iterators(spec, layout, 0, micro_batch_size=B, num_workers=0, format="text", **kwargs)
        nxt = next(again.train)
        assert set(nxt) == {"text", "sample_id"} and torch.equal(nxt["text"], _reference(spec, 8, 1, 0, 1)[0]["text"])
    with pytest.raises(StatefulsetError, match="consumed_train_samples is 10 but the loader state was saved after 8"):
        build_megatron_iterators(spec, layout, 0, micro_batch_size=B, state=state, consumed_train_samples=10)

    # A micro-batch size change resumes at the same global position.
    bigger = build_megatron_iterators(spec, layout, 0, micro_batch_size=4, state=state, num_workers=0, valid=False)
    assert next(bigger.train)["sample_id"].tolist() == [8, 9, 10, 11]

    # Validation cycles over its whole global batches and never resumes mid-stream.
    valid = data.valid
    passes = len(valid.loader)
    first = [next(valid)["sample_id"].tolist() for _ in range(passes)]
    assert first[0] == [0, 1] and first[-1] == [2 * passes - 2, 2 * passes - 1]
    assert next(valid)["sample_id"].tolist() == [0, 1]


def test_bad_inputs_name_the_field(spec, tmp_path):
    layout = ParallelLayout(1)
    build = build_megatron_iterators
    with pytest.raises(StatefulsetError, match="tensor_parallel must be 'broadcast' or 'read'"):
        build(spec, layout, 0, micro_batch_size=B, tensor_parallel="scatter")
    with pytest.raises(StatefulsetError, match="micro_batch_size must be an integer >= 1"):
        build(spec, layout, 0, micro_batch_size=0)
    with pytest.raises(StatefulsetError, match="consumed_train_samples must be a non-negative int"):
        build(spec, layout, 0, micro_batch_size=B, consumed_train_samples=-4)
    with pytest.raises(StatefulsetError, match="format must be 'gpt' or 'text'"):
        build(spec, layout, 0, micro_batch_size=B, format="bert")
    with pytest.raises(StatefulsetError, match="global_rank 3 is outside"):
        build(spec, layout, 3, micro_batch_size=B)
    with pytest.raises(StatefulsetError, match=rf"{re.escape(spec)}: the valid split has \d+ samples, fewer than one"):
        build(spec, layout, 0, micro_batch_size=10**6, num_workers=0)
    # A state taken on other data (another seed) is refused, naming the field.
    other = demo_spec(str(tmp_path), seq_length=SEQ, seed=99)
    theirs = build(other, layout, 0, micro_batch_size=B, num_workers=0, valid=False).train.save_state()
    with pytest.raises(StatefulsetError, match=r"rank 0 .*seed: state has 99, this loader 1234"):
        build(spec, layout, 0, micro_batch_size=B, state=theirs, valid=False)
    with pytest.raises(StatefulsetError, match="a loader state is a dict"):
        build(spec, layout, 0, micro_batch_size=B, state=[1, 2], valid=False)
    # State files: missing, damaged, not Megatron's.
    with pytest.raises(StatefulsetError, match="no dataloader state for DP rank 1 at iteration 5"):
        load_megatron_dataloader_state(tmp_path, 5, 1, pipeline_parallel=True)
    assert load_megatron_dataloader_state(tmp_path, 5, 1, pipeline_parallel=True, missing_ok=True) is None
    path = megatron_dataloader_state_path(tmp_path, 5, 1, pipeline_parallel=True, expert_rank=0)
    assert path.endswith("iter_0000005/mp_rank_00_000_000/train_dataloader_dprank001.pt")
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(b"not a torch file")
    with pytest.raises(StatefulsetError, match="cannot read the dataloader state"):
        load_megatron_dataloader_state(tmp_path, 5, 1, pipeline_parallel=True, expert_rank=0)
    torch.save({"model": 1}, path)
    with pytest.raises(StatefulsetError, match="no 'dataloader_state_dict'"):
        load_megatron_dataloader_state(tmp_path, 5, 1, pipeline_parallel=True, expert_rank=0)


# -- real ranks: TP2 x PP2 x DP2, both orders, both TP modes ----------------------------------------
def _snapshot(batch) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch._asdict().items() if v is not None}


def _ranks_3d(rank, world, init_file, spec, order, out):
    import torch.distributed as dist

    init_rank(rank, world, init_file)
    layout = ParallelLayout(world, tp=2, pp=2, order=order)
    info = layout.rank_info(rank)
    groups = create_parallel_groups(layout, ("dp", "tp", "pp"), backend="gloo")
    common = {"micro_batch_size": B, "batch_config": CFG, "num_workers": 0, "groups": groups, "test": False}
    result: dict = {}

    # 1. Fresh runs in both TP modes; save at CUT the way Megatron does (first stage, TP0, one file per DP rank).
    for mode in ("broadcast", "read"):
        data = build_megatron_iterators(spec, layout, rank, tensor_parallel=mode, valid=mode == "read", **common)
        result[f"{mode}/has_iterator"] = data.train is not None
        seen = []
        for step in range(STEPS):
            seen.append(_snapshot(data.get_batch()))
            if mode == "broadcast" and step == CUT - 1:
                data.flush()
                if info.saves_state:
                    save_megatron_dataloader_state(data.train, out, CUT, info.dp_rank, pipeline_parallel=True)
                result["consumed"] = data.train.consumed_samples if data.train is not None else None
        result[mode] = seen
        if mode == "read":
            result["valid"] = [_snapshot(data.get_batch("valid")) for _ in range(2)]
        data.flush()
    dist.barrier()
    consumed = CUT * layout.dp * B

    # 2. Resume from the saved files plus consumed_train_samples (broadcast mode).
    def state_for(dp_rank):
        if not info.loads_data:
            return None
        return load_megatron_dataloader_state(out, CUT, dp_rank, pipeline_parallel=True)

    data = build_megatron_iterators(
        spec, layout, rank, tensor_parallel="broadcast", valid=False,
        state=state_for(info.dp_rank), consumed_train_samples=consumed, **common,
    )  # fmt: skip
    result["resumed_state"] = [_snapshot(data.get_batch()) for _ in range(STEPS - CUT)]
    data.flush()

    # 3. Resume from consumed_train_samples alone, "read" mode, "text" format; the first micro-batch
    #    through next() as Megatron's own get_batch would, the rest through ours.
    data = build_megatron_iterators(
        spec, layout, rank, tensor_parallel="read", format="text", valid=False,
        consumed_train_samples=consumed, **common,
    )  # fmt: skip
    result["resumed_next"] = next(data.train) if data.train is not None else None
    result["resumed_consumed"] = [_snapshot(data.get_batch()) for _ in range(STEPS - CUT - 1)]
    data.flush()

    # 4. Inputs that do not fit raise StatefulsetError on every rank (never a hang): consumed vs state,
    #    and the file of the other DP rank.
    for name, state_rank, count in (("mismatch", info.dp_rank, consumed + 4), ("wrong_file", 1 - info.dp_rank, None)):
        try:
            build_megatron_iterators(
                spec, layout, rank, valid=False, state=state_for(state_rank), consumed_train_samples=count, **common
            )
            result[name] = None
        except StatefulsetError as error:
            result[name] = str(error)
    torch.save(result, f"{out}/{order}-{rank}.pt")
    dist.barrier()


def _ranks_dp1(rank, world, init_file, spec, out):
    """TP2 x PP2 x DP1 resuming what the DP2 run saved: from consumed_train_samples, and from DP rank 0's file."""
    import torch.distributed as dist

    init_rank(rank, world, init_file)
    layout = ParallelLayout(world, tp=2, pp=2)
    info = layout.rank_info(rank)
    groups = create_parallel_groups(layout, ("dp", "tp", "pp"), backend="gloo")
    common = {"micro_batch_size": B, "batch_config": CFG, "num_workers": 0, "groups": groups, "valid": False}
    result = {}
    data = build_megatron_iterators(spec, layout, rank, consumed_train_samples=CUT * 2 * B, **common)
    result["consumed"] = [_snapshot(data.get_batch()) for _ in range(3)]
    data.flush()
    state = load_megatron_dataloader_state(out, CUT, 0, pipeline_parallel=True) if info.loads_data else None
    data = build_megatron_iterators(spec, layout, rank, state=state, tensor_parallel="read", **common)
    result["state"] = [_snapshot(data.get_batch()) for _ in range(3)]
    data.flush()
    torch.save(result, f"{out}/dp1-{rank}.pt")
    dist.barrier()


def _check_stream(spec, layout, rank, batches, base, steps, first_step=0):
    info = layout.rank_info(rank)
    ref = _reference(spec, base, layout.dp, info.dp_rank, first_step + steps)[first_step:]
    keys = FIRST_KEYS if info.pp_rank == 0 else LAST_KEYS
    assert len(batches) == steps
    for t, (got, want) in enumerate(zip(batches, ref, strict=True)):
        assert set(got) == set(keys), (rank, t, sorted(got))
        for key in keys:
            assert torch.equal(got[key], want[key]), (rank, t, key)


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-pp-dp"])
def test_3d_ranks_match_the_stream_layout(spec, tmp_path, order):
    spawn(_ranks_3d, 8, tmp_path, spec, order, str(tmp_path))
    layout = ParallelLayout(8, tp=2, pp=2, order=order)
    results = {rank: torch.load(tmp_path / f"{order}-{rank}.pt") for rank in range(8)}
    for rank, res in results.items():
        info = layout.rank_info(rank)
        # Iterators where Megatron's get_batch_on_this_tp_rank calls next(): TP0 of first and last stage.
        assert res["broadcast/has_iterator"] == (info.tp_rank == 0)
        assert res["read/has_iterator"] is True
        for mode in ("broadcast", "read"):
            _check_stream(spec, layout, rank, res[mode], 0, STEPS)
        _check_stream(spec, layout, rank, res["resumed_state"], 0, STEPS - CUT, first_step=CUT)
        _check_stream(spec, layout, rank, res["resumed_consumed"], 0, STEPS - CUT - 1, first_step=CUT + 1)
        want = _reference(spec, 0, layout.dp, info.dp_rank, CUT + 1)[CUT]
        assert set(res["resumed_next"]) == {"text", "sample_id"}
        assert torch.equal(res["resumed_next"]["text"], want["text"])
        if info.saves_state:
            assert res["consumed"] == CUT * layout.dp * B
        # Validation: every rank of a pipeline sees the valid split from its start, in the same layout.
        valid_ids = [b["sample_id"].tolist() for b in res["valid"]]
        assert valid_ids == [[(t * 2 + info.dp_rank) * B + j for j in range(B)] for t in range(2)]
        assert "consumed_train_samples is 16 but the loader state was saved after 12" in res["mismatch"]
        assert "saved by DP rank" in res["wrong_file"] and "train_dataloader_dprank" in res["wrong_file"]
        # The last stage's labels are its first stage's tokens shifted by one.
        if info.is_last_stage:
            first = results[info.first_stage_rank]
            for mine, theirs in zip(res["broadcast"], first["broadcast"], strict=True):
                assert torch.equal(mine["sample_id"], theirs["sample_id"])
                assert torch.equal(mine["labels"][:, :-1], theirs["tokens"][:, 1:])


def test_resume_into_another_dp_size(spec, tmp_path):
    # The DP2 run's files: written by the 8-rank test's layout, recreated here in one process.
    for dp_rank in range(2):
        wc = WorkerConfig(rank=dp_rank, world_size=2, num_workers=0)
        loader = get_savable_loader(get_train_dataset(spec, batch_size=B, worker_config=wc))
        for _ in range(CUT):
            next(loader)
        path = megatron_dataloader_state_path(tmp_path, CUT, dp_rank, pipeline_parallel=True)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"dataloader_state_dict": loader.save_state_rank()}, path)
    spawn(_ranks_dp1, 4, tmp_path, spec, str(tmp_path))
    layout = ParallelLayout(4, tp=2, pp=2)
    for rank in range(4):
        res = torch.load(tmp_path / f"dp1-{rank}.pt")
        for key in ("consumed", "state"):
            _check_stream(spec, layout, rank, res[key], CUT * 2 * B, 3)


# -- real ranks: TP2 x PP3, packing bestfit, inter_document_masking ------------------------------------
DOC_CFG = GPTBatchConfig(inter_document_masking=True)


def _ranks_documents(rank, world, init_file, spec, out):
    init_rank(rank, world, init_file)
    layout = ParallelLayout(world, tp=2, pp=3)
    groups = create_parallel_groups(layout, ("dp", "tp", "pp"), backend="gloo")
    result = {}
    for mode in ("broadcast", "read"):
        data = build_megatron_iterators(spec, layout, rank, micro_batch_size=B, batch_config=DOC_CFG, num_workers=0,
                                        groups=groups, tensor_parallel=mode, valid=False, test=False)  # fmt: skip
        result[mode] = [_snapshot(data.get_batch()) for _ in range(4)]
        data.flush()
    torch.save(result, f"{out}/documents-{rank}.pt")
    import torch.distributed as dist

    dist.barrier()


def test_inter_document_masking_reaches_every_pipeline_stage(tmp_path):
    """First stage: tokens and boundaries; middle stage: the boundaries alone (as Megatron-LM broadcasts them);
    last stage: labels, loss_mask (bestfit's padding masked) and boundaries. Both TP modes."""
    prefix = str(tmp_path / "docs")
    rng = numpy.random.default_rng(4)
    with IndexedDatasetWriter(prefix, numpy.uint16) as writer:
        for _ in range(200):
            writer.add_document(rng.integers(0, 1000, int(rng.integers(SEQ // 2, SEQ))))  # bins cannot fill up
    spec = {"data_path": prefix, "seq_length": SEQ, "split": "1", "packing": "bestfit"}
    spawn(_ranks_documents, 6, tmp_path, spec, str(tmp_path))
    layout = ParallelLayout(6, tp=2, pp=3)
    ds = get_train_dataset(spec, batch_size=B, document_boundaries=True)
    loader = get_savable_loader(ds)
    batches = [b for _, b in zip(range(4), loader, strict=False)]
    expected = [{**gpt_batch(b["text"], DOC_CFG, b), "sample_id": b["sample_id"]} for b in batches]
    stage_keys = {
        0: {"tokens", "position_ids", "cu_seqlens", "max_seqlen", "sample_id"},
        1: {"cu_seqlens", "max_seqlen", "sample_id"},
        2: {"labels", "loss_mask", "cu_seqlens", "max_seqlen", "sample_id"},
    }
    padded = 0
    for rank in range(6):
        got = torch.load(tmp_path / f"documents-{rank}.pt")
        keys = stage_keys[layout.rank_info(rank).pp_rank]
        for mode in ("broadcast", "read"):
            for mine, want in zip(got[mode], expected, strict=True):
                assert set(mine) == keys, (rank, mode, sorted(mine))
                for key in keys:
                    assert torch.equal(mine[key], want[key]), (rank, mode, key)
                if "loss_mask" in mine:
                    padded += int((mine["loss_mask"] == 0).sum())
    assert padded > 0  # bestfit's padding reached the last stage's loss_mask


# -- real ranks: PP2 over a source with a loss-mask shard ---------------------------------------------
def _ranks_masks(rank, world, init_file, spec, out):
    import torch.distributed as dist

    init_rank(rank, world, init_file)
    layout = ParallelLayout(world, tp=1, pp=2)
    groups = create_parallel_groups(layout, ("dp", "tp", "pp"), backend="gloo")
    data = build_megatron_iterators(spec, layout, rank, micro_batch_size=B, batch_config=CFG, num_workers=0,
                                    groups=groups, valid=False, test=False)  # fmt: skip
    torch.save([_snapshot(data.get_batch()) for _ in range(3)], f"{out}/masks-{rank}.pt")
    data.flush()
    dist.barrier()


def test_loss_masks_reach_the_last_pipeline_stage(tmp_path):
    """The first stage reads the mask shard; the last stage's loss_mask is gpt_batch's times ours (before,
    the link carried loss_mask only for packing bestfit, so the prompts' labels kept loss 1 there)."""
    prefix = str(tmp_path / "sft")
    rng = numpy.random.default_rng(6)
    with (
        IndexedDatasetWriter(prefix, numpy.uint16) as tokens,
        IndexedDatasetWriter(prefix + "_loss_mask", numpy.uint8) as mask,
    ):
        for _ in range(120):
            prompt, answer = int(rng.integers(1, SEQ)), int(rng.integers(1, SEQ))
            tokens.add_document(rng.integers(0, 1000, prompt + answer))
            mask.add_document(numpy.r_[numpy.zeros(prompt, numpy.uint8), numpy.ones(answer, numpy.uint8)])
    spec = {"data_path": prefix, "seq_length": SEQ, "split": "1", "packing": "native"}
    spawn(_ranks_masks, 2, tmp_path, spec, str(tmp_path))
    loader = get_savable_loader(get_train_dataset(spec, batch_size=B))
    expected = [gpt_batch(b["text"], CFG, b) for _, b in zip(range(3), loader, strict=False)]
    got = torch.load(tmp_path / "masks-1.pt")  # rank 1: the last stage
    for mine, want in zip(got, expected, strict=True):
        assert torch.equal(mine["loss_mask"], want["loss_mask"]) and torch.equal(mine["labels"], want["labels"])
    assert sum(int((m["loss_mask"] == 0).sum()) for m in got) > 0
