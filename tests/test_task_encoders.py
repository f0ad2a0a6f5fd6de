"""Task encoders (CONTRACT §15): keyed randomness, exact resume at any layout, refusals, identity, batch().

Real DataLoader worker processes throughout; the DP ranks of the property test are loaders of
one process each (a state list restores without a collective), and one test runs real gloo ranks.
"""

from __future__ import annotations

import logging
import random

import numpy
import pytest
import torch
from encoders import Nested
from hypothesis import given, settings
from hypothesis import strategies as st
from ranks import init_rank, spawn

from statefulset import (
    IndexedDatasetWriter,
    StatefulsetError,
    TokenSample,
    WorkerConfig,
    get_savable_loader,
    get_train_dataset,
    get_val_dataset,
    stateless,
)
from statefulset.transforms.encoder import reset_warnings

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class GlobalDraws:
    """Draws from all three global RNGs, keyed by the decorator."""

    version = 1

    @stateless(restore_seeds=True)
    def encode_sample(self, sample: TokenSample) -> TokenSample:
        sample.text = sample.text ^ int(torch.randint(0, 1 << 16, ()).item())
        sample.noise = numpy.array([random.random(), numpy.random.rand(), torch.rand(()).item()])
        return sample


class GlobalDrawsV2(GlobalDraws):
    version = 2


class TakesRng:
    """Draws from the keyed generator it is given."""

    def encode_sample(self, sample, rng):
        sample.text = sample.text + rng.integers(0, 100, size=sample.text.shape)
        sample.label = int(rng.integers(0, 1000))
        return sample


class Undecorated:
    def encode_sample(self, sample):
        sample.noise = numpy.random.rand()
        return sample


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    rng = numpy.random.default_rng(5)
    for name, docs in (("a", 200), ("b", 120)):
        with IndexedDatasetWriter(root / name) as w:
            for _ in range(docs):
                w.add_document(rng.integers(0, 60000, int(rng.geometric(1 / 40))))
    blend = {str(root / "a"): 0.6, str(root / "b"): 0.4}
    return {"data_path": blend, "seq_length": 16, "packing": "native", "path_to_cache": str(root / "c")}


def loader(spec, encoder, batch_size=2, workers=0, rank=0, world=1, **kw):
    wc = WorkerConfig(rank=rank, world_size=world, num_workers=workers)
    return get_savable_loader(
        get_train_dataset(spec, batch_size=batch_size, worker_config=wc, task_encoder=encoder), **kw
    )


def rows(batch):
    """sample_id -> (text row, the encoder's field) of a collated batch."""
    extra = "noise" if "noise" in batch else "label"
    ids = batch["sample_id"].tolist()
    return {p: (batch["text"][i].tolist(), batch[extra][i].tolist()) for i, p in enumerate(ids)}


_REFERENCE: dict = {}


def reference(spec, encoder_type, n):
    """The single-process, uninterrupted encoded stream: sample_id -> row."""
    key = (encoder_type, n)
    if key not in _REFERENCE:
        out = {}
        for _, batch in zip(range(n), loader(spec, encoder_type(), batch_size=1), strict=False):
            out.update(rows(batch))
        _REFERENCE[key] = out
    return _REFERENCE[key]


def take(loaders, steps):
    seen = {}
    for ld in loaders:
        for _, batch in zip(range(steps), ld, strict=False):
            seen.update(rows(batch))
    return seen


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    encoder=st.sampled_from([GlobalDraws, TakesRng]),
    first=st.tuples(st.integers(1, 3), st.integers(0, 2), st.integers(1, 3)),
    then=st.tuples(st.integers(1, 3), st.integers(0, 2), st.integers(1, 3)),
    resume_step=st.integers(0, 3),
)
def test_encoded_stream_is_the_same_at_any_layout_and_resume(spec, encoder, first, then, resume_step):
    """(DP size, workers, micro-batch size) before and after a save at a random step: the encoded rows
    of every sample equal the single-process uninterrupted stream's, nothing lost or repeated."""
    (w1, k1, b1), (w2, k2, b2) = first, then
    before = [loader(spec, encoder(), b1, k1, r, w1) for r in range(w1)]
    seen = take(before, resume_step)
    states = [ld.save_state_rank() for ld in before]
    after = [loader(spec, encoder(), b2, k2, r, w2) for r in range(w2)]
    for ld in after:
        ld.restore_state_global(states)
    seen_after = take(after, 2)
    consumed = resume_step * w1 * b1
    assert sorted(seen) == list(range(consumed))
    assert sorted(seen_after) == list(range(consumed, consumed + 2 * w2 * b2))
    expected = reference(spec, encoder, consumed + 2 * w2 * b2)
    for p, row in {**seen, **seen_after}.items():
        assert row == expected[p], f"sample {p}"


def test_dataset_item_is_the_loaders_row_and_explain_names_the_encoder(spec):
    ds = get_train_dataset(spec, batch_size=2, task_encoder=GlobalDraws())
    expected = reference(spec, GlobalDraws, 6)
    for p in range(6):
        sample = ds[p]
        assert (sample.text.tolist(), sample.noise.tolist()) == expected[p]
        assert sample.source in spec["data_path"] and sample.source == ds.explain(p).source
    said = ds.explain(3)
    assert said.task_encoder.startswith("test_task_encoders.GlobalDraws@1")
    assert "encoded by task encoder test_task_encoders.GlobalDraws@1" in said.text()


def test_global_rng_state_outside_the_calls_is_left_as_it_was(spec):
    random.seed(1), numpy.random.seed(2), torch.manual_seed(3)
    before = (random.getstate(), numpy.random.get_state()[1].copy(), torch.get_rng_state().clone())
    for _, _batch in zip(range(3), loader(spec, GlobalDraws(), workers=0), strict=False):
        pass
    # A direct call keys its draws too (by seed 0 outside a loader), and restores the states as well.
    GlobalDraws().encode_sample(TokenSample(text=numpy.zeros(17, dtype=numpy.int64), sample_id=5, source="x"))
    assert random.getstate() == before[0]
    assert numpy.array_equal(numpy.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])


def test_an_undecorated_encoder_that_draws_from_global_rngs_is_warned_about_once(spec, caplog):
    reset_warnings()
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        for _, _batch in zip(range(4), loader(spec, Undecorated()), strict=False):
            pass
    said = [r.getMessage() for r in caplog.records if "without @stateless(restore_seeds=True)" in r.getMessage()]
    assert len(said) == 1 and "Undecorated" in said[0] and "numpy.random" in said[0]
    caplog.clear()
    reset_warnings()
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        for _, _batch in zip(range(4), loader(spec, TakesRng()), strict=False):
            pass
    assert not [r for r in caplog.records if "without @stateless" in r.getMessage()]


def _hooked(name, body=None):
    def method(self, *args):
        return body(*args) if body else args[0]

    return type(f"Defines_{name}", (), {"encode_sample": lambda self, s: s, name: method})


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("select_samples_to_pack", "packing: bestfit"),
        ("pack_selected_samples", "packing: bestfit"),
        ("cook_crude_sample", "cookers"),
        ("preencode_sample", "encode_sample"),
        ("postencode_sample", "encode_sample"),
        ("batch_group_criterion", "layout"),
    ],
)
def test_hooks_that_cannot_be_exact_are_refused_naming_them(spec, name, said):
    with pytest.raises(StatefulsetError, match=rf"defines {name}.*{said}"):
        get_train_dataset(spec, batch_size=2, task_encoder=_hooked(name)())
    with pytest.raises(StatefulsetError, match=rf"defines {name}"):
        get_val_dataset(spec, batch_size=2, task_encoder=_hooked(name)())


def test_generator_encoders_cookers_and_objects_without_encode_sample_are_refused(spec):
    class Yields:
        @stateless(restore_seeds=True)
        def encode_sample(self, sample):
            yield sample
            yield sample

    class Cooks:
        cookers = ("a cooker",)

        def encode_sample(self, sample):
            return sample

    with pytest.raises(StatefulsetError, match="encode_sample is a generator"):
        get_train_dataset(spec, batch_size=2, task_encoder=Yields())
    with pytest.raises(StatefulsetError, match="registers cookers"):
        get_train_dataset(spec, batch_size=2, task_encoder=Cooks())
    with pytest.raises(StatefulsetError, match="has no encode_sample"):
        get_train_dataset(spec, batch_size=2, task_encoder=object())


def test_restoring_with_another_encoder_is_refused_naming_both_unless_allowed(spec, caplog):
    first = loader(spec, GlobalDraws())
    taken = [b for _, b in zip(range(3), first, strict=False)]
    state = first.save_state_rank()
    assert state["identity"]["task_encoder"] == "test_task_encoders.GlobalDraws@1"
    with pytest.raises(StatefulsetError, match=r"GlobalDraws@1.*GlobalDrawsV2@2"):
        loader(spec, GlobalDrawsV2()).restore_state_rank(state)
    with pytest.raises(StatefulsetError, match=r"GlobalDraws@1, this loader runs no task"):
        get_savable_loader(get_train_dataset(spec, batch_size=2)).restore_state_global([state])
    plain = get_savable_loader(get_train_dataset(spec, batch_size=2))
    for _ in zip(range(2), plain, strict=False):
        pass
    with pytest.raises(StatefulsetError, match="saved with no task encoder, this loader runs task encoder"):
        loader(spec, GlobalDraws()).restore_state_rank(plain.save_state_rank())
    allowed = loader(spec, GlobalDrawsV2(), allow_changed_task_encoder=True)
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        allowed.restore_state_rank(state)
    assert any("allow_changed_task_encoder=True" in r.getMessage() for r in caplog.records)
    assert next(iter(allowed))["sample_id"].tolist() == [6, 7]
    assert [b["sample_id"].tolist() for b in taken] == [[0, 1], [2, 3], [4, 5]]
    same = loader(spec, GlobalDraws())
    same.restore_state_rank(state)
    assert next(iter(same))["sample_id"].tolist() == [6, 7]


def test_batch_returning_nested_structures_travels_from_workers_unchanged(spec):
    def run(workers):
        return [b for _, b in zip(range(5), loader(spec, Nested(), batch_size=3, workers=workers), strict=False)]

    local, remote = run(0), run(2)
    for a, b in zip(local, remote, strict=True):
        assert isinstance(b["tokens"], numpy.ndarray) and b["tokens"].dtype == numpy.int32
        numpy.testing.assert_array_equal(a["tokens"], b["tokens"])
        assert isinstance(b["ids"], torch.Tensor) and torch.equal(a["ids"], b["ids"])
        assert b["meta"] == {"count": 3, "name": "nested", "half": numpy.float16(0.5)} and b["encoded"] is True
        for (ia, sa, ma), (ib, sb, mb) in zip(a["parts"], b["parts"], strict=True):
            assert isinstance(mb, numpy.ndarray) and mb.dtype == bool
            assert (ia, sa) == (ib, sb) and numpy.array_equal(ma, mb)
    assert [b["ids"].tolist() for b in remote] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14]]


def test_collated_fields_keep_the_dataset_layout(spec):
    boundaries = get_train_dataset(spec, batch_size=3, task_encoder=TakesRng(), document_boundaries=True,
                                   worker_config=WorkerConfig(rank=0, world_size=1, num_workers=1))  # fmt: skip
    batch = next(iter(get_savable_loader(boundaries)))
    assert batch["text"].dtype == torch.int64 and batch["text"].shape == (3, 17)
    assert batch["sample_id"].dtype == torch.int64 and batch["sample_id"].tolist() == [0, 1, 2]
    assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"].shape == (3, 17)
    assert batch["max_seqlen"].dtype == torch.int32 and batch["max_seqlen"].shape == (3,)
    assert batch["position_ids"].shape == (3, 16) and batch["label"].dtype == torch.int64
    assert "source" not in batch


def _energon_encoder():
    energon = pytest.importorskip("megatron.energon")

    class EnergonEncoder(energon.DefaultTaskEncoder):
        version = 3

        @energon.stateless(restore_seeds=True)
        def encode_sample(self, sample):
            sample.text = sample.text + random.randrange(5) + int(numpy.random.randint(5))
            return sample

    return EnergonEncoder


def test_an_energon_default_task_encoder_subclass_runs_unchanged(spec):
    encoder_type = _energon_encoder()

    def run(workers, world=1, rank=0, batch_size=2, steps=3):
        ld = loader(spec, encoder_type(), batch_size, workers, rank, world)
        return {p: row for _, b in zip(range(steps), ld, strict=False) for p, row in _text_rows(b).items()}

    one = run(0, steps=8)
    assert run(2, steps=4) == {p: one[p] for p in range(8)}
    assert {**run(1, 2, 0), **run(1, 2, 1)} == {p: one[p] for p in range(12)}  # DP 2, 3 steps each
    assert one[0] != get_train_dataset(spec, batch_size=1)[0]["text"].tolist()  # it did encode
    ds = get_train_dataset(spec, batch_size=2, task_encoder=encoder_type())
    assert ds[5].text.tolist() == one[5]


def test_energon_base_class_hooks_count_only_when_overridden(spec):
    energon = pytest.importorskip("megatron.energon")

    class Packs(energon.DefaultTaskEncoder):
        def select_samples_to_pack(self, samples):
            return [samples]

    with pytest.raises(StatefulsetError, match=r"defines select_samples_to_pack.*packing: bestfit"):
        get_train_dataset(spec, batch_size=2, task_encoder=Packs())
    plain = get_train_dataset(spec, batch_size=2, task_encoder=energon.DefaultTaskEncoder())
    batch = next(iter(get_savable_loader(plain)))
    assert batch["sample_id"].tolist() == [0, 1] and batch["text"].shape == (2, 17)


def _text_rows(batch):
    return {p: batch["text"][i].tolist() for i, p in enumerate(batch["sample_id"].tolist())}


def _gloo_rank(rank, world, init_file, spec, out):
    init_rank(rank, world, init_file)
    first = loader(spec, GlobalDraws(), 2, 1, rank, world)
    seen = [_text_rows(b) for _, b in zip(range(2), first, strict=False)]
    states = first.save_state_global(0)
    again = loader(spec, GlobalDraws(), 2, 1, rank, world)
    again.restore_state_global(states if rank == 0 else None, src_rank=0)
    seen.append(_text_rows(next(iter(again))))
    other = loader(spec, GlobalDrawsV2(), 2, 0, rank, world)
    try:
        other.restore_state_global(states if rank == 0 else None, src_rank=0)
        refused = ""
    except StatefulsetError as exc:
        refused = str(exc)
    torch.save({"seen": seen, "refused": refused}, f"{out}/rank{rank}.pt")


def test_gloo_ranks_restore_the_encoded_stream_and_refuse_another_encoder(spec, tmp_path):
    spawn(_gloo_rank, 2, tmp_path, spec, str(tmp_path))
    expected = reference(spec, GlobalDraws, 12)
    seen = {}
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert "GlobalDraws@1" in got["refused"] and "GlobalDrawsV2@2" in got["refused"]
        for part in got["seen"]:
            seen.update(part)
    assert sorted(seen) == list(range(12))
    assert all(seen[p] == expected[p][0] for p in seen)


def test_builders_pass_the_encoder_through_or_refuse_a_batch_of_its_own(spec):
    from statefulset import ParallelLayout, StatefulsetDataModule, build_megatron_iterators, build_nanotron_dataloader

    layout = ParallelLayout(world_size=1)
    with pytest.raises(StatefulsetError, match="build_megatron_iterators: task encoder Nested defines batch"):
        build_megatron_iterators(spec, layout, 0, micro_batch_size=2, task_encoder=Nested())
    with pytest.raises(StatefulsetError, match="build_nanotron_dataloader: task encoder Nested defines batch"):
        build_nanotron_dataloader(spec, layout, 0, micro_batch_size=2, task_encoder=Nested())
    dm = StatefulsetDataModule(spec, micro_batch_size=2, num_workers=1, task_encoder=GlobalDraws())
    train = dm.train_dataloader()
    got = [rows(b) for _, b in zip(range(3), train, strict=False)]
    expected = reference(spec, GlobalDraws, 6)
    assert {p: r for part in got for p, r in part.items()} == {p: expected[p] for p in range(6)}
    assert dm.train_loader.save_state_rank()["identity"]["task_encoder"].endswith("GlobalDraws@1")


def test_stages_validation_and_fill_in_the_middle_keep_working_with_an_encoder(spec):
    from statefulset import get_loader
    from statefulset.transforms import FillInTheMiddle

    a, b = list(spec["data_path"])
    staged = {"seq_length": 16, "split": "1", "packing": "native", "path_to_cache": spec["path_to_cache"],
              "stages": [{"start": 0, "data_path": {a: 1.0}}, {"start": 10, "data_path": {b: 1.0}}]}  # fmt: skip
    ds = get_train_dataset(staged, batch_size=4, task_encoder=TakesRng())
    assert [ds[p].source for p in (0, 9, 10, 30)] == [a, a, b, b]
    first = loader(staged, TakesRng(), 4, 1)
    _ = [next(iter(first)) for _ in range(2)]  # positions 0..7
    later = loader(staged, TakesRng(), 3, 2, 1, 2)  # DP rank 1 of 2, micro-batch 3, two workers
    later.restore_state_global([first.save_state_rank()])
    batch = next(iter(later))
    assert batch["sample_id"].tolist() == [11, 12, 13]
    for i, p in enumerate(batch["sample_id"].tolist()):
        assert batch["text"][i].tolist() == ds[p].text.tolist() and batch["label"][i].item() == ds[p].label
    val = get_val_dataset(spec, batch_size=2, task_encoder=TakesRng(),
                          worker_config=WorkerConfig(rank=0, world_size=1, num_workers=1))  # fmt: skip
    for got in zip(range(3), get_loader(val), strict=False):
        for i, p in enumerate(got[1]["sample_id"].tolist()):
            assert got[1]["text"][i].tolist() == val[p].text.tolist()
    fim = FillInTheMiddle(rate=1.0, spm_rate=0.5, prefix_id=60001, middle_id=60002, suffix_id=60003, pad_id=60004)
    ds = get_train_dataset(spec, batch_size=2, task_encoder=fim)
    for _, got in zip(range(3), loader(spec, fim, 2, 2), strict=False):
        for i, p in enumerate(got["sample_id"].tolist()):
            assert got["text"][i].tolist() == ds[p].text.tolist()
            assert {60001, 60002, 60003} & set(got["text"][i].tolist())  # rate 1: every sample is FIM'd


def test_an_encoder_that_fails_names_itself_the_sample_and_the_worker(spec):
    class Fails:
        def encode_sample(self, sample):
            if sample.sample_id == 3:
                raise ValueError("no good")
            return sample

    said = r"DataLoader worker \d, building micro-batch 1: .*Fails: encode_sample failed on sample 3: ValueError: no"
    with pytest.raises(StatefulsetError, match=said):
        for _ in zip(range(4), loader(spec, Fails(), 2, 2), strict=False):
            pass


def test_megatron_and_nanotron_batches_are_made_of_the_encoded_samples(spec):
    from statefulset import ParallelLayout, build_megatron_iterators, build_nanotron_dataloader

    ds = get_train_dataset(spec, batch_size=4, task_encoder=TakesRng())
    data = build_megatron_iterators(spec, ParallelLayout(1), rank=0, micro_batch_size=4, num_workers=1,
                                    consumed_train_samples=8, valid=False, test=False,
                                    task_encoder=TakesRng())  # fmt: skip
    for t in range(2):
        batch = data.get_batch()
        assert batch.tokens.tolist() == [ds[p].text[:-1].tolist() for p in range(8 + 4 * t, 12 + 4 * t)]
        assert batch.labels.tolist() == [ds[p].text[1:].tolist() for p in range(8 + 4 * t, 12 + 4 * t)]
    loader = build_nanotron_dataloader(spec, ParallelLayout(1), micro_batch_size=4, consumed_train_samples=4,
                                       task_encoder=TakesRng())  # fmt: skip
    assert next(loader)["input_ids"].tolist() == [ds[p].text[:-1].tolist() for p in range(4, 8)]


def test_megatron_builder_refuses_a_state_of_another_encoder_also_in_another_layout(spec):
    from statefulset import ParallelLayout, build_megatron_iterators

    saved = loader(spec, GlobalDraws(), batch_size=4)
    next(iter(saved))
    state = saved.save_state_rank()
    kw = {"rank": 0, "num_workers": 0, "valid": False, "test": False, "state": state}
    for micro_batch_size in (4, 2):  # the same layout (restore_state_rank), another (its position only)
        with pytest.raises(StatefulsetError, match=r"GlobalDraws@1, this loader runs task encoder .*GlobalDrawsV2@2"):
            build_megatron_iterators(spec, ParallelLayout(1), micro_batch_size=micro_batch_size,
                                     task_encoder=GlobalDrawsV2(), **kw)  # fmt: skip
    data = build_megatron_iterators(spec, ParallelLayout(1), micro_batch_size=2, task_encoder=GlobalDraws(), **kw)
    assert data.get_batch().tokens.tolist() == [r[0][:-1] for r in map(reference(spec, GlobalDraws, 6).get, (4, 5))]


class ShiftsTokens:
    """Keeps the dataset's layout (the ring carries it) unless the shift leaves the corpus's dtype."""

    def __init__(self, shift):
        self.shift = shift

    def encode_sample(self, sample, rng):
        sample.text = sample.text + self.shift + rng.integers(0, 3)
        return sample


class ShiftsTokensInPlace(ShiftsTokens):
    """The same shift written into the sample's own row (the ring stages such rows without a copy)."""

    def encode_sample(self, sample, rng):
        sample.text += self.shift + rng.integers(0, 3)
        sample.position_ids[::2] = sample.position_ids[::-2]  # another field changed in place too
        return sample


@pytest.mark.parametrize("shift", [0, 70_000, -70_000, 2**40])
@pytest.mark.parametrize("encoder", [ShiftsTokens, ShiftsTokensInPlace])
def test_encoded_batches_in_and_out_of_the_rings_layout_are_exact(spec, shift, encoder):
    ds = get_train_dataset(spec, batch_size=3, task_encoder=encoder(shift), document_boundaries=True)
    wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
    ld = get_savable_loader(get_train_dataset(spec, batch_size=3, worker_config=wc, document_boundaries=True,
                                              task_encoder=encoder(shift)))  # fmt: skip
    for t, batch in zip(range(20), ld, strict=False):
        assert list(batch) == ["text", "cu_seqlens", "max_seqlen", "position_ids", "sample_id"]
        assert batch["text"].dtype == torch.int64 and batch["sample_id"].tolist() == [3 * t, 3 * t + 1, 3 * t + 2]
        for i, p in enumerate(batch["sample_id"].tolist()):
            assert batch["text"][i].tolist() == ds[p].text.tolist()
            assert batch["position_ids"][i].tolist() == ds[p].position_ids.tolist()
