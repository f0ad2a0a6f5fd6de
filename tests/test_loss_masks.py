"""``loss_mask`` from loss-mask shards (CONTRACT §16): every packing, blends, stages, boundaries, restores.

The shards' tokens say where they come from (``sequence * STRIDE + offset``) and each sequence is a
random segment list, so the mask every label must carry is known from the label token itself: the
``loss`` of the segment it came from, 1 for a source without a mask shard, 0 on bestfit padding.
Real shards on disk, real loader worker processes; the end-to-end test goes through
``statefulset preprocess``.
"""

from __future__ import annotations

import json

import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statefulset import IndexedDatasetWriter, StatefulsetError, WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.tools.preprocess import preprocess

STRIDE = 100_000
CODE_BASE = 10**9  # the unmasked source's tokens: told apart from the masked one's
SEQ = 32
PACKINGS = ["megatron", "native", "bestfit"]
IN_PROCESS = WorkerConfig(rank=0, world_size=1, num_workers=0)
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def random_segments(rng: numpy.random.Generator, count: int) -> list[list[tuple[int, bool]]]:
    """Per document: its segments as (tokens, loss); some documents empty, some longer than a sample."""
    docs = []
    for _ in range(count):
        n = int(rng.integers(0, 5))
        docs.append([(int(rng.geometric(1 / (12 if rng.random() < 0.9 else 60))) - 1, bool(rng.random() < 0.5))
                     for _ in range(n)])  # fmt: skip
    return docs


def write_masked(prefix: str, docs: list[list[tuple[int, bool]]]) -> dict[int, numpy.ndarray]:
    """A token shard and its mask shard; returns each sequence's mask (by sequence number)."""
    masks = {}
    with IndexedDatasetWriter(prefix, numpy.int32) as w, IndexedDatasetWriter(prefix + "_loss_mask", numpy.uint8) as m:
        seq = 0
        for segs in docs:
            mask = numpy.concatenate(
                [numpy.full(n, int(loss), numpy.uint8) for n, loss in segs] or [numpy.zeros(0, numpy.uint8)]
            )
            if mask.size == 0:
                continue
            w.add_document(seq * STRIDE + numpy.arange(mask.size, dtype=numpy.int32))
            m.add_document(mask)
            masks[seq] = mask
            seq += 1
    return masks


def write_plain(prefix: str, lengths: list[int]) -> None:
    with IndexedDatasetWriter(prefix, numpy.int32) as w:
        for i, n in enumerate(lengths):
            w.add_document((CODE_BASE + i * STRIDE + numpy.arange(n)).astype(numpy.int32))


def expected_mask(text: numpy.ndarray, masks: dict[int, numpy.ndarray], pad_id: int = -1) -> numpy.ndarray:
    """For each label ``text[1:]``: its segment's loss; 1 for the unmasked source; 0 for padding."""
    out = numpy.empty(text.size - 1, numpy.float32)
    for i, token in enumerate(text[1:].tolist()):
        if token == pad_id:
            out[i] = 0
        elif token >= CODE_BASE:
            out[i] = 1
        else:
            seq, offset = divmod(token, STRIDE)
            out[i] = masks[seq][offset]
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("masks")
    masks = write_masked(str(root / "chat"), random_segments(numpy.random.default_rng(1), 400))
    rng = numpy.random.default_rng(2)
    write_plain(str(root / "web"), [int(rng.geometric(1 / 20)) for _ in range(300)])
    return root, masks


def spec_for(root, packing, data_path, **extra):
    if packing == "megatron":
        extra = {"num_samples": 300, **extra}  # a weighted megatron blend is sized by it
    return {"data_path": data_path, "seq_length": SEQ, "split": "1", "packing": packing, "seed": 3,
            "path_to_cache": str(root / "cache"), **extra}  # fmt: skip


def check_rows(ds, positions, masks, boundaries=False):
    for p in positions:
        sample = ds[p]
        assert sample["loss_mask"].dtype == numpy.float32 and sample["loss_mask"].shape == (SEQ,)
        numpy.testing.assert_array_equal(sample["loss_mask"], expected_mask(sample["text"], masks), err_msg=str(p))
        if boundaries:
            assert set(sample) >= {"cu_seqlens", "max_seqlen", "position_ids"}


@pytest.mark.parametrize("packing", PACKINGS)
def test_each_label_has_its_segments_loss_in_a_blend_of_masked_and_unmasked(shards, packing):
    root, masks = shards
    data = {str(root / "chat"): 0.6, str(root / "web"): 0.4}
    for boundaries in (False, True):
        ds = get_train_dataset(spec_for(root, packing, data), batch_size=4, document_boundaries=boundaries)
        check_rows(ds, range(60), masks, boundaries)
    alone = get_train_dataset(spec_for(root, packing, str(root / "web")), batch_size=4)
    assert ("loss_mask" in alone[0]) == (packing == "bestfit")  # no mask shard: no field, as before


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), packing=st.sampled_from(PACKINGS), first=st.integers(0, 10_000))
def test_random_segment_lists_every_packing(tmp_path_factory, seed, packing, first):
    root = tmp_path_factory.mktemp("random")
    masks = write_masked(str(root / "chat"), random_segments(numpy.random.default_rng(seed), 60))
    ds = get_train_dataset(spec_for(root, packing, str(root / "chat")), batch_size=2)
    length = len(ds.stream) if packing == "megatron" else first + 8
    check_rows(ds, range(min(first, max(length - 8, 0)), min(first + 8, length)), masks)


@pytest.mark.parametrize("packing", ["native", "bestfit"])
def test_stages_anneal_onto_a_masked_source(shards, packing):
    root, masks = shards
    spec = {"seq_length": SEQ, "split": "1", "packing": packing, "seed": 3, "path_to_cache": str(root / "cache"),
            "stages": [{"start": 0, "data_path": {str(root / "web"): 1.0}},
                       {"start": 20, "data_path": {str(root / "web"): 0.5, str(root / "chat"): 0.5}}]}  # fmt: skip
    ds = get_train_dataset(spec, batch_size=4, document_boundaries=True)
    check_rows(ds, range(0, 50), masks, boundaries=True)


@pytest.mark.parametrize("packing", PACKINGS)
def test_batches_from_workers_and_restores_are_exact(shards, packing):
    root, masks = shards
    spec = spec_for(root, packing, {str(root / "chat"): 0.7, str(root / "web"): 0.3})

    def loader(workers):
        wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
        return get_savable_loader(get_train_dataset(spec, batch_size=3, worker_config=wc, document_boundaries=True))

    first = loader(0)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.save_state_rank()
    want = [next(it) for _ in range(4)]
    again = loader(2)
    again.restore_state_rank(state)
    got = [b for _, b in zip(range(4), again, strict=False)]
    for a, b in zip(want, got, strict=True):
        assert set(a) == set(b) and "loss_mask" in a
        for name in a:
            numpy.testing.assert_array_equal(numpy.asarray(a[name]), numpy.asarray(b[name]), err_msg=name)
        for row in range(a["text"].shape[0]):
            numpy.testing.assert_array_equal(a["loss_mask"][row].numpy(), expected_mask(a["text"][row].numpy(), masks))


def test_a_state_is_refused_when_a_mask_shard_appears_or_changes(tmp_path):
    masks = write_masked(str(tmp_path / "chat"), random_segments(numpy.random.default_rng(4), 80))
    spec = spec_for(tmp_path, "native", str(tmp_path / "chat"))
    loader = get_savable_loader(get_train_dataset(spec, batch_size=2, worker_config=IN_PROCESS))
    next(iter(loader))  # a state past the start: its source is part of what it read
    state = loader.save_state_rank()
    flipped = {s: 1 - m for s, m in masks.items()}
    with IndexedDatasetWriter(tmp_path / "chat_loss_mask", numpy.uint8) as m:
        for s in sorted(flipped):
            m.add_document(flipped[s])
    with pytest.raises(StatefulsetError, match="chat"):
        get_savable_loader(get_train_dataset(spec, batch_size=2, worker_config=IN_PROCESS)).restore_state_rank(state)
    for ext in (".bin", ".idx"):
        (tmp_path / f"chat_loss_mask{ext}").unlink()
    with pytest.raises(StatefulsetError, match="chat"):
        get_savable_loader(get_train_dataset(spec, batch_size=2, worker_config=IN_PROCESS)).restore_state_rank(state)


def test_a_mask_shard_of_other_lengths_is_refused_at_open(tmp_path):
    write_plain(str(tmp_path / "web"), [5, 6, 7])
    with IndexedDatasetWriter(tmp_path / "web_loss_mask", numpy.uint8) as m:
        for n in (5, 6, 8):
            m.add_document(numpy.ones(n, numpy.uint8))
    with pytest.raises(StatefulsetError, match=r"web_loss_mask\.idx does not match its token shard .*web\.idx"):
        get_train_dataset(spec_for(tmp_path, "native", str(tmp_path / "web")), batch_size=2)


def test_preprocessed_segments_reach_the_loader(tmp_path):
    records = [{"text": [{"text": "Question? ", "loss": False}, {"text": "Answer."}]} for _ in range(50)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    preprocess([str(tmp_path / "in.jsonl")], str(tmp_path / "sft"), append_eod=True, show_progress=False)
    ds = get_train_dataset(spec_for(tmp_path, "bestfit", str(tmp_path / "sft_text_document")), batch_size=2)
    sample = ds[0]
    text, mask = sample["text"], sample["loss_mask"]
    # one document per sample: "Question? " (10 bytes, loss 0), "Answer." (7 bytes, loss 1), EOD (loss 1), padding
    document = [0] * 10 + [1] * 8
    assert text[len(document) - 1] == 256 and (text[len(document) :] == -1).all()
    assert mask.tolist() == document[1:] + [0] * (SEQ + 1 - len(document))


class KeepsMask:
    """A task encoder that reads the sample's loss_mask (and keeps it)."""

    def encode_sample(self, sample):
        sample.prompt_tokens = int((sample.loss_mask == 0).sum())
        return sample


def test_integrations_take_the_mask(shards):
    import torch

    from statefulset.integrations.megatron.batch import GPTBatchConfig, gpt_batch
    from statefulset.transforms.sample import TokenSample

    root, _ = shards
    spec = spec_for(root, "native", {str(root / "chat"): 0.5, str(root / "web"): 0.5})
    batch = next(iter(get_savable_loader(get_train_dataset(spec, batch_size=4, worker_config=IN_PROCESS))))
    eod = int(batch["text"][0, 5])  # any token id present in the inputs stands in for the EOD
    out = gpt_batch(batch["text"], GPTBatchConfig(eod_token=eod, eod_mask_loss=True), batch)
    want = batch["loss_mask"] * (batch["text"][:, :-1] != eod).to(torch.float32)
    assert torch.equal(out["loss_mask"], want) and float(want.sum()) < want.numel()
    encoded = get_train_dataset(spec, batch_size=2, task_encoder=KeepsMask())
    plain = get_train_dataset(spec, batch_size=2)
    for p in range(6):
        sample = encoded[p]
        mask = sample["loss_mask"] if isinstance(sample, dict) else sample.loss_mask
        numpy.testing.assert_array_equal(mask, plain[p]["loss_mask"])
    assert "loss_mask" in TokenSample.__dataclass_fields__


@pytest.mark.parametrize("packing", PACKINGS)
def test_explain_shows_the_spans_with_loss(shards, packing):
    root, masks = shards
    ds = get_train_dataset(spec_for(root, packing, {str(root / "chat"): 0.5, str(root / "web"): 0.5}), batch_size=2)
    seen = set()
    for p in range(30):
        found = ds.explain(p)
        masked_source = found.source == str(root / "chat")
        seen.add(masked_source)
        for piece in found.pieces:
            if not masked_source:
                assert piece.loss_spans is None
                continue
            mask = masks[piece.sequence]
            want = numpy.zeros(mask.size, numpy.uint8)
            for a, b in piece.loss_spans:
                assert piece.offset <= a < b <= piece.offset + piece.tokens
                want[a:b] = 1
            run = slice(piece.offset, piece.offset + piece.tokens)
            numpy.testing.assert_array_equal(want[run], mask[run])
        if masked_source and found.pieces:
            assert "loss on tokens" in found.text()
    assert seen == {True, False}


def test_segments_preprocessed_to_s3_give_the_local_masks(tmp_path, monkeypatch):
    """Both shards uploaded by --workers 2 to an S3 API server (moto), found there by the loader."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from s3_servers import moto_server, upload

    rng = numpy.random.default_rng(9)
    records = [{"text": [{"text": "q" * int(rng.integers(0, 30)), "loss": False},
                         {"text": "a" * int(rng.integers(1, 30))}]}
               for _ in range(120)] + [{"text": "plain web text"}] * 20  # fmt: skip
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    preprocess([str(tmp_path / "in.jsonl")], str(tmp_path / "local"), append_eod=True, show_progress=False)
    with moto_server() as server:
        upload(server, "masks", {"empty": str(tmp_path / "in.jsonl")})
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        result = preprocess([str(tmp_path / "in.jsonl")], "s3://masks/tok/sft", append_eod=True, workers=2,
                            chunk_bytes=900, show_progress=False)  # fmt: skip
        assert result.loss_masks == {"text": "s3://masks/tok/sft_text_document_loss_mask"}
        for packing in PACKINGS:
            local = get_train_dataset(spec_for(tmp_path, packing, str(tmp_path / "local_text_document")), batch_size=2)
            remote_spec = spec_for(tmp_path, packing, "s3://masks/tok/sft_text_document",
                                   storage_options=server.options())  # fmt: skip
            remote = get_train_dataset(remote_spec, batch_size=2)
            for p in range(12):
                a, b = local[p], remote[p]
                numpy.testing.assert_array_equal(a["text"], b["text"])
                numpy.testing.assert_array_equal(a["loss_mask"], b["loss_mask"])
            assert 0 < float(b["loss_mask"].mean()) <= 1
