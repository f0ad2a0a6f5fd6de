from __future__ import annotations

import os
import shutil
import tempfile

import numpy
import pytest
from no_skips import pytest_addoption, pytest_configure, pytest_runtest_setup  # noqa: F401  (the skip rule's hooks)

from statefulset import IndexedDatasetWriter
from statefulset.shards.idx_format import DTYPE_CODES

ALL_DTYPES = list(DTYPE_CODES.values())

# Tests never write into the user's real ~/.cache: remembered facts, the compiled kernels and the
# demo corpus go to a folder of this session (set before anything runs, so subprocesses and
# worker processes inherit it), removed at the end.
_CACHE_HOME = tempfile.mkdtemp(prefix="statefulset-tests-cache-")
os.environ["XDG_CACHE_HOME"] = _CACHE_HOME
os.environ.pop("STATEFULSET_KERNEL_DIR", None)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE_HOME, ignore_errors=True)


@pytest.fixture(scope="module")
def single_process_group(tmp_path_factory):
    """A one-rank gloo group for the module: megatron-core's BlendedDataset asks for the rank even without one."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def random_documents(rng: numpy.random.Generator, dtype: numpy.dtype, n: int = 50, max_len: int = 40):
    """Documents as lists of sequences, with empty sequences and multi-sequence documents."""
    docs = []
    for _ in range(n):
        seqs = []
        for _ in range(int(rng.integers(1, 4))):
            length = int(rng.integers(0, max_len))
            if dtype.kind == "f":
                seqs.append(rng.standard_normal(length).astype(dtype))
            else:
                info = numpy.iinfo(dtype)
                seqs.append(rng.integers(max(info.min, -1000), min(info.max, 60000), length).astype(dtype))
        docs.append(seqs)
    return docs


def write_documents(prefix, docs, dtype) -> None:
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for seqs in docs:
            writer.add_document(numpy.concatenate(seqs) if seqs else numpy.array([], dtype), [len(s) for s in seqs])


@pytest.fixture
def rng() -> numpy.random.Generator:
    return numpy.random.default_rng(1234)


def write_printable_shards(root, documents=(90, 40, 150), seed: int = 10) -> list[str]:
    """uint16 shards ``part_k`` of printable bytes, each document ending with the byte tokenizer's
    EOD (256), with multi-sequence documents and empty sequences: ``tokenizer="bytes"`` decodes them."""
    rng = numpy.random.default_rng(seed)
    prefixes = []
    for k, count in enumerate(documents):
        prefix = str(root / f"part_{k}")
        with IndexedDatasetWriter(prefix, numpy.uint16) as writer:
            for _ in range(count):
                lengths = [int(x) for x in rng.integers(0, 30, int(rng.integers(1, 4)))]
                lengths[-1] += 1
                writer.add_document(numpy.append(rng.integers(32, 127, sum(lengths) - 1), 256), lengths)
        prefixes.append(prefix)
    return prefixes
