"""Compiled kernels: equal to their Python fallbacks and to megatron-core, cached safely, checked inputs."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
from conftest import write_printable_shards
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from statefulset import StatefulsetError
from statefulset.index import compiled as kernels
from statefulset.index.megatron import blend
from statefulset.index.megatron import sample_index as sample_index_module
from statefulset.index.megatron.gpt import build_sample_index
from statefulset.index.megatron.sample_index import build_sample_index_numpy
from statefulset.index.native.keys import derive_key
from statefulset.index.native.permutation import ROUNDS, KeyedPermutation, half_bits
from statefulset.index.native.windows import compiled_window_permute
from statefulset.streams.opening import open_stream

ROOT = Path(__file__).resolve().parent.parent
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", autouse=True)
def kernel_dir(tmp_path_factory):
    """Every test here builds into its own cache folder, and leaves the loader as it found it."""
    folder = tmp_path_factory.mktemp("kernels")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STATEFULSET_KERNEL_DIR", str(folder))
        patch.delenv("STATEFULSET_KERNELS", raising=False)
        patch.delenv("CC", raising=False)
        kernels._reset()
        yield folder
    kernels._reset()


@pytest.fixture(scope="module")
def compiled(kernel_dir):
    if not kernels.available():
        pytest.skip(f"no compiled kernels here: {kernels.reason()}")
    return True


@pytest.fixture
def reloaded(monkeypatch):
    """For tests that change the environment: reload before and after."""
    kernels._reset()
    yield monkeypatch
    monkeypatch.undo()
    kernels._reset()


def megatron_helpers():
    """megatron-core's pybind helpers, loaded straight from the wheel (tests using them are oracle tests).

    Importing ``megatron.core`` pulls in torch (~8 s); the extension itself needs nothing from it.
    """
    spec = importlib.util.find_spec("megatron")
    for folder in spec.submodule_search_locations:
        for path in sorted((Path(folder) / "core" / "datasets").glob("helpers_cpp*.so")):
            loader = importlib.machinery.ExtensionFileLoader("helpers_cpp", str(path))
            module_spec = importlib.util.spec_from_file_location("helpers_cpp", path, loader=loader)
            module = importlib.util.module_from_spec(module_spec)
            loader.exec_module(module)
            return module
    raise AssertionError(f"megatron-core is installed, its helpers_cpp is not built: {spec.submodule_search_locations}")


@pytest.fixture(scope="module")
def helpers():
    return megatron_helpers()


# --------------------------------------------------------------------------- strategies

SPECIAL_WEIGHTS = [0.0, 5e-324, 1e-300, 1e-17, 1e-9, 1 / 3, 0.5, 1.0, 7.0]
weight = st.one_of(st.floats(0.0, 1.0, allow_subnormal=True), st.sampled_from(SPECIAL_WEIGHTS))


@st.composite
def weight_lists(draw, positive: bool = False):
    k = draw(st.integers(1, 6))
    each = weight.filter(lambda w: w > 0) if positive else weight
    weights = draw(st.one_of(st.lists(each, min_size=k, max_size=k), each.map(lambda w: [w] * k)))
    if draw(st.booleans()) and sum(weights) > 0:
        weights = list(numpy.asarray(weights) / numpy.sum(weights))
    return numpy.asarray(weights, dtype=numpy.float64)


@st.composite
def gpt_inputs(draw):
    """Consistent sample index arguments: a document index of whole shuffled epochs, some empty sequences."""
    count = draw(st.integers(1, 40))
    lengths = numpy.asarray(
        draw(st.lists(st.one_of(st.just(0), st.integers(0, 60)), min_size=count, max_size=count)), dtype=numpy.int32
    )
    ids = numpy.asarray(sorted(draw(st.sets(st.integers(0, count - 1), min_size=1))), dtype=numpy.int32)
    epochs = draw(st.integers(1, 5))
    seq_length = draw(st.integers(1, 70))
    extra = draw(st.sampled_from([0, 1]))
    drop_last = draw(st.booleans())
    tokens_per_epoch = int(lengths[ids].sum())
    assume(epochs * tokens_per_epoch > extra)
    document_index = numpy.tile(ids, epochs)
    numpy.random.RandomState(draw(st.integers(0, 2**32 - 1))).shuffle(document_index)
    return lengths, document_index, seq_length, epochs, tokens_per_epoch, drop_last, extra


# --------------------------------------------------------------------------- compiled == fallback


@FAST
@given(args=gpt_inputs())
def test_sample_index_compiled_equals_numpy(compiled, args):
    expected = build_sample_index_numpy(*args)
    for ours in (
        sample_index_module.sample_index(*args, native=True),
        sample_index_module.sample_index(*args, native=False),
    ):
        assert ours.dtype == expected.dtype == numpy.int32
        numpy.testing.assert_array_equal(ours, expected)
    numpy.testing.assert_array_equal(build_sample_index(*args), expected)


@FAST
@given(args=gpt_inputs())
def test_sample_index_int64_kernel(compiled, args):
    """The int64 variant (used from 2**31 document index entries on) gives the same values."""
    _, _, seq_length, epochs, tokens_per_epoch, drop_last, extra = args
    n = sample_index_module._num_samples(epochs * tokens_per_epoch - extra, seq_length, drop_last)
    wide = sample_index_module._sample_index_compiled(kernels.library(), *args, n, numpy.int64)
    assert wide.dtype == numpy.int64
    numpy.testing.assert_array_equal(wide, build_sample_index_numpy(*args))


def test_build_sample_index_dispatches_to_the_kernel(compiled, monkeypatch):
    def refuse(*args):
        raise AssertionError("the NumPy fallback ran")

    monkeypatch.setattr(sample_index_module, "build_sample_index_numpy", refuse)
    lengths = numpy.array([5, 3, 9], dtype=numpy.int32)
    documents = numpy.array([2, 0, 1, 1, 0, 2], dtype=numpy.int32)
    expected = [[0, 0], [0, 4], [0, 8], [1, 3], [2, 2], [4, 0], [4, 4], [5, 3], [5, 7]]
    assert build_sample_index(lengths, documents, 4, 2, 17).tolist() == expected
    with pytest.raises(AssertionError, match="fallback ran"):
        sample_index_module.sample_index(lengths, documents, 4, 2, 17, native=False)


def test_sample_index_other_integer_dtypes(compiled):
    rng = numpy.random.default_rng(5)
    lengths = rng.integers(0, 300, 500).astype(numpy.int64)
    documents = numpy.tile(numpy.arange(500, dtype=numpy.uint32), 3)
    rng.shuffle(documents)
    args = (lengths, documents, 64, 3, int(lengths.sum()), False, 1)
    expected = build_sample_index_numpy(*args)
    numpy.testing.assert_array_equal(sample_index_module.sample_index(*args, native=True), expected)
    assert sample_index_module.sample_index(*args, native=True).dtype == expected.dtype


@FAST
@given(weights=weight_lists(), size=st.integers(0, 5000))
def test_blending_compiled_equals_python(compiled, weights, size):
    fast = blend.blending_indices(weights, size, native=True)
    slow = blend.blending_indices(weights, size, native=False)
    for a, b, dtype in zip(fast, slow, (numpy.int16, numpy.int64), strict=True):
        assert a.dtype == b.dtype == dtype and a.shape == (size,)
        numpy.testing.assert_array_equal(a, b)


@FAST
@given(sizes=st.lists(st.one_of(st.just(0), st.integers(0, 5000)), min_size=0, max_size=6))
def test_exhaustive_compiled_equals_python(compiled, sizes):
    fast = blend.exhaustive_blending_indices(numpy.asarray(sizes, dtype=numpy.int64), native=True)
    slow = blend.exhaustive_blending_indices(numpy.asarray(sizes, dtype=numpy.int64), native=False)
    for a, b, dtype in zip(fast, slow, (numpy.int16, numpy.int64), strict=True):
        assert a.dtype == b.dtype == dtype and a.shape == (sum(sizes),)
        numpy.testing.assert_array_equal(a, b)
    ids, samples = fast
    # Every dataset gives exactly its samples, in order.
    for d, size in enumerate(sizes):
        numpy.testing.assert_array_equal(samples[ids == d], numpy.arange(size))


# --------------------------------------------------------------------------- equal to megatron-core


@pytest.mark.oracle
@FAST
@given(args=gpt_inputs())
def test_sample_index_equals_megatron(helpers, args):
    lengths, documents, seq_length, epochs, tokens_per_epoch, drop_last, extra = args
    assume(seq_length > 1 and tokens_per_epoch > 1)  # megatron asserts both
    theirs = helpers.build_sample_idx_int32(lengths, documents, seq_length, epochs, tokens_per_epoch, drop_last, extra)
    ours = sample_index_module.sample_index(*args)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    # Known difference: when document_index starts with empty sequences megatron's row 0 is (0, 0),
    # the NumPy version (and so the kernel) skips them. The tokens read are the same.
    first = 0 if lengths[documents[0]] > 0 else 1
    numpy.testing.assert_array_equal(ours[first:], theirs[first:])


@pytest.mark.oracle
def test_sample_index_equals_megatron_large(helpers, compiled):
    rng = numpy.random.RandomState(1234)
    lengths = (rng.geometric(1 / 500, 20_000) - 1).astype(numpy.int32)  # some empty sequences
    documents = numpy.tile(numpy.arange(20_000, dtype=numpy.int32), 7)
    rng.shuffle(documents)
    start = 0 if lengths[documents[0]] > 0 else 1  # see test_sample_index_equals_megatron
    for drop_last in (True, False):
        for extra in (0, 1):
            args = (lengths, documents, 2048, 7, int(lengths.sum()), drop_last, extra)
            ours = sample_index_module.sample_index(*args, native=True)
            numpy.testing.assert_array_equal(ours[start:], helpers.build_sample_idx_int32(*args)[start:])
            wide = sample_index_module._sample_index_compiled(kernels.library(), *args, ours.shape[0] - 1, numpy.int64)
            numpy.testing.assert_array_equal(wide[start:], helpers.build_sample_idx_int64(*args)[start:])


def _megatron_blending(helpers, weights, size):
    ids = numpy.empty(size, dtype=numpy.int16)
    samples = numpy.empty(size, dtype=numpy.int64)
    helpers.build_blending_indices(ids, samples, weights, weights.size, size, False)
    return ids, samples


@pytest.mark.oracle
@FAST
@given(weights=weight_lists(positive=True), size=st.integers(0, 5000))
def test_blending_equals_megatron(helpers, weights, size):
    theirs = _megatron_blending(helpers, weights, size)
    for a, b in zip(blend.blending_indices(weights, size), theirs, strict=True):
        numpy.testing.assert_array_equal(a, b)


@pytest.mark.oracle
@pytest.mark.parametrize("k", [2, 10, 100])
def test_blending_equals_megatron_long(helpers, compiled, k):
    weights = numpy.random.default_rng(k).random(k)
    weights /= weights.sum()
    theirs = _megatron_blending(helpers, weights, 200_000)
    for a, b in zip(blend.blending_indices(weights, 200_000, native=True), theirs, strict=True):
        numpy.testing.assert_array_equal(a, b)


@pytest.mark.oracle
@FAST
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=6))
def test_exhaustive_equals_megatron(helpers, sizes):
    sizes = numpy.asarray(sizes, dtype=numpy.int64)
    ids = numpy.empty(sizes.sum(), dtype=numpy.int16)
    samples = numpy.empty(sizes.sum(), dtype=numpy.int64)
    helpers.build_exhaustive_blending_indices(ids, samples, sizes, sizes.size)
    ours = blend.exhaustive_blending_indices(sizes)
    numpy.testing.assert_array_equal(ours[0], ids)
    numpy.testing.assert_array_equal(ours[1], samples)


def test_exhaustive_zero_sizes_drop_out():
    """A dataset of size zero is never picked; the others blend as if it were not there."""
    with_zero = blend.exhaustive_blending_indices(numpy.array([0, 40, 0, 25, 0]))
    without = blend.exhaustive_blending_indices(numpy.array([40, 25]))
    numpy.testing.assert_array_equal(with_zero[0], numpy.array([1, 3])[without[0]])
    numpy.testing.assert_array_equal(with_zero[1], without[1])
    for native in (None, False):
        ids, samples = blend.exhaustive_blending_indices(numpy.zeros(3, dtype=numpy.int64), native=native)
        assert ids.shape == samples.shape == (0,) and ids.dtype == numpy.int16


# --------------------------------------------------------------------------- installed library, private fallback


@pytest.fixture
def private(reloaded):
    """As if the package had been installed without its kernels: the private build's turn."""
    reloaded.setattr(kernels, "_INSTALLED", "statefulset.index._not_installed")
    return reloaded


def test_installed_kernels_are_in_use(compiled):
    """pip install (-e) builds the kernels into the package (setup.py): no compiler at job start."""
    installed = kernels._installed()
    assert installed is not None, f"no {kernels._INSTALLED}: build it with {kernels._REBUILD}"
    assert installed.parent == Path(kernels.__file__).parent
    assert kernels.origin() == installed, kernels.origin()


def test_fresh_folder_gets_one_library(private, tmp_path):
    folder = tmp_path / "cache"
    private.setenv("STATEFULSET_KERNEL_DIR", str(folder))
    assert kernels.available(), kernels.reason()
    assert kernels.origin().parent == folder
    assert sorted(p.suffix for p in folder.iterdir()) == [".sha256", ".so"]
    assert folder.stat().st_mode & 0o777 == 0o700
    kernels._reset()
    assert kernels.available()  # reuses the file
    assert len(list(folder.iterdir())) == 2


def test_edited_source_recompiles(private, tmp_path):
    folder = tmp_path / "cache"
    private.setenv("STATEFULSET_KERNEL_DIR", str(folder))
    assert kernels.available(), kernels.reason()
    edited = tmp_path / "kernels.c"
    edited.write_bytes(kernels._SOURCE.read_bytes() + b"\n/* edited */\n")
    private.setattr(kernels, "_SOURCE", edited)
    kernels._reset()
    assert kernels.available()
    assert len(list(folder.glob("*.so"))) == 2


def test_installed_library_of_another_source_is_not_used(compiled, reloaded, tmp_path, caplog):
    """An editable checkout whose kernels.c changed since its build runs the new source, not the old library."""
    assert kernels._installed() is not None, f"no {kernels._INSTALLED}: build it with {kernels._REBUILD}"
    folder = tmp_path / "cache"
    reloaded.setenv("STATEFULSET_KERNEL_DIR", str(folder))
    edited = tmp_path / "kernels.c"
    edited.write_bytes(kernels._SOURCE.read_bytes() + b"\n/* edited */\n")
    reloaded.setattr(kernels, "_SOURCE", edited)
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        assert kernels.available(), kernels.reason()
    assert kernels.origin().parent == folder
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "built from another kernels.c" in warnings[0] and str(folder) in warnings[0]


def test_disabled_by_environment(reloaded, caplog):
    reloaded.setenv("STATEFULSET_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger="statefulset"):
        assert not kernels.available()
        assert not kernels.available()
        ids, _ = blend.blending_indices([0.7, 0.3], 10)
    assert ids.tolist() == [0, 1, 0, 0, 1, 0, 0, 1, 0, 0]
    messages = [r.getMessage() for r in caplog.records if "compiled kernels unavailable" in r.getMessage()]
    assert len(messages) == 1 and "STATEFULSET_KERNELS" in messages[0]
    with pytest.raises(StatefulsetError, match="unavailable"):
        blend.blending_indices([1.0], 3, native=True)


@pytest.mark.parametrize("problem", ["no compiler", "unwritable cache"])
def test_falls_back_when_building_fails(private, tmp_path, caplog, problem):
    """Without installed kernels and without a build, the Python versions run: the same result, and one WARNING."""
    if problem == "no compiler":
        private.setenv("STATEFULSET_KERNEL_DIR", str(tmp_path / "cache"))
        private.setenv("CC", str(tmp_path / "no-such-cc"))
    else:
        (tmp_path / "file").write_text("")
        private.setenv("STATEFULSET_KERNEL_DIR", str(tmp_path / "file" / "cache"))
    with caplog.at_level(logging.INFO, logger="statefulset"):
        assert not kernels.available()
        lengths = numpy.array([5, 3, 9], dtype=numpy.int32)
        documents = numpy.array([2, 0, 1, 1, 0, 2], dtype=numpy.int32)
        args = (lengths, documents, 4, 2, 17)
        numpy.testing.assert_array_equal(build_sample_index(*args), build_sample_index_numpy(*args))
        assert not kernels.available()
    found = [r for r in caplog.records if "compiled kernels unavailable" in r.getMessage()]
    assert len(found) == 1 and found[0].levelno == logging.WARNING, found
    assert "10-100x slower" in found[0].getMessage()


CHILD = """
import hashlib, sys, time, types
from pathlib import Path
# Import the kernels without the package __init__ (which imports torch: seconds per process).
package = types.ModuleType("statefulset")
package.__path__ = [sys.argv[1]]
sys.modules["statefulset"] = package
import numpy
from statefulset.index import compiled as kernels
from statefulset.index.megatron import blend
kernels._INSTALLED = "statefulset.index._not_installed"  # the private build's turn
# Start compiling together: wait until every child is ready.
ready = Path(sys.argv[2])
(ready / str(time.time_ns())).touch()
deadline = time.monotonic() + 60
while len(list(ready.iterdir())) < int(sys.argv[3]) and time.monotonic() < deadline:
    time.sleep(0.005)
assert kernels.available(), kernels._state["reason"]
ids, samples = blend.blending_indices(numpy.array([0.5, 0.3, 0.2]), 100_000)
print(Path(kernels._state["lib"]._name).name, hashlib.sha256(ids.tobytes() + samples.tobytes()).hexdigest())
"""


def test_concurrent_builds_agree(compiled, tmp_path):
    folder, ready, count = tmp_path / "shared", tmp_path / "ready", 6
    ready.mkdir()
    env = {**os.environ, "STATEFULSET_KERNEL_DIR": str(folder)}
    env.pop("STATEFULSET_KERNELS", None)
    package = str(Path(kernels.__file__).parent.parent)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, package, str(ready), str(count)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(count)
    ]
    outputs = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err.decode()
        outputs.append(out.decode().strip())
    assert len(set(outputs)) == 1, outputs
    library = outputs[0].split()[0]
    assert sorted(p.name for p in folder.iterdir()) == [library.replace(".so", ".sha256"), library]  # no temporaries
    ids, samples = blend.blending_indices(numpy.array([0.5, 0.3, 0.2]), 100_000, native=False)
    assert outputs[0].split()[1] == hashlib.sha256(ids.tobytes() + samples.tobytes()).hexdigest()


# --------------------------------------------------------------------------- native kernels == NumPy
# Machines with and without a C compiler must serve the same data: the compiled Feistel rounds and
# window order equal the pure NumPy arithmetic bit for bit, and whole streams agree.


@FAST
@given(st.integers(1, 2**50), st.integers(0, 2**64 - 1), st.lists(st.integers(0, 2**50), min_size=1, max_size=40))
def test_compiled_feistel_equals_the_numpy_rounds(compiled, n, key, picks):
    perm = KeyedPermutation(n, key)
    x = numpy.array([p % n for p in picks], dtype=numpy.int64)
    forward = perm(x)
    assert numpy.array_equal(forward, perm._numpy(x))
    assert numpy.array_equal(perm.inverse(forward), x)
    assert numpy.array_equal(perm._numpy_inverse(forward), x)


@FAST
@given(st.integers(1, 2**40), st.integers(0, 2**64 - 1), st.lists(st.integers(0, 2**52), min_size=1, max_size=40))
def test_compiled_window_order_equals_numpy(compiled, windows, key, picks):
    local = numpy.array(picks, dtype=numpy.int64)
    ours = compiled_window_permute(local, windows, half_bits(windows), key, ROUNDS)
    epochs, offsets = numpy.divmod(local, windows)
    expected = [
        int(KeyedPermutation(windows, derive_key(key, int(e)))._numpy(numpy.array([int(j)]))[0])
        for e, j in zip(epochs.tolist(), offsets.tolist(), strict=True)
    ]
    assert ours.tolist() == expected


@pytest.mark.parametrize("packing", ["native", "megatron"])
def test_streams_are_the_same_without_kernels(compiled, reloaded, tmp_path, packing):
    prefixes = write_printable_shards(tmp_path, documents=(300, 120))
    spec = {
        "data_path": {prefixes[0]: 0.6, prefixes[1]: 0.4},
        "seq_length": 16,
        "split": "90,10,0",
        "packing": packing,
        "num_samples": 3000,
    }

    def everything() -> numpy.ndarray:
        stream = open_stream(spec)
        return stream.gather(numpy.arange(3000))  # native: three epochs and more

    with_kernels = everything()
    reloaded.setenv("STATEFULSET_KERNELS", "0")
    kernels._reset()
    assert not kernels.available()
    numpy.testing.assert_array_equal(everything(), with_kernels)


# --------------------------------------------------------------------------- bad input


GOOD = (numpy.array([5, 3, 9], dtype=numpy.int32), numpy.array([2, 0, 1, 1, 0, 2], dtype=numpy.int32), 4, 2, 17)


@pytest.mark.parametrize("native", [None, False])
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({1: numpy.array([2, 0, 3, 1, 0, 2], dtype=numpy.int32)}, r"document_index\[2\] = 3 is outside"),
        ({1: numpy.array([2, 0, 1, 1, 0, -1], dtype=numpy.int32)}, r"document_index\[5\] = -1 is outside"),
        ({1: numpy.array([2, 0, 1, 1, 0, 2], dtype=numpy.int64) + 5}, "outside"),
        ({1: numpy.array([], dtype=numpy.int32)}, "empty"),
        ({1: numpy.array([2.0, 0.0])}, "integer array"),
        ({1: numpy.array([[2, 0]], dtype=numpy.int32)}, "1-D"),
        ({1: numpy.array([True, False])}, "integer array"),
        ({0: numpy.array([5, -3, 9], dtype=numpy.int32)}, "negative"),
        ({0: numpy.array([], dtype=numpy.int32)}, "cannot hold"),
        ({2: 0}, "seq_length"),
        ({2: 2**31}, "seq_length"),
        ({2: 4.0}, "seq_length must be an integer"),
        ({3: 0}, "epochs"),
        ({4: 0}, "tokens_per_epoch"),
        ({4: 18}, "holds 34 tokens"),
        ({4: 16}, "holds 34 tokens"),
        ({4: 10**6}, "cannot hold"),
        ({4: 2**60}, "2\\*\\*53"),
        ({"extra": 2}, "extra"),
        ({"extra": -1}, "extra"),
    ],
)
def test_sample_index_bad_input(native, change, message):
    args = list(GOOD)
    kwargs = {}
    for key, value in change.items():
        if isinstance(key, int):
            args[key] = value
        else:
            kwargs[key] = value
    with pytest.raises(StatefulsetError, match=message):
        sample_index_module.sample_index(*args, native=native, **kwargs)


def test_sample_index_one_token_total():
    """The smallest valid stream: one token and no extra."""
    out = sample_index_module.sample_index(
        numpy.array([1], dtype=numpy.int32), numpy.array([0], dtype=numpy.int32), 2, 1, 1, False, 0
    )
    numpy.testing.assert_array_equal(
        out, build_sample_index_numpy(numpy.array([1]), numpy.array([0]), 2, 1, 1, False, 0)
    )


@pytest.mark.parametrize("native", [None, False])
@pytest.mark.parametrize(
    ("weights", "size", "message"),
    [
        ([], 5, "1 to 32767"),
        ([[0.5, 0.5]], 5, "1-D"),
        ([0.5, float("nan")], 5, "finite"),
        ([0.5, float("inf")], 5, "finite"),
        ([0.5, -0.1], 5, "non-negative"),
        (["a", "b"], 5, "numbers"),
        ([1.0] * 32768, 5, "1 to 32767"),
        ([0.5, 0.5], -1, "size"),
        ([0.5, 0.5], 2.5, "size must be an integer"),
    ],
)
def test_blending_bad_input(native, weights, size, message):
    with pytest.raises(StatefulsetError, match=message):
        blend.blending_indices(weights, size, native=native)


@pytest.mark.parametrize("native", [None, False])
@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (numpy.array([3, -1]), "non-negative"),
        (numpy.array([3.0, 1.0]), "integer array"),
        (numpy.array([[3, 1]]), "1-D"),
        (numpy.ones(32768, dtype=numpy.int64), "at most 32767"),
        (numpy.array([2**62, 2**62]), "too large"),
    ],
)
def test_exhaustive_bad_input(native, sizes, message):
    with pytest.raises(StatefulsetError, match=message):
        blend.exhaustive_blending_indices(sizes, native=native)


def _load_kernels_and_exit() -> None:
    os._exit(0 if kernels.library() is not None else 3)


def test_a_process_forked_while_another_thread_loads_the_kernels_loads_them_itself():
    """A fork copies only the forking thread: DataLoader workers forked by one trainer thread while
    another thread was loading the kernels (its first batch: two ranks of a torchft replica group as
    threads) must not inherit the loading lock held, or their first batch waits forever (seen: a
    worker of tests/test_torchft.py's replica group stalled on micro-batch 0). Gated: the other thread
    holds the lock for the whole fork."""
    import multiprocessing
    import threading

    kernels._reset()
    holding, release = threading.Event(), threading.Event()

    def loading() -> None:
        with kernels._lock:  # where library() is while it loads
            holding.set()
            release.wait(120)

    thread = threading.Thread(target=loading)
    thread.start()
    child = None
    try:
        assert holding.wait(60), "the loading thread did not take the lock within 60 s"
        child = multiprocessing.get_context("fork").Process(target=_load_kernels_and_exit)
        child.start()
        child.join(60)
        assert child.exitcode == 0, f"the forked child did not load the kernels within 60 s (exit {child.exitcode})"
    finally:
        release.set()
        thread.join(60)
        if child is not None and child.is_alive():
            child.kill()
            child.join(30)
        kernels.library()


# --------------------------------------------------------------------------- numpy's legacy shuffle


@pytest.mark.parametrize("n", [0, 1, 2, 5, 623, 624, 625, 1249, 100_003])
@pytest.mark.parametrize("dtype", [numpy.int32, numpy.uint32, numpy.int64])
def test_legacy_shuffle_is_numpys(compiled, n, dtype):
    """The kernel's shuffle is RandomState.shuffle's, item for item, and leaves the generator where numpy
    does (mid-block positions included: draws before it), so the draws after it (megatron-core's next
    shuffle) agree too."""
    from statefulset.index.megatron.gpt import legacy_shuffle

    for seed, before in [(1234, 0), (7, 3), (0, 700)]:
        ours, theirs = numpy.random.RandomState(seed), numpy.random.RandomState(seed)
        ours.random_sample(before)
        theirs.random_sample(before)
        mine, expected = numpy.arange(n, dtype=dtype), numpy.arange(n, dtype=dtype)
        legacy_shuffle(ours, mine)
        theirs.shuffle(expected)
        assert mine.dtype == expected.dtype
        numpy.testing.assert_array_equal(mine, expected)
        left, right = ours.get_state(), theirs.get_state()
        assert left[0] == right[0] and left[2:] == right[2:]
        numpy.testing.assert_array_equal(left[1], right[1])
        assert ours.randint(0, 2**31, 8).tolist() == theirs.randint(0, 2**31, 8).tolist()


def test_legacy_shuffle_leaves_other_arrays_to_numpy(compiled):
    """Strided, 2-D, float or 2-byte arrays go through rng.shuffle itself: the same result either way."""
    from statefulset.index.megatron.gpt import legacy_shuffle

    for make in (
        lambda: numpy.arange(40, dtype=numpy.int32)[::2],
        lambda: numpy.arange(40, dtype=numpy.int64).reshape(10, 4),
        lambda: numpy.arange(40, dtype=numpy.float64),
        lambda: numpy.arange(40, dtype=numpy.int16),
    ):
        ours, theirs = numpy.random.RandomState(5), numpy.random.RandomState(5)
        mine, expected = make(), make()
        legacy_shuffle(ours, mine)
        theirs.shuffle(expected)
        numpy.testing.assert_array_equal(mine, expected)
