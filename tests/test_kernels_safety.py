"""Who may hand the process compiled code, and the lifetime of what the kernels are handed (issue 24, CONTRACT §14)."""

from __future__ import annotations

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

import pytest
from conftest import write_printable_shards

from statefulset import StatefulsetError
from statefulset.index import compiled as kernels
from statefulset.index import private_build

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = str(ROOT / "statefulset")

# Import the kernels without the package __init__ (which imports torch: seconds per process).
LIGHT_IMPORT = """
import sys, types
package = types.ModuleType("statefulset")
package.__path__ = [sys.argv[1]]
sys.modules["statefulset"] = package
"""


def run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", LIGHT_IMPORT + code, PACKAGE, *args], capture_output=True, text=True, timeout=300
    )


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


# --------------------------------------------------------------------------- C9: arrays alive for the call

EVICTED_DURING_CALL = """
import threading
import numpy
from statefulset.index import compiled
from statefulset.streams import documents

S = 64  # iota: 512 bytes, fill: 260 bytes, both in numpy's small-block cache: a freed block comes back first
lib = compiled.library()
assert lib is not None, compiled.reason()


class EvictedBeforeTheCall:
    '''The real kernel, entered right after another read-ahead thread evicted the constant rows.'''

    def __init__(self, lib):
        self.lib, self.garbage = lib, []

    def sf_document_fields(self, *args):
        evict = threading.Thread(target=lambda: [documents._constant_rows(n) for n in range(1, 11)])
        evict.start()
        evict.join(timeout=60)
        assert not evict.is_alive(), "the evicting thread did not finish in 60 s"
        # What a freed row's memory holds next: other arrays of the same sizes.
        self.garbage = [numpy.full(S, 7777, dtype=numpy.int64) for _ in range(8)]
        self.garbage += [numpy.full(S + 1, 9999, dtype=numpy.int32) for _ in range(8)]
        return self.lib.sf_document_fields(*args)


pieces = documents.Pieces(
    numpy.array([2, 1, 3], dtype=numpy.int64), numpy.array([30, 35, 65, 10, 20, 25], dtype=numpy.int64),
    numpy.array([65, 65, 55], dtype=numpy.int64),
)
expected = documents._document_fields_numpy(pieces, S, None)
for attempt in range(3):  # the first call builds the rows, the later ones find them cached
    found = documents._fields_compiled(EvictedBeforeTheCall(lib), pieces, S, {})
    assert found is not None
    for name, value in expected.items():
        assert numpy.array_equal(found[name], value), (attempt, name, found[name], value)
print("same")
"""


def test_constant_rows_stay_alive_while_the_kernel_reads_them():
    """C9: another thread evicting the cached rows mid-call must not free what the kernel is reading."""
    child = run_child(EVICTED_DURING_CALL)
    assert child.returncode == 0 and child.stdout.strip() == "same", child.stderr[-3000:]
