"""The page-cache-bypassing output: exact bytes whatever the sizes, with or without O_DIRECT."""

from __future__ import annotations

import os

import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statefulset.shards.direct_io import SequentialWriter


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 20_000), max_size=12), direct=st.booleans())
def test_bytes_round_trip(tmp_path_factory, sizes, direct):
    os.environ["STATEFULSET_DIRECT_IO"] = "1" if direct else "0"
    try:
        path = str(tmp_path_factory.mktemp("dio") / "f")
        rng = numpy.random.default_rng(len(sizes))
        parts = [rng.integers(0, 256, n, dtype=numpy.uint8) for n in sizes]
        out = SequentialWriter(path, buffer_bytes=8192)  # tiny buffer: many drains and a padded tail
        for part in parts:
            out.write(part)
        out.close()
        expected = b"".join(p.tobytes() for p in parts)
        with open(path, "rb") as f:
            assert f.read() == expected
    finally:
        del os.environ["STATEFULSET_DIRECT_IO"]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a tmpfs")
def test_filesystem_without_o_direct_falls_back(tmp_path):
    path = f"/dev/shm/statefulset-test-{os.getpid()}"
    try:
        out = SequentialWriter(path, buffer_bytes=4096)
        out.write(b"x" * 10_000)
        out.close()
        with open(path, "rb") as f:
            assert f.read() == b"x" * 10_000
    finally:
        os.remove(path)


def test_abort_closes_without_writing(tmp_path):
    out = SequentialWriter(str(tmp_path / "f"))
    out.write(b"abc")
    out.abort()
    assert (tmp_path / "f").stat().st_size == 0
