"""The shared integer check every public entry point uses for counts, ranks and sizes."""

from __future__ import annotations

import numpy
import pytest

from statefulset import ParallelLayout, StatefulsetError, WorkerConfig
from statefulset.errors import check_int


def test_check_int_accepts_ints_and_numpy_ints_in_range():
    assert check_int("n", 3) == 3
    assert check_int("n", numpy.int64(7), 1, high=7) == 7
    assert check_int("n", None, none_ok=True) is None


@pytest.mark.parametrize(
    ("value", "kwargs", "message"),
    [
        (True, {}, "here: n must be an integer >= 0, got True"),
        (2.0, {}, "here: n must be an integer >= 0, got 2.0"),
        ("3", {}, "here: n must be an integer >= 0, got '3'"),
        (0, {"low": 1}, "here: n must be an integer >= 1, got 0"),
        (9, {"low": 1, "high": 8}, r"here: n must be an integer in \[1, 8\], got 9"),
        (None, {}, "here: n must be an integer >= 0, got None"),
        (-1, {"none_ok": True}, "here: n must be an integer >= 0 or None, got -1"),
    ],
)
def test_check_int_names_where_and_what(value, kwargs, message):
    with pytest.raises(StatefulsetError, match=f"^{message}$"):
        check_int("n", value, where="here", **kwargs)


def test_public_constructors_use_it():
    with pytest.raises(StatefulsetError, match="ParallelLayout: tp must be an integer >= 1, got 0"):
        ParallelLayout(4, tp=0)
    with pytest.raises(StatefulsetError, match="WorkerConfig: num_workers must be an integer >= 0, got -1"):
        WorkerConfig(rank=0, world_size=1, num_workers=-1)
