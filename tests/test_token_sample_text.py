"""``TokenSample.text`` widened where it is read (statefulset.transforms.sample): a worker's samples hold
their ring row in the corpus dtype until the encoder reads ``text``, which then gives, and keeps, an int64
copy. To the encoder ``text`` is always int64 (CONTRACT §15); a sample whose text is never read is sent as
it was gathered. Pinned on TokenSamples made by hand, then through 2 real workers against 0 workers and
against no encoder."""

from __future__ import annotations

import dataclasses

import numpy
import pytest
import torch
from corpora import geometric_spec

from statefulset import StatefulsetError, TokenSample, WorkerConfig, get_savable_loader, get_train_dataset

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def test_a_narrow_row_is_widened_on_the_first_read_and_the_copy_kept():
    rows = numpy.arange(24, dtype=numpy.uint16).reshape(2, 12)
    sample = TokenSample(rows[1], sample_id=5, source="a")
    assert vars(sample)["text"] is not None and vars(sample)["text"].dtype == numpy.uint16  # not read yet
    text = sample.text
    assert type(text) is numpy.ndarray and text.dtype == numpy.int64 and text.tolist() == rows[1].tolist()
    assert sample.text is text and vars(sample)["text"] is text  # kept: later reads and changes see one array
    text += 1
    assert rows[1].tolist() == list(range(12, 24))  # the row itself is never written through the copy
    assert sample.fields()["text"] is text
    assert dataclasses.replace(sample, sample_id=6).text.tolist() == text.tolist()
    assert "text=array([13" in repr(sample)


@pytest.mark.parametrize("dtype", [numpy.uint8, numpy.int8, numpy.int16, numpy.uint16, numpy.int32, numpy.uint32])
def test_every_narrower_integer_dtype_widens_exactly(dtype):
    info = numpy.iinfo(dtype)
    row = numpy.array([info.min, 0, info.max], dtype=dtype)
    assert TokenSample(row, 0, "a").text.tolist() == [int(info.min), 0, int(info.max)]


@pytest.mark.parametrize(
    "value",
    [
        numpy.arange(3, dtype=numpy.int64),
        numpy.arange(3, dtype=numpy.uint64),  # not held exactly by int64: left as it is
        numpy.arange(3, dtype=numpy.float32),
        torch.arange(3),
        [1, 2, 3],
    ],
)
def test_what_is_not_a_narrower_integer_array_is_returned_as_assigned(value):
    sample = TokenSample(numpy.zeros(3, dtype=numpy.uint16), 0, "a")
    sample.text = value
    assert sample.text is value


def test_text_can_be_deleted_as_a_dataclass_attribute_can():
    sample = TokenSample(numpy.zeros(3, dtype=numpy.uint16), 0, "a")
    del sample.text
    assert not hasattr(sample, "text")
    with pytest.raises(AttributeError):
        del sample.text
    sample.text = numpy.ones(3, dtype=numpy.int16)
    assert sample.text.dtype == numpy.int64


class Identity:
    def encode_sample(self, sample):
        return sample


class ReadsText:
    """Reads ``text`` (int64, or it refuses) and leaves it as it is."""

    def encode_sample(self, sample):
        text = sample.text
        if type(text) is not numpy.ndarray or text.dtype != numpy.int64:
            raise StatefulsetError(f"text arrived as {type(text).__name__} {getattr(text, 'dtype', None)}")
        int(text.sum())  # every token read
        return sample


class AddsOne:
    def encode_sample(self, sample):
        sample.text += 1
        return sample


class OneBeyondTheDtype:
    """One sample's text beyond uint16, the others never read: a bundle that leaves the ring's layout
    (statefulset.loading.encoded) with micro-batches whose rows are still the ring's own."""

    def encode_sample(self, sample):
        if sample.sample_id == 7:
            sample.text = sample.text + 70_000
        return sample


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return geometric_spec(tmp_path_factory.mktemp("lazy"), seed=5, documents=300, mean=20, seq_length=12)


def _batches(spec, encoder, workers, count=60):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    ds = get_train_dataset(spec, batch_size=3, worker_config=wc, task_encoder=encoder)
    return list(zip(range(count), get_savable_loader(ds), strict=False))


@pytest.mark.parametrize("encoder", [Identity, ReadsText, AddsOne, OneBeyondTheDtype])
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_are_the_unencoded_ones_as_the_encoder_changed_them(spec, encoder, workers):
    # 60 micro-batches of 3 rows through 2 workers: every slot of each worker's ring refilled several times.
    plain = _batches(spec, None, 0)
    got = _batches(spec, encoder(), workers)
    assert len(got) == len(plain) == 60
    for (_, a), (_, b) in zip(got, plain, strict=True):
        expected = b["text"] + 1 if encoder is AddsOne else b["text"].clone()
        if encoder is OneBeyondTheDtype:
            expected[b["sample_id"] == 7] += 70_000
        assert a["text"].dtype == torch.int64
        assert torch.equal(a["text"], expected)
        assert torch.equal(a["sample_id"], b["sample_id"])


class DeletesText:
    """Deletes ``text`` (a dataclass attribute can be deleted) in the first micro-batch's second sample."""

    def encode_sample(self, sample):
        if sample.sample_id == 1:
            del sample.text
        return sample


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_without_text_is_refused_naming_the_field_the_sample_and_its_micro_batch(spec, workers):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    ds = get_train_dataset(spec, batch_size=3, worker_config=wc, task_encoder=DeletesText())
    where = r"DataLoader worker 0, building micro-batch 0: StatefulsetError: " if workers else ""
    with pytest.raises(StatefulsetError, match=where + r".*DeletesText.*sample 1 has no 'text'"):
        next(iter(get_savable_loader(ds)))
