"""The encoder's fast path for *kept* samples (CONTRACT §15 unchanged): an ``encode_sample`` that returns
the very TokenSample it was given, holding the very arrays it was made with (an identity, or changes
written in place), is staged for the ring as the micro-batch's rows without a per-sample check or
copy (``TaskEncoderRunner.encode_rows``, ``encoded_ring.staged(kept=True)``). Pinned against the slow
path: the per-sample ``_sample`` and the per-sample staging, and through real workers against
``ds[p]`` (one sample, its own gather in int64), for kept and not-kept encoders, in and out of the
corpus's dtype."""

from __future__ import annotations

import numpy
import pytest
import torch
from corpora import geometric_spec
from encoders import AnotherSample, Identity, ReAdds

from statefulset import (
    StatefulsetError,
    WorkerConfig,
    get_savable_loader,
    get_train_dataset,
)
from statefulset.loading.encoded_ring import staged, staged_kept, staged_names, write_slot
from statefulset.loading.ring import BatchRing
from statefulset.streams.documents import FieldSpec
from statefulset.transforms.encoder import TaskEncoderRunner

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class ShiftsInPlace:
    """Changes the sample's own rows in place (kept), by an amount given by the position alone."""

    def __init__(self, shift=0):
        self.shift = shift

    def encode_sample(self, sample):
        sample.text += self.shift + sample.sample_id % 7
        if sample.position_ids is not None:
            sample.position_ids[::2] = sample.position_ids[::-2]
        return sample


class ShiftsInPlaceWithRng(ShiftsInPlace):
    """Kept too, called through the keyed generator's path."""

    def encode_sample(self, sample, rng):
        sample.text[: 1 + int(rng.integers(0, 4))] += 1
        return sample


class NewArrays:
    def encode_sample(self, sample):
        sample.text = sample.text + 1
        return sample


class EqualCopy:
    """Replaces a row with an equal copy: not kept (the values are checked and copied as before)."""

    def encode_sample(self, sample):
        sample.text = sample.text.copy()
        return sample


class AddsField:
    def encode_sample(self, sample):
        sample.flag = numpy.int64(1)
        return sample


KEPT = {Identity: True, ShiftsInPlace: True, ShiftsInPlaceWithRng: True, NewArrays: False, EqualCopy: False,
        AnotherSample: False, AddsField: False, ReAdds: False}  # fmt: skip


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return geometric_spec(tmp_path_factory.mktemp("kept"), seed=7, documents=300, mean=30, seq_length=16)


def _rows(count: int, seed: int) -> dict[str, numpy.ndarray]:
    rng = numpy.random.default_rng(seed)
    return {
        "text": rng.integers(0, 65000, (count, 9)).astype(numpy.int64),
        "position_ids": numpy.tile(numpy.arange(8, dtype=numpy.int64), (count, 1)),
    }


def _fields(sample) -> dict:
    return {k: (v.tolist() if isinstance(v, numpy.ndarray) else v) for k, v in sample.fields().items()}


@pytest.mark.parametrize("encoder", list(KEPT), ids=lambda e: e.__name__)
def test_encode_rows_gives_the_per_sample_path_samples_and_says_when_they_are_kept(encoder):
    ids, sources = numpy.arange(40, 52, dtype=numpy.int64), [f"src{i % 3}" for i in range(12)]
    for calls in (0, 20):  # the first calls of a process are checked for global RNG use; later ones are not
        fast, slow = TaskEncoderRunner(encoder(), seed=3), TaskEncoderRunner(encoder(), seed=3)
        fast._checks_left = slow._checks_left = max(0, 8 - calls)
        rows, again = _rows(12, 1), _rows(12, 1)
        views = {name: list(values) for name, values in rows.items()}
        samples, kept = fast.encode_rows(views, ids, sources)
        expected = [slow._sample(again, i, int(p), sources[i]) for i, p in enumerate(ids.tolist())]
        assert kept is KEPT[encoder]
        assert [_fields(s) for s in samples] == [_fields(s) for s in expected]
        assert all(type(s.sample_id) is int for s in samples)
        if kept:  # the samples' rows are the micro-batch's own
            assert all(s.text.base is rows["text"] for s in samples)
            assert numpy.array_equal(rows["text"], again["text"])


@pytest.mark.parametrize("shift", [0, 65000, -70000])
@pytest.mark.parametrize("encoder", [Identity, ShiftsInPlace])
def test_staging_kept_samples_equals_checking_each_sample(encoder, shift):
    fields = [
        FieldSpec("text", (9,), numpy.dtype(numpy.uint16)),
        FieldSpec("position_ids", (8,), numpy.dtype(numpy.int64)),
    ]
    ids = numpy.arange(12, dtype=numpy.int64)
    runner = TaskEncoderRunner(encoder(shift) if encoder is ShiftsInPlace else encoder(), seed=0)
    rows = _rows(12, 2)
    views = {name: list(values) for name, values in rows.items()}
    samples, kept = runner.encode_rows(views, ids, ["s"] * 12)
    assert kept
    limits = numpy.iinfo(numpy.uint16)
    names = staged_names(fields)
    fast = staged(samples, fields, names, ids, rows, views, kept=True)
    slow = staged(samples, fields, names, ids)  # each sample's values checked and copied
    assert fast is not None and slow is not None
    assert list(fast.arrays) == list(slow.arrays) == ["text", "position_ids"]
    for name in slow.arrays:
        assert numpy.array_equal(fast.arrays[name], slow.arrays[name])
        assert fast.arrays[name].dtype == slow.arrays[name].dtype
    assert fast.arrays["text"] is rows["text"]  # no copy
    # Into a slot: the same values both ways, or both refused when a token leaves the corpus's dtype
    # (the bundle is then collated and packed instead).
    fits = rows["text"].min() >= 0 and rows["text"].max() <= limits.max
    for batch in (fast, slow):
        view = {f.name: numpy.zeros((2, 12, *f.shape), dtype=f.dtype) for f in fields}
        assert write_slot(view, 1, batch, limits) is bool(fits)
        if fits:
            assert numpy.array_equal(view["text"][1], rows["text"])
            assert numpy.array_equal(view["position_ids"][1], rows["position_ids"])


def test_each_ring_stages_by_its_own_field_order():
    """Whether a ring's batches can be staged is the ring's own (``BatchRing.staged_names``, computed
    once, no state shared between rings): rings of fields in and out of a TokenSample's order, used
    in turn, each stage by their own."""
    in_order = [
        FieldSpec("text", (9,), numpy.dtype(numpy.int64)),
        FieldSpec("position_ids", (8,), numpy.dtype(numpy.int64)),
    ]
    rings = [BatchRing(1, 1, 12, fields) for fields in (in_order, in_order[::-1], list(in_order))]
    assert [ring.staged_names for ring in rings] == [("text", "position_ids"), None, ("text", "position_ids")]
    ids = numpy.arange(12, dtype=numpy.int64)
    rows = _rows(12, 3)
    views = {name: list(values) for name, values in rows.items()}
    samples, kept = TaskEncoderRunner(Identity(), seed=0).encode_rows(views, ids, ["s"] * 12)
    assert kept
    for ring in [*rings, *rings[::-1]]:
        for found in (
            staged(samples, ring.fields, ring.staged_names, ids),
            staged_kept(rows, None, ring.fields, ring.staged_names, ids),
        ):
            if ring.staged_names is None:
                assert found is None  # collated and packed instead
            else:
                assert list(found.arrays) == ["text", "position_ids"]
                assert all(numpy.array_equal(found.arrays[name], rows[name]) for name in found.arrays)


CASES = {
    "identity": Identity,
    "in_place": ShiftsInPlace,
    "in_place_out_of_dtype": lambda: ShiftsInPlace(70_000),
    "in_place_rng": ShiftsInPlaceWithRng,
    "new_arrays": NewArrays,
    "equal_copy": EqualCopy,
    "another_sample": AnotherSample,
    "adds_field": AddsField,
    "re_adds": ReAdds,
}


@pytest.mark.parametrize("boundaries", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_workers_deliver_what_the_dataset_encodes_for_each_position(spec, case, boundaries):
    encoder = CASES[case]
    wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
    ds = get_train_dataset(spec, batch_size=3, task_encoder=encoder(), document_boundaries=boundaries)
    ld = get_savable_loader(get_train_dataset(spec, batch_size=3, worker_config=wc, task_encoder=encoder(),
                                              document_boundaries=boundaries))  # fmt: skip
    for t, batch in zip(range(30), ld, strict=False):  # several bundles per worker, past the checked calls
        assert batch["sample_id"].tolist() == [3 * t, 3 * t + 1, 3 * t + 2]
        assert batch["text"].dtype == torch.int64
        for i, p in enumerate(batch["sample_id"].tolist()):
            row = ds[p]
            assert batch["text"][i].tolist() == row.text.tolist(), f"sample {p}"
            if boundaries:
                assert batch["position_ids"][i].tolist() == row.position_ids.tolist()
                assert batch["cu_seqlens"][i].tolist() == row.cu_seqlens.tolist()
            if hasattr(row, "flag"):
                assert batch["flag"][i].item() == 1


@pytest.mark.parametrize("encoder", [Identity, ShiftsInPlace, NewArrays])
def test_bestfit_loss_masks_travel_with_kept_rows(spec, encoder):
    bestfit = {**spec, "packing": "bestfit"}
    wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
    ds = get_train_dataset(bestfit, batch_size=3, task_encoder=encoder())
    ld = get_savable_loader(get_train_dataset(bestfit, batch_size=3, worker_config=wc, task_encoder=encoder()))
    for _, batch in zip(range(20), ld, strict=False):
        assert batch["loss_mask"].dtype == torch.float32
        for i, p in enumerate(batch["sample_id"].tolist()):
            row = ds[p]
            assert batch["text"][i].tolist() == row.text.tolist(), f"sample {p}"
            assert batch["loss_mask"][i].tolist() == row.loss_mask.tolist()


def test_an_encoder_failing_after_the_checked_calls_names_the_sample(spec):
    class FailsLate:
        def encode_sample(self, sample):
            if sample.sample_id == 41:
                raise ValueError("late")
            return sample

    ld = get_savable_loader(get_train_dataset(spec, batch_size=2, task_encoder=FailsLate()))
    with pytest.raises(StatefulsetError, match=r"FailsLate: encode_sample failed on sample 41: ValueError: late"):
        for _ in zip(range(30), ld, strict=False):
            pass
