"""A worker's bundle through the task encoder in one call (``statefulset.loading.encoded_bundle``): the
same slot contents, batches and errors as the per-micro-batch path (``BatchSource.encoded``), which
stays for encoders with ``batch``/``encode_batch`` or a micro-batch path of their own (FIM).

Pinned on a real BatchSource and ring in this process (each bundle encoded both ways, then written
into a slot as the worker would), and through 2 real workers for the micro-batch an error names."""

from __future__ import annotations

import numpy
import pytest
from corpora import geometric_spec

from statefulset import StatefulsetError, WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.loading.batches import BatchSource
from statefulset.loading.encoded_bundle import Gathered, encode_bundle, whole_bundles
from statefulset.loading.encoded_ring import Staged, write_slot
from statefulset.loading.ring import make_ring
from statefulset.transforms import FillInTheMiddle
from statefulset.transforms.encoder import TaskEncoderRunner

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class Identity:
    def encode_sample(self, sample):
        return sample


class ShiftsInPlace:
    """Not kept: reading ``text`` gives the sample an int64 copy of its row (the ring holds the corpus
    dtype), changed here and written back into the slot by the hand-off."""

    def encode_sample(self, sample):
        sample.text += 1 + sample.sample_id % 5
        return sample


class KeepsSome:
    """Kept for even samples, a new text array for odd ones: the bundle is not kept."""

    def encode_sample(self, sample):
        if sample.sample_id % 2:
            sample.text = sample.text[::-1] + 3
        return sample


class AddsField:
    def encode_sample(self, sample):
        sample.flag = numpy.int64(sample.sample_id)
        return sample


class Batches:
    def encode_sample(self, sample):
        return sample

    def batch(self, samples):
        return {"ids": [s.sample_id for s in samples]}


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return geometric_spec(tmp_path_factory.mktemp("bundle"), seed=11, documents=300, mean=25, seq_length=16)


def test_whole_bundles_only_for_collating_encoders_without_a_micro_batch_path():
    assert whole_bundles(TaskEncoderRunner(Identity(), seed=0))
    assert whole_bundles(TaskEncoderRunner(AddsField(), seed=0))
    assert not whole_bundles(TaskEncoderRunner(Batches(), seed=0))
    assert not whole_bundles(TaskEncoderRunner(FillInTheMiddle(0.5, 0.5, 1, 2, 3, 4), seed=0))


def _source(spec, encoder, boundaries=False):
    ds = get_train_dataset(spec, batch_size=3, task_encoder=encoder(), document_boundaries=boundaries)
    ring = make_ring(1, 3, 3, ds.fields(wire=False), ds.encoder)
    return BatchSource(ds.stream, ds.layout(), None, None, ring, boundaries, ds.encoder), ring


def _slot_after(source, ring, slot, first, count, whole, replace=False):
    """Micro-batches ``first..first+count-1`` gathered into ``slot`` and encoded in one call (``whole``) or
    one micro-batch at a time, then written into the slot as the worker's hand-off does: the slot's
    arrays (copies), or None when a batch does not fit the ring's layout, with the batches."""
    view = ring.view(0, slot)
    if whole:
        pending = [(t, source.gathered(t, None, (view, i))) for i, t in enumerate(range(first, first + count))]
        if replace:  # as if the gather had put a field of its own in the batch's dict
            t, g = pending[1]
            pending[1] = (t, Gathered({**g.fields, "text": g.fields["text"].copy()}, *g[1:]))
        batches = encode_bundle(source, ring, view, pending)
        if batches is None:
            return {name: array[:count].copy() for name, array in view.items()}, None
    else:
        batches = [(t, source.encoded(t, None, ring, (view, i))) for i, t in enumerate(range(first, first + count))]
    if not all(type(b) is Staged for _, b in batches):
        return None, batches
    assert all(write_slot(view, i, b, ring.limits) for i, (_, b) in enumerate(batches))
    return {name: array[:count].copy() for name, array in view.items()}, batches


@pytest.mark.parametrize("boundaries", [False, True])
@pytest.mark.parametrize("encoder", [Identity, ShiftsInPlace, KeepsSome, AddsField])
def test_a_bundle_encoded_in_one_call_fills_the_slot_as_each_micro_batch_does(spec, encoder, boundaries):
    whole_source, ring = _source(spec, encoder, boundaries)
    each_source, each_ring = _source(spec, encoder, boundaries)
    for first in range(0, 30, 5):  # past the first calls (checked for global RNG use) into the compiled loop
        count = min(ring.bundle, 5)
        got, got_batches = _slot_after(whole_source, ring, first % 3, first, count, whole=True)
        expected, expected_batches = _slot_after(each_source, each_ring, first % 3, first, count, whole=False)
        if expected is None:  # out of the ring's layout (an added field): the same collated batches
            assert got is None
            assert [t for t, _ in got_batches] == [t for t, _ in expected_batches]
            for (_, a), (_, b) in zip(got_batches, expected_batches, strict=True):
                assert {k: v.tolist() for k, v in a.items()} == {k: v.tolist() for k, v in b.items()}
            continue
        assert list(got) == list(expected)
        for name in expected:
            assert numpy.array_equal(got[name], expected[name]), name
        # Every sample kept (text never read): the slot holds the bundle as gathered, nothing staged.
        assert (got_batches is None) is (encoder is Identity)


def test_a_field_the_gather_replaced_is_encoded_per_micro_batch(spec):
    whole_source, ring = _source(spec, Identity)
    each_source, each_ring = _source(spec, Identity)
    got, batches = _slot_after(whole_source, ring, 0, 0, 3, whole=True, replace=True)
    expected, _ = _slot_after(each_source, each_ring, 0, 0, 3, whole=False)
    assert batches is not None  # not left in the slot as gathered: micro-batch 1's text came from elsewhere
    for name in expected:
        assert numpy.array_equal(got[name], expected[name]), name


@pytest.mark.parametrize("raises", ["ValueError", "StatefulsetError", "None"])
def test_a_sample_failing_late_in_a_bundle_names_its_micro_batch(spec, raises):
    class FailsAt:
        def encode_sample(self, sample):
            if sample.sample_id == 3 * 9 + 1:  # micro-batch 9: the tenth of worker 0's first bundle (16 batches)
                if raises == "None":
                    return None
                raise (ValueError if raises == "ValueError" else StatefulsetError)("no good")
            return sample

    wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
    ld = get_savable_loader(get_train_dataset(spec, batch_size=3, worker_config=wc, task_encoder=FailsAt()))
    with pytest.raises(StatefulsetError, match=r"DataLoader worker \d, building micro-batch 9: StatefulsetError: "):
        for _ in zip(range(40), ld, strict=False):
            pass
