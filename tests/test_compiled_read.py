"""The compiled ``loader.metrics()`` read (statefulset.loading.compiled_read) and its fallback.

tests/test_metrics_incremental.py checks every read of both ways against the metrics computed from
scratch; here: the reads of a compiled meter equal those of a Python one over the same steps (a
native stream with a stage change and a megatron-packed one, which has no per-source values), a
missing or stale extension falls back to Python with a WARNING (INFO when turned off on purpose),
and the C call refuses a control made for other keys.
"""

from __future__ import annotations

import logging

import pytest
from corpora import write_sources

from statefulset import WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.index import compiled
from statefulset.loading.compiled_read import CONTROL, CompiledRead

SEQ, BATCH = 16, 4


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    return write_sources(tmp_path_factory.mktemp("compiled-read"), {"web": 150, "code": 200}, seed=7)


@pytest.fixture
def fresh(monkeypatch):
    """module_function looks again (its answer is kept per process), before and after."""
    compiled._reset()
    yield monkeypatch
    monkeypatch.undo()
    compiled._reset()


def _specs(prefixes, cache) -> dict[str, dict]:
    web, code = prefixes
    return {
        "native": {
            "seq_length": SEQ, "split": "1", "packing": "native", "seed": 3, "path_to_cache": str(cache),
            "stages": [{"start": 0, "data_path": {web: 0.6, code: 0.4}},
                       {"start": 80, "data_path": {web: 0.1, code: 0.9}}],
        },
        "megatron": {"seq_length": SEQ, "split": "100,0,0", "packing": "megatron", "seed": 3, "data_path": web,
                     "num_samples": 400, "path_to_cache": str(cache)},
    }  # fmt: skip


def _reads(spec: dict, steps: list[int]) -> tuple[list[dict[str, float]], bool]:
    """A read after each run of ``steps`` batches (data_wait_seconds left out: a clock), and whether
    the read was compiled."""
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    loader = get_savable_loader(get_train_dataset(spec, batch_size=BATCH, worker_config=wc))
    it = iter(loader)
    out = []
    for step in steps:
        for _ in range(step):
            next(it)
        got = loader.metrics()
        assert got is not loader.metrics() and isinstance(got["batches"], float)
        got.pop("data_wait_seconds")
        out.append(got)
    return out, loader._options["meter"]._compiled is not None


@pytest.mark.parametrize("packing", ["native", "megatron"])
def test_compiled_reads_equal_python_reads(prefixes, tmp_path, fresh, packing):
    spec = _specs(prefixes, tmp_path / "cache")[packing]
    steps = [0, 1, 1, 1, 1, 0, 3, 3, 3, 3, 1, 7, *[1] * 30, 2, 2, 2]  # steady runs, standing still, jumps
    with_c, was_compiled = _reads(spec, steps)
    assert was_compiled, compiled.module_function("metrics_read")
    compiled._reset()
    fresh.setenv("STATEFULSET_KERNELS", "0")
    in_python, was_compiled = _reads(spec, steps)
    assert not was_compiled
    for a, b in zip(with_c, in_python, strict=True):
        assert list(a) == list(b) and a == b, {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}
    if packing == "native":  # the stage change at 80 is in the reads
        assert len({v for r in with_c for k, v in r.items() if k.endswith("/weight")}) == 4


def test_a_copied_loader_reads_through_its_own_compiled_read(prefixes, tmp_path, fresh):
    """The compiled read holds addresses of its meter's arrays: a deep copy of a loader must not use the original's."""
    import copy

    spec = _specs(prefixes, tmp_path / "cache")["native"]
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    loader = get_savable_loader(get_train_dataset(spec, batch_size=BATCH, worker_config=wc))
    for _ in range(3):
        loader.metrics()
    twin = copy.deepcopy(loader)
    meter, other = loader._options["meter"], twin._options["meter"]
    assert other._compiled is not None and other._compiled is not meter._compiled and other._fast is None
    it, twin_it = iter(loader), iter(twin)
    for _ in range(12):
        next(it), next(twin_it)
        a, b = loader.metrics(), twin.metrics()
        a.pop("data_wait_seconds"), b.pop("data_wait_seconds")
        assert a == b
    assert other._fast is not None and other._fast[1] != meter._fast[1]  # its own control


def test_a_stale_extension_falls_back_to_python_with_a_warning(fresh, tmp_path, caplog):
    other = tmp_path / "kernels_module.c"
    other.write_text("/* a kernels_module.c edited since the extension was built */\n")
    fresh.setattr(compiled, "_MODULE_SOURCE", other)
    with caplog.at_level(logging.INFO, logger="statefulset"):
        assert compiled.module_function("metrics_read") is None
        assert CompiledRead.made() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "metrics_read" in r.getMessage()]
    assert len(warnings) == 1 and "another kernels_module.c" in warnings[0].getMessage(), caplog.text


def test_a_missing_extension_falls_back_to_python_with_a_warning(fresh, caplog):
    fresh.setattr(compiled, "_INSTALLED", "statefulset.index._not_installed")
    with caplog.at_level(logging.INFO, logger="statefulset"):
        assert compiled.module_function("metrics_read") is None
    assert any(r.levelno == logging.WARNING and "not importable" in r.getMessage() for r in caplog.records), caplog.text


def test_turned_off_kernels_read_in_python_with_an_info_line(fresh, caplog):
    fresh.setenv("STATEFULSET_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger="statefulset"):
        assert compiled.module_function("metrics_read") is None
    found = [r for r in caplog.records if "metrics_read" in r.getMessage()]
    assert found and all(r.levelno == logging.INFO for r in found), caplog.text


def test_the_compiled_read_refuses_a_control_made_for_other_keys(fresh):
    made = CompiledRead.made()
    assert made is not None, "build the extension: setup.py build_ext --inplace"
    keys = ("data_wait_seconds", "batches", "tokens", "worker_restarts", "stall_warnings")
    assert made.read() == (len(CONTROL), 25, 9, 16)  # no arguments: the layout it was built for
    # Nothing synced: the control names no keys, so the call leaves the read to Python.
    assert made.read(made.address, keys, 0.0, 0, 0.0, 0.0, 0, 0, 0) is None
    with pytest.raises(TypeError):
        made.read(made.address, keys)
