"""A plain ``encode_sample``'s per-sample loop, compiled (``encode_samples`` in ``kernels_module.c``) and in
Python (``TaskEncoderRunner._encode_python``): the same samples (fields, their order, their very objects),
the same *kept* verdict, the same refusals and errors naming the same sample, for encoders that keep,
change in place, replace, add, delete, reorder or swap out the sample's attributes."""

from __future__ import annotations

import dataclasses

import numpy
import pytest
from encoders import AnotherSample, Identity, ReAdds

from statefulset import StatefulsetError, TokenSample
from statefulset.index import compiled
from statefulset.transforms.encoder import TaskEncoderRunner


class InPlace:
    def encode_sample(self, sample):
        sample.text += 1
        return sample


class Replaces:
    def encode_sample(self, sample):
        sample.text = sample.text * 2
        return sample


class SetsSame:
    """Sets a field to the very object it holds: still kept (the same attributes, order and objects)."""

    def encode_sample(self, sample):
        sample.source = sample.source
        return sample


class Adds:
    def encode_sample(self, sample):
        sample.extra = sample.sample_id
        return sample


class NewDict:
    """A new __dict__ holding the same attributes, in order, with the very objects: still kept."""

    def encode_sample(self, sample):
        sample.__dict__ = dict(sample.__dict__)
        return sample


class Dicts:
    def encode_sample(self, sample):
        return {"text": sample.text, "n": sample.sample_id}


class NoneAt:
    def encode_sample(self, sample):
        return None if sample.sample_id == 44 else sample


class IteratorAt:
    def encode_sample(self, sample):
        return iter([sample]) if sample.sample_id == 45 else sample


class RaisesAt:
    def encode_sample(self, sample):
        if sample.sample_id == 46:
            raise KeyError("boom")
        sample.text[0] = -1
        return sample


class NoneAfterRaises:
    """A refusal at sample 42 comes before the error at 43: the loop stops at the first."""

    def encode_sample(self, sample):
        if sample.sample_id == 43:
            raise ValueError("later")
        return None if sample.sample_id == 42 else sample


ENCODERS = [Identity, InPlace, Replaces, SetsSame, Adds, ReAdds, NewDict, AnotherSample, Dicts, NoneAt, IteratorAt,
            RaisesAt, NoneAfterRaises]  # fmt: skip


def _columns(seed: int) -> tuple[list, dict]:
    rng = numpy.random.default_rng(seed)
    text = rng.integers(0, 1000, (10, 7))
    rows = {"text": list(text), "loss_mask": list(numpy.ones((10, 6), dtype=numpy.float32))}
    ids = list(range(40, 50))
    given = {"sample_id": ids, "source": [f"s{i % 3}" for i in ids], **rows}
    names = [f.name for f in dataclasses.fields(TokenSample)]
    return [given.get(name, [None] * 10) for name in names], rows


def _outcome(runner: TaskEncoderRunner, loop: str, seed: int):
    columns, _ = _columns(seed)
    try:
        samples, kept = runner._encode_plain(columns) if loop == "compiled" else runner._encode_python(columns)
    except StatefulsetError as exc:
        return "error", str(exc), None
    return "ok", kept, samples


def _described(samples):
    out = []
    for s in samples:
        if isinstance(s, TokenSample):
            values = vars(s)
            out.append((type(s).__name__, list(values), [v.tolist() if isinstance(v, numpy.ndarray) else v
                                                          for v in values.values()]))  # fmt: skip
        else:
            out.append((type(s).__name__, {k: v.tolist() if isinstance(v, numpy.ndarray) else v for k, v in s.items()}))
    return out


@pytest.mark.parametrize("encoder", ENCODERS, ids=lambda e: e.__name__)
def test_the_compiled_loop_equals_the_python_loop(encoder):
    if compiled.module_function("encode_samples") is None:
        pytest.fail("the compiled encode_samples is not built here (python setup.py build_ext --inplace)")
    runner = TaskEncoderRunner(encoder(), seed=1)
    fast = _outcome(runner, "compiled", 5)
    slow = _outcome(runner, "python", 5)
    assert fast[:2] == slow[:2]
    if fast[0] == "ok":
        assert _described(fast[2]) == _described(slow[2])
        assert [type(s) for s in fast[2]] == [type(s) for s in slow[2]]


def test_kept_samples_hold_the_very_rows_and_the_verdicts_are_as_expected():
    expected = {Identity: True, InPlace: True, SetsSame: True, Replaces: False, Adds: False, ReAdds: False,
                NewDict: True, AnotherSample: False, Dicts: False}  # fmt: skip
    for encoder, kept in expected.items():
        columns, rows = _columns(2)
        samples, verdict = TaskEncoderRunner(encoder(), seed=1)._encode_plain(columns)
        assert verdict is kept, encoder.__name__
        if kept:
            assert all(s.text is row for s, row in zip(samples, rows["text"], strict=True))


def test_refusals_and_errors_name_the_sample():
    runner = TaskEncoderRunner(NoneAt(), seed=1)
    with pytest.raises(StatefulsetError, match="returned None for sample 44"):
        runner._encode_plain(_columns(1)[0])
    with pytest.raises(StatefulsetError, match="returned an iterator for sample 45"):
        TaskEncoderRunner(IteratorAt(), seed=1)._encode_plain(_columns(1)[0])
    with pytest.raises(StatefulsetError, match=r"RaisesAt: encode_sample failed on sample 46: KeyError"):
        TaskEncoderRunner(RaisesAt(), seed=1)._encode_plain(_columns(1)[0])
    with pytest.raises(StatefulsetError, match="returned None for sample 42"):
        TaskEncoderRunner(NoneAfterRaises(), seed=1)._encode_plain(_columns(1)[0])


def test_made_samples_behave_as_constructed_ones():
    columns, _ = _columns(3)
    made, _ = TaskEncoderRunner(Identity(), seed=1)._encode_plain(columns)
    built = [TokenSample(*row) for row in zip(*columns, strict=True)]
    for a, b in zip(made, built, strict=True):
        assert type(a) is TokenSample and list(vars(a)) == list(vars(b))
        assert a.fields().keys() == b.fields().keys()
        assert dataclasses.replace(a).sample_id == a.sample_id
        a.new_field = 1
        assert a.fields()["new_field"] == 1
