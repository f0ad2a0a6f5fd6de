"""Encoded tokens checked and narrowed into the batch ring in one pass (``encoded_ring.narrowed``, the
compiled ``sf_narrow_tokens``): the same slot contents as numpy's range check and copy, the same
refusals (a token outside the ring's dtype), with and without the kernels; and through workers, a
bundle whose later batch leaves the dtype travels another way, every batch as ``ds[p]`` encodes it."""

from __future__ import annotations

import numpy
import pytest
import torch
from corpora import geometric_spec

from statefulset import WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.index import compiled
from statefulset.loading.encoded_ring import narrowed

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

DTYPES = [numpy.uint8, numpy.int8, numpy.int16, numpy.uint16, numpy.int32, numpy.int64]


@pytest.fixture(params=["kernels", "numpy"])
def kernels_or_numpy(request, monkeypatch):
    """Both ways of narrowing, in this process and in forked workers."""
    if request.param == "numpy":
        monkeypatch.setenv("STATEFULSET_KERNELS", "0")
    compiled._reset()
    if request.param == "kernels" and not compiled.available():
        pytest.skip(f"no compiled kernels here: {compiled.reason()}")
    yield request.param
    monkeypatch.undo()
    compiled._reset()


def _reference(text: numpy.ndarray, dtype: numpy.dtype) -> numpy.ndarray | None:
    limits = numpy.iinfo(dtype)
    if text.size and (text.min() < limits.min or text.max() > limits.max):
        return None
    return text.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: numpy.dtype(d).name)
def test_narrowing_equals_numpys_check_and_copy(dtype, kernels_or_numpy):
    limits = numpy.iinfo(dtype)
    rng = numpy.random.default_rng(5)
    rows, width = 3, 2049  # more than one of the kernel's blocks (2048 tokens)
    inside = rng.integers(limits.min, limits.max, (rows, width), endpoint=True, dtype=numpy.int64)
    inside[0, :2] = limits.min, limits.max  # both ends of the range fit
    cases = [inside, numpy.zeros((rows, 0), dtype=numpy.int64)]
    if dtype is not numpy.int64:
        for at in (0, 2047, 2048, rows * width - 1):  # the first token, a block's last, the next one's first, the last
            for value in (limits.max + 1, limits.min - 1, -(2**63), 2**63 - 1):
                bad = inside.copy()
                bad.reshape(-1)[at] = value
                cases.append(bad)
    for text in cases:
        out = numpy.full(text.shape, 7, dtype=dtype)
        expected = _reference(text, numpy.dtype(dtype))
        assert narrowed(text, out, limits) is (expected is not None)
        if expected is not None:
            assert numpy.array_equal(out, expected)


def test_the_kernel_refuses_bad_arguments_and_writes_nothing():
    lib = compiled.library()
    if lib is None:
        pytest.skip(f"no compiled kernels here: {compiled.reason()}")
    text = numpy.arange(5, dtype=numpy.int64)
    out = numpy.zeros(5, dtype=numpy.uint16)
    for n, kind in ((-1, 3), (5, 6), (5, -1), (2**62, 3)):
        assert lib.sf_narrow_tokens(text.ctypes.data, n, out.ctypes.data, kind) == -1
    assert lib.sf_narrow_tokens(None, 5, out.ctypes.data, 3) == -1
    assert not out.any()
    assert lib.sf_narrow_tokens(text.ctypes.data, 5, out.ctypes.data, 3) == 0
    assert out.tolist() == [0, 1, 2, 3, 4]


def test_non_contiguous_or_read_only_tokens_take_numpys_way():
    limits = numpy.iinfo(numpy.uint16)
    text = numpy.arange(40, dtype=numpy.int64).reshape(4, 10)
    out = numpy.zeros((4, 5), dtype=numpy.uint16)
    assert narrowed(text[:, ::2], out, limits) and out.tolist() == text[:, ::2].tolist()
    frozen = text[:, :5].copy()
    frozen.flags.writeable = False
    assert narrowed(frozen, out, limits) and out.tolist() == frozen.tolist()


class LeavesTheDtypeAt:
    """Changes tokens in place (kept), beyond uint16 for a few positions only: the bundles holding them
    leave the ring after some of their batches were written into its slot."""

    def encode_sample(self, sample):
        if sample.sample_id % 13 == 5:
            sample.text[-1] = 70_000 + sample.sample_id
        return sample


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return geometric_spec(tmp_path_factory.mktemp("narrow"), seed=11, documents=300, mean=30, seq_length=16)


def test_a_bundle_leaving_the_dtype_midway_arrives_exact(spec, kernels_or_numpy):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
    ds = get_train_dataset(spec, batch_size=3, task_encoder=LeavesTheDtypeAt())
    ld = get_savable_loader(get_train_dataset(spec, batch_size=3, worker_config=wc, task_encoder=LeavesTheDtypeAt()))
    wide = 0
    for t, batch in zip(range(40), ld, strict=False):
        assert batch["sample_id"].tolist() == [3 * t, 3 * t + 1, 3 * t + 2]
        assert batch["text"].dtype == torch.int64
        for i, p in enumerate(batch["sample_id"].tolist()):
            assert batch["text"][i].tolist() == ds[p].text.tolist(), f"sample {p}"
            wide += int(batch["text"][i, -1]) >= 70_000
    assert wide == len([p for p in range(120) if p % 13 == 5])
