"""A task encoder's rows gathered straight into the batch ring's slot (``ring.make_ring``,
``BatchSource.encoded``): the ring carries ``text`` in the corpus dtype (int64 for an encoder whose
micro-batch path changes rows in place), the encoder's samples hold views of the slot's rows (``text``
widened to int64 where it is read: statefulset.transforms.sample), and a field it kept or changed in
place is not copied again. Whatever the encoder does with those views (changes them in place beyond
the corpus's dtype, replaces them with other views of the same row, replaces one field and changes
another in place, hands them to its own ``batch``), every batch equals what one process
encodes for the same positions."""

from __future__ import annotations

import numpy
import pytest
import torch
from corpora import geometric_spec

from statefulset import WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.loading.ring import bundle_size, make_ring
from statefulset.streams.documents import FieldSpec
from statefulset.transforms.encoder import TaskEncoderRunner

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class BeyondTheDtype:
    """Every token changed in place to a value no uint16 holds."""

    def encode_sample(self, sample):
        sample.text += 70_000 + sample.sample_id
        return sample


class ReversedOwnRow:
    """``text`` replaced by a reversed view of its own row (the copy into the slot overlaps its source)."""

    def encode_sample(self, sample):
        sample.text = sample.text[::-1]
        return sample


class ChangesOneReplacesAnother:
    """``text`` changed in place, ``loss_mask`` replaced by a new array, ``position_ids`` changed in place."""

    def encode_sample(self, sample):
        sample.text[::3] = -sample.sample_id
        if sample.loss_mask is not None:
            sample.loss_mask = 1.0 - sample.loss_mask
        if sample.position_ids is not None:
            sample.position_ids[:] = sample.position_ids[::-1].copy()
        return sample


class BatchesTheViews:
    """Its own ``batch`` returns the samples' arrays uncopied: views of the slot, until the bundle is sent."""

    def encode_sample(self, sample):
        sample.text[0] = sample.sample_id
        return sample

    def batch(self, samples):
        return {"rows": [s.text for s in samples], "ids": [s.sample_id for s in samples]}


class ReplacesTheRowsArray:
    """Its micro-batch path (``encode_rows_in_place``, as FillInTheMiddle's) puts a new ``text`` array in the
    rows' dict instead of writing into the slot's: the new array must still reach the slot."""

    def encode_sample(self, sample, rng):
        sample.text = sample.text[::-1] + 1
        return sample

    def encode_rows_in_place(self, rows, sample_ids, key):
        rows["text"] = rows["text"][:, ::-1] + 1
        return True


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return geometric_spec(tmp_path_factory.mktemp("slot"), seed=3, documents=400, mean=20, seq_length=12)


def _as_lists(value):
    if isinstance(value, torch.Tensor | numpy.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _as_lists(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_lists(v) for v in value]
    return value


def _batches(spec, encoder, workers, count, **kwargs):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    ds = get_train_dataset(spec, batch_size=2, worker_config=wc, task_encoder=encoder(), **kwargs)
    return [_as_lists(b) for _, b in zip(range(count), get_savable_loader(ds), strict=False)]


@pytest.mark.parametrize("packing", ["native", "bestfit"])
@pytest.mark.parametrize("boundaries", [False, True])
@pytest.mark.parametrize(
    "encoder", [BeyondTheDtype, ReversedOwnRow, ChangesOneReplacesAnother, BatchesTheViews, ReplacesTheRowsArray]
)
def test_workers_deliver_what_one_process_encodes(spec, encoder, boundaries, packing):
    # 120 micro-batches of 2 rows: each worker refills every slot of its ring several times over
    # (bundles of 16, prefetch_factor + 1 slots).
    spec = {**spec, "packing": packing}
    expected = _batches(spec, encoder, 0, 120, document_boundaries=boundaries)
    assert len(expected) == 120
    assert _batches(spec, encoder, 2, 120, document_boundaries=boundaries) == expected


def test_a_ring_carries_text_in_the_corpus_dtype_unless_the_encoder_changes_rows_in_place():
    fields = [FieldSpec("text", (2049,), numpy.dtype(numpy.uint16)), FieldSpec("loss_mask", (2048,), numpy.dtype("f4"))]
    plain = make_ring(2, 3, 8, fields, None)
    lazy = make_ring(2, 3, 8, fields, TaskEncoderRunner(ChangesOneReplacesAnother(), seed=0))
    wide = make_ring(2, 3, 8, fields, TaskEncoderRunner(ReplacesTheRowsArray(), seed=0))
    assert plain.dtype == lazy.dtype == numpy.uint16 and wide.dtype == numpy.int64
    assert wide.bundle == lazy.bundle == plain.bundle == bundle_size(8, fields)
    assert wide.view(1, 2)["text"].shape == (wide.bundle, 8, 2049)
    assert wide.view(1, 2)["loss_mask"].dtype == numpy.float32
