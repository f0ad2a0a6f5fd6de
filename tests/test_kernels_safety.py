"""Who may hand the process compiled code, and the lifetime of what the kernels are handed (issue 24, CONTRACT §14)."""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy
import pytest
from conftest import write_printable_shards

from statefulset import StatefulsetError
from statefulset.index import compiled as kernels
from statefulset.index import private_build

ROOT = Path(__file__).resolve().parent.parent

# A library that announces itself: loading it (dlopen runs its constructor) writes the marker file.
PLANTED = """
#include <stdio.h>
#include <stdint.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "a");
    if (f) { fputs("planted code ran\\n", f); fclose(f); }
}
int32_t sf_abi_version(void) { return 4; }
const char *sf_source_sha256(void) { return ""; }
"""


def plant(path: Path, marker: Path) -> Path:
    """Compile the announcing library to ``path``."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "these tests plant a compiled library: they need a C compiler (cc)"
    source = path.with_suffix(".c")
    source.write_text(PLANTED)
    subprocess.run(
        [compiler, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(path), str(source)], check=True, timeout=120
    )
    source.unlink()
    return path


def shared_names() -> list[str]:
    """The names a library in ``path_to_cache/kernels`` was loaded under before this fix (5cf6a81), and the wheel's."""
    digest = hashlib.sha256()
    source = (ROOT / "statefulset" / "index" / "kernels.c").read_bytes()
    platform_tag = f"{sys.platform}|{platform.machine()}|{sysconfig.get_platform()}"
    flags = "\0".join(("-O2", "-shared", "-fPIC", "-ffp-contract=off")).encode()
    for part in (source, b"cc", flags, platform_tag.encode()):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return [f"statefulset-kernels-{digest.hexdigest()[:24]}.so"] + [
        f"_kernels{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES
    ]


OPEN_SPEC = """
import json, sys
import numpy
from statefulset.index import compiled
from statefulset.streams.opening import open_stream
stream = open_stream(json.loads(sys.argv[1]))  # packing megatron: its index build runs the kernels
stream.gather(numpy.arange(4))
print(json.dumps({"origin": str(compiled.origin()), "reason": compiled.reason()}))
"""


def test_library_planted_in_path_to_cache_never_runs(tmp_path):
    """CONTRACT §14: whoever can write path_to_cache cannot run code in a process that opens the spec."""
    cache = tmp_path / "shared-cache"
    marker = tmp_path / "marker"
    (cache / "kernels").mkdir(parents=True)
    for name in shared_names():
        plant(cache / "kernels" / name, marker)
    prefixes = write_printable_shards(tmp_path / "data", documents=(200,))
    spec = {"data_path": prefixes, "seq_length": 16, "num_samples": 100, "path_to_cache": str(cache)}
    home = tmp_path / "fresh-home"  # a node that never built the kernels
    env = {**os.environ, "XDG_CACHE_HOME": str(home), "HOME": str(home), "PYTHONPATH": str(ROOT)}
    for name in ("STATEFULSET_KERNEL_DIR", "STATEFULSET_KERNELS", "CC"):
        env.pop(name, None)
    child = subprocess.run(
        [sys.executable, "-c", OPEN_SPEC, json.dumps(spec)], env=env, capture_output=True, text=True, timeout=300
    )
    assert not marker.exists(), f"a library from path_to_cache ran: {marker.read_text()!r}"
    assert child.returncode == 0, child.stderr[-3000:]
    used = json.loads(child.stdout.strip().splitlines()[-1])
    assert not used["origin"].startswith(str(cache)), used


@pytest.fixture
def private(monkeypatch):
    """As if the package had been installed without its kernels: the private build's turn."""
    kernels._reset()
    monkeypatch.setattr(kernels, "_INSTALLED", "statefulset.index._not_installed")
    monkeypatch.delenv("STATEFULSET_KERNELS", raising=False)
    monkeypatch.delenv("CC", raising=False)
    yield monkeypatch
    monkeypatch.undo()
    kernels._reset()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_private_build_refuses_a_folder_others_can_write(private, tmp_path, caplog, mode):
    """A kernel folder that group or others can write is refused (nothing loaded from it), with a WARNING naming it."""
    folder = tmp_path / "kernels"
    folder.mkdir()
    private.setenv("STATEFULSET_KERNEL_DIR", str(folder))
    marker = tmp_path / "marker"
    source = kernels._SOURCE.read_bytes()
    planted = plant(private_build.library_path(source, ["cc"]), marker)
    planted.with_suffix(".sha256").write_text(hashlib.sha256(planted.read_bytes()).hexdigest() + "\n")
    folder.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        assert not kernels.available()
    assert not marker.exists()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"kernel build folder {folder} is writable by others (mode {mode:o})" in warnings[0]
    assert "using the Python implementations" in warnings[0]


def test_private_build_refuses_a_folder_of_another_user(tmp_path):
    folder = tmp_path / "kernels"
    private_build.check_private(folder)  # ours: accepted, and created 0700
    assert folder.stat().st_mode & 0o777 == 0o700
    with pytest.raises(StatefulsetError, match=f"kernel build folder {folder} is owned by uid {os.geteuid()}, not by"):
        private_build.check_private(folder, uid=os.geteuid() + 1)
    (tmp_path / "file").write_text("")
    with pytest.raises(StatefulsetError, match=f"kernel build folder {tmp_path / 'file'}: "):
        private_build.check_private(tmp_path / "file")


def test_private_library_changed_after_its_build_is_built_again(private, tmp_path, caplog):
    """The recorded SHA-256 is checked before each load: a library replaced since its build never runs."""
    folder = tmp_path / "kernels"
    private.setenv("STATEFULSET_KERNEL_DIR", str(folder))
    assert kernels.available(), kernels.reason()
    built = kernels.origin()
    assert built.parent == folder
    good = built.read_bytes()
    marker = tmp_path / "marker"
    plant(tmp_path / "planted.so", marker)
    os.replace(tmp_path / "planted.so", built)
    kernels._reset()
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        assert kernels.available(), kernels.reason()
    assert not marker.exists()
    assert built.read_bytes() == good  # built again (the same bytes: builds are reproducible)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"{built} does not match the SHA-256 recorded" in w for w in warnings), warnings


# --------------------------------------------------------------------------- kernels.c refuses, never overruns


@pytest.fixture(scope="module")
def lib():
    found = kernels.library()
    assert found is not None, kernels.reason()
    return found


def i64(*values: int) -> numpy.ndarray:
    return numpy.array(values, dtype=numpy.int64)


BAD_ARGUMENT = 4


def test_feistel_and_window_order_refuse_what_would_never_end(lib):
    """x >= n or n = 0 used to cycle-walk forever; windows = 0 divided by zero."""
    keys = numpy.arange(6, dtype=numpy.uint64)
    out = numpy.full(2, -1, dtype=numpy.int64)
    assert lib.sf_feistel(i64(0, 10), 2, 10, 2, keys, 6, 0, out) == BAD_ARGUMENT  # 10 is outside [0, 10)
    assert lib.sf_feistel(i64(0, 1), 2, 0, 1, keys, 6, 0, out) == BAD_ARGUMENT
    assert lib.sf_feistel(i64(0, 1), 2, 100, 2, keys, 6, 0, out) == BAD_ARGUMENT  # 4 bits cover 16, not 100
    assert out.tolist() == [-1, -1]  # nothing written
    ok, negative = i64(0, 5), i64(0, -5)  # sf_window_permute takes raw addresses (statefulset/index/compiled.py)
    assert lib.sf_window_permute(ok.ctypes.data, 2, 0, 1, 7, 6, out.ctypes.data) == BAD_ARGUMENT
    assert lib.sf_window_permute(negative.ctypes.data, 2, 10, 2, 7, 6, out.ctypes.data) == BAD_ARGUMENT
    assert lib.sf_window_permute(ok.ctypes.data, 2, 10, 2, 7, 65, out.ctypes.data) == BAD_ARGUMENT  # <= 64 round keys
    assert out.tolist() == [-1, -1]
    assert lib.sf_feistel(i64(0, 9), 2, 10, 2, keys, 6, 0, out) == 0 and sorted(out.tolist()) != [-1, -1]


def test_bestfit_sizes_whose_byte_count_overflows_are_refused(lib):
    """capacity 2**61: (capacity + 2) * 8 wraps a 64-bit size_t to 16 bytes; the kernel wrote past them."""
    sizes, bins = i64(3, 5), numpy.zeros(1, dtype=numpy.int64)
    assert lib.sf_bestfit_counts(sizes, 2, 2, 2**61, bins) == -2  # cannot be allocated: refused as out of memory
    assert lib.sf_bestfit_counts(sizes, 2, 2, 2**63 - 1, bins) == -3  # capacity + 2 itself overflows
    assert lib.sf_bestfit_counts(sizes, 2, 0, 8, bins) == -3  # window 0
    assert lib.sf_bestfit_counts(sizes, -1, 2, 8, bins) == -3
    entries, ends = numpy.zeros(2, dtype=numpy.uint32), numpy.zeros(2, dtype=numpy.uint32)
    assert lib.sf_bestfit_entries(sizes, 2, 2**61, entries, ends) == -2
    assert lib.sf_bestfit_entries(sizes, 2, 2**63 - 1, entries, ends) == -3
    assert lib.sf_bestfit_entries(sizes, 2**32 + 1, 8, entries, ends) == -3  # uint32 entry numbers would wrap
    assert lib.sf_bestfit_window(sizes, -2, 8, numpy.zeros(2, dtype=numpy.int64)) == -3
    assert lib.sf_bestfit_counts(sizes, 2, 2, 8, bins) == 0 and bins.tolist() == [1]


def test_document_fields_stay_inside_the_pieces_they_are_given(lib):
    """sf_document_fields used to trust sum(counts): now it knows how many values ``packed`` holds."""
    seq_length, rows = 8, 1
    cu = numpy.zeros((rows, seq_length + 1), dtype=numpy.int32)
    top = numpy.zeros(rows, dtype=numpy.int32)
    pos = numpy.zeros((rows, seq_length), dtype=numpy.int64)
    addresses = (cu.ctypes.data, top.ctypes.data, pos.ctypes.data)
    packed = i64(3, 9, 4, 5)  # three pieces announced, two given
    assert lib.sf_document_fields(packed.ctypes.data, packed.size, rows, seq_length, *addresses) == -1
    assert lib.sf_document_fields(packed.ctypes.data, 1, rows, seq_length, *addresses) == -1  # not even counts, used
    whole = i64(2, 9, 4, 5)
    assert lib.sf_document_fields(whole.ctypes.data, whole.size, rows, seq_length, *addresses) == 0
    assert cu[0].tolist() == [0, 4, 8, 8, 8, 8, 8, 8, 8]


def test_window_pieces_refuse_starts_whose_byte_offsets_overflow(lib):
    pointers, counts, lengths = i64(0, 8, 20), numpy.zeros(1, dtype=numpy.int64), numpy.zeros(4, dtype=numpy.int64)
    for start in (-1, 2**62):
        assert lib.sf_window_pieces(pointers.ctypes.data, 3, 2, i64(start).ctypes.data, 1, 4,
                                    counts.ctypes.data, lengths.ctypes.data) == -1  # fmt: skip
    assert lib.sf_window_pieces(pointers.ctypes.data, 3, 2, i64(2).ctypes.data, 1, 4,
                                counts.ctypes.data, lengths.ctypes.data) == 2  # fmt: skip
    assert counts.tolist() == [2] and lengths[:2].tolist() == [2, 2]


def test_sample_index_and_blending_refuse_empty_inputs(lib):
    out, where = numpy.zeros((2, 2), dtype=numpy.int32), ctypes.c_int64(-1)
    lengths = numpy.array([4], dtype=numpy.int32)
    code = lib.sf_sample_index(lengths, 1, numpy.zeros(1, numpy.int32), 0, 2, 4, 0, 1, 0, out, 0, ctypes.byref(where))
    assert code == BAD_ARGUMENT and out.tolist() == [[0, 0], [0, 0]]  # no document: document_index[0] was read
    index, samples, counts = numpy.zeros(3, numpy.int16), numpy.zeros(3, numpy.int64), numpy.zeros(1, numpy.int64)
    assert lib.sf_blending_indices(numpy.ones(1), 0, 3, index, samples, counts) == BAD_ARGUMENT
    assert lib.sf_blending_indices(numpy.ones(1), 1, -1, index, samples, counts) == BAD_ARGUMENT
    scratch = (numpy.zeros(1, numpy.int64), numpy.zeros(1), numpy.zeros(1, numpy.int32))
    assert lib.sf_exhaustive_blending_indices(i64(-2), 1, index, samples, *scratch) == BAD_ARGUMENT


def test_legacy_shuffle_refuses_what_it_cannot_do_as_numpy(lib):
    """Another item size, a negative count, more than 2^32 items or a generator position outside its
    block: refused before anything is read or written (the array and the state stay as they were)."""
    key = numpy.arange(624, dtype=numpy.uint32)
    items = numpy.arange(6, dtype=numpy.int32)
    for position, count, itemsize in [(624, 6, 2), (624, -1, 4), (625, 6, 4), (-1, 6, 4), (624, (1 << 32) + 1, 4)]:
        where = ctypes.c_int64(position)
        assert lib.sf_legacy_shuffle(key, ctypes.byref(where), items.ctypes.data, count, itemsize) == BAD_ARGUMENT
        assert where.value == position
    assert items.tolist() == list(range(6)) and key.tolist() == list(range(624))
