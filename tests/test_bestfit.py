"""packing: bestfit: whole documents, every token once per epoch, padding marked, O(1) open and restore.

The corpus's tokens say where they come from (``sequence * STRIDE + offset``), so every property is
checked on the samples themselves: which document each run of tokens belongs to and where in it.
"""

from __future__ import annotations

import collections
import subprocess
import sys

import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statefulset import IndexedDatasetWriter, get_train_dataset
from statefulset.errors import StatefulsetError
from statefulset.index.bestfit import source as source_module
from statefulset.index.bestfit.packing import count_bins, pack_window, split_documents, window_entries
from statefulset.index.cache import builds
from statefulset.spec.model import load_spec
from statefulset.streams.opening import open_stream

STRIDE = 100_000
CODE_BASE = 10**9  # the second shard's tokens: told apart from the first's
SEQ = 64


def write_corpus(prefix: str, lengths: list[int], dtype=numpy.int32, base: int = 0) -> None:
    with IndexedDatasetWriter(prefix, dtype) as w:
        for i, n in enumerate(lengths):
            tokens = base + i * STRIDE + numpy.arange(n) if dtype == numpy.int32 else numpy.arange(n)
            w.add_document(tokens.astype(dtype))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Geometric lengths (mean 30), some empty, some several samples long, one exactly a sample."""
    root = tmp_path_factory.mktemp("bestfit")
    rng = numpy.random.default_rng(5)
    lengths = [int(rng.geometric(1 / 30)) for _ in range(1500)]
    lengths[::97] = [int(rng.integers(SEQ + 2, 4 * SEQ)) for _ in lengths[::97]]
    lengths[5], lengths[6], lengths[7] = 0, SEQ + 1, 2 * (SEQ + 1)
    write_corpus(str(root / "web"), lengths)
    write_corpus(str(root / "code"), [int(rng.geometric(1 / 80)) for _ in range(400)], base=CODE_BASE)
    return root, lengths


def spec_for(root, **changes):
    return {"data_path": str(root / "web"), "seq_length": SEQ, "split": "1", "packing": "bestfit",
            "path_to_cache": str(root / "cache"), **changes}  # fmt: skip


def runs(row: numpy.ndarray, pad_id: int = -1) -> list[tuple[int, int, int]]:
    """(sequence, first offset, length) of each run of consecutive tokens of one sequence."""
    out = []
    for token in row.tolist():
        if token == pad_id:
            continue
        seq, offset = divmod(token, STRIDE)
        if out and out[-1][0] == seq and out[-1][1] + out[-1][2] == offset:
            out[-1] = (seq, out[-1][1], out[-1][2] + 1)
        else:
            out.append((seq, offset, 1))
    return out


@pytest.fixture(params=["one window", "many windows"])
def windows(request, monkeypatch):
    """The default (a window holds this small corpus whole) and windows of ~8 samples (~20 documents)."""
    if request.param == "many windows":
        monkeypatch.setattr(source_module, "WINDOW_SAMPLES", 8)
        monkeypatch.setattr(source_module, "_MIN_WINDOW", 4)
    return request.param


def test_one_epoch_holds_every_token_once_and_never_cuts_a_fitting_document(corpus, windows):
    root, lengths = corpus
    stream = open_stream(spec_for(root))
    assert (stream.sources[0].bins.size > 10) == (windows == "many windows")
    n = stream.samples_per_epoch
    capacity = SEQ + 1
    epochs = []
    for e in range(2):
        text = stream.gather(numpy.arange(e * n, (e + 1) * n))
        seen = collections.defaultdict(list)
        for row in text:
            real = row[row != -1]
            assert (row[: real.size] == real).all(), "padding only at the end of a sample"
            for seq, offset, length in runs(row):
                seen[seq].append((offset, length))
        for seq, length in enumerate(lengths):
            pieces = sorted(seen.get(seq, []))
            assert sum(p[1] for p in pieces) == length, seq  # every token, once
            if 0 < length <= capacity:
                assert pieces == [(0, length)], f"document {seq} ({length} tokens) was cut"
            elif length > capacity:
                full = [p for p in pieces if p[1] == capacity]
                assert len(full) == length // capacity  # cut into pieces that fill a sample each
        epochs.append(text)
    assert not numpy.array_equal(epochs[0], epochs[1])  # another order each epoch
    assert sorted(map(bytes, epochs[0])) == sorted(map(bytes, epochs[1]))  # the same samples
    padding = (epochs[0] == -1).mean()
    assert padding < (0.1 if windows == "many windows" else 0.002), padding  # tiny windows pad more


def test_loss_mask_marks_real_labels_and_pad_id_is_kept(corpus, windows):
    root, _ = corpus
    ds = get_train_dataset(spec_for(root, pad_id=-7), batch_size=2, document_boundaries=True)
    padded = 0
    for p in range(ds.stream.samples_per_epoch):  # an epoch holds every padded bin (few: best fit)
        sample = ds[p]
        text, mask = sample["text"], sample["loss_mask"]
        assert mask.dtype == numpy.float32 and mask.shape == (SEQ,)
        numpy.testing.assert_array_equal(mask, (text[1:] != -7).astype(numpy.float32))
        padded += int((text == -7).any())
        # cu_seqlens starts a segment at every document start in the input tokens.
        starts = {0} | {i for i in range(1, SEQ) if text[i] != text[i - 1] + 1 and text[i] != -7}
        starts |= {i for i in range(1, SEQ) if text[i] == -7 and text[i - 1] != -7}
        cu = sample["cu_seqlens"]
        assert set(cu[cu < SEQ].tolist()) == starts
    assert padded > 0


@pytest.mark.parametrize(
    ("pad_id", "dtype", "refused"),
    [(0, numpy.uint16, True), (65535, numpy.uint16, True), (65536, numpy.uint16, False), (-1, numpy.uint16, False),
     (5, numpy.int32, True), (2**31, numpy.int32, False)],
)  # fmt: skip
def test_a_pad_id_the_shards_can_hold_is_refused(tmp_path, pad_id, dtype, refused):
    write_corpus(str(tmp_path / "s"), [40] * 50, dtype)
    spec = {"data_path": str(tmp_path / "s"), "seq_length": 16, "packing": "bestfit", "pad_id": pad_id}
    if refused:
        with pytest.raises(
            StatefulsetError, match=rf"key 'pad_id'.*{pad_id} is a token id of .*s \({numpy.dtype(dtype)}"
        ):
            open_stream(spec)
    else:
        stream = open_stream(spec)
        assert numpy.can_cast(numpy.min_scalar_type(pad_id), stream.token_dtype)
        assert stream.gather(numpy.arange(50)).min() >= min(pad_id, 0)


def test_pad_id_belongs_to_bestfit_only(tmp_path):
    write_corpus(str(tmp_path / "s"), [40] * 50)
    with pytest.raises(StatefulsetError, match=r"key 'pad_id'.*packing native"):
        load_spec({"data_path": str(tmp_path / "s"), "seq_length": 16, "packing": "native", "pad_id": -1})


def test_opening_is_o1_once_the_bins_are_cached(corpus):
    root, _ = corpus
    spec = spec_for(root, seed=99)
    before = builds.get("BestFitIndex", 0)
    first = open_stream(spec)
    assert builds.get("BestFitIndex", 0) == before + 1
    again = open_stream(spec)
    assert builds.get("BestFitIndex", 0) == before + 1  # loaded, not rebuilt
    assert again.fingerprint == first.fingerprint
    far = numpy.array([10**12, 3 * 10**9 + 5])  # a restore is a seek: any position, no pass
    numpy.testing.assert_array_equal(again.gather(far), first.gather(far))


def test_prepare_builds_the_bins(corpus, tmp_path):
    root, _ = corpus
    import yaml

    spec = spec_for(root, seed=4242, path_to_cache=str(tmp_path / "cache"))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    run = subprocess.run([sys.executable, "-m", "statefulset", "prepare", str(tmp_path / "spec.yaml"), "--quiet"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    before = builds.get("BestFitIndex", 0)
    open_stream(spec)
    assert builds.get("BestFitIndex", 0) == before


def test_a_blend_draws_each_source_by_weight(corpus):
    root, _ = corpus
    spec = spec_for(root, data_path={str(root / "web"): 0.75, str(root / "code"): 0.25})
    text = open_stream(spec).gather(numpy.arange(4000))
    from_web = text[:, 0] < CODE_BASE
    assert abs(from_web.mean() - 0.75) < 0.01


def test_samples_per_epoch_is_for_one_source(corpus):
    root, _ = corpus
    blend = open_stream(spec_for(root, data_path={str(root / "web"): 1, str(root / "code"): 1}))
    with pytest.raises(StatefulsetError, match=r"blends 2 sources, each with epochs of its own.*stream.epoch_sizes"):
        _ = blend.samples_per_epoch
    assert blend.epoch_sizes == {s.dataset.path_prefix: s.windows for s in blend.sources}


# -- the packing itself ----------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 300).flatmap(lambda c: st.tuples(st.just(c), st.lists(st.integers(0, c), max_size=300))))
def test_window_packing_is_a_best_fit_and_both_implementations_agree(case):
    capacity, sizes = case
    sizes = numpy.array(sizes, dtype=numpy.int64)
    bin_of, bins = pack_window(sizes, capacity, native=False)
    compiled_bin_of, compiled_bins = pack_window(sizes, capacity)
    assert bins == compiled_bins and numpy.array_equal(bin_of, compiled_bin_of)
    assert ((bin_of >= 0) == (sizes > 0)).all()  # every item placed once, empty ones nowhere
    content = numpy.bincount(bin_of[bin_of >= 0], weights=sizes[bin_of >= 0], minlength=bins)
    assert (content <= capacity).all() and (content > 0).all()
    # Any-fit: a bin is opened only when the item fits nowhere, so no two bins could be merged.
    if bins > 1:
        ordered = numpy.sort(content)
        assert ordered[0] + ordered[1] > capacity
    assert bins >= -(-int(sizes.sum()) // capacity)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 500), max_size=400), st.integers(1, 64), st.integers(1, 200))
def test_counting_windows_equals_packing_each(lengths, window, capacity):
    full, rest = split_documents(numpy.array(lengths, dtype=numpy.int64), capacity)
    assert ((full * capacity + rest) == numpy.array(lengths, dtype=numpy.int64)).all()
    assert (rest <= capacity).all()
    counts = count_bins(rest, window, capacity)
    assert (counts == count_bins(rest, window, capacity, native=False)).all()
    expected = [pack_window(rest[j : j + window], capacity)[1] for j in range(0, len(lengths), window)]
    assert counts.tolist() == expected


def test_a_state_is_refused_by_a_loader_with_another_pad_id_or_packing(corpus):
    from statefulset import get_savable_loader

    root, _ = corpus
    loader = get_savable_loader(get_train_dataset(spec_for(root), batch_size=2))
    next(iter(loader))
    state = loader.save_state_rank()
    assert state["identity"]["pad_id"] == -1
    other = get_savable_loader(get_train_dataset(spec_for(root, pad_id=-7), batch_size=2))
    with pytest.raises(StatefulsetError, match=r"pad_id: state has -1, this loader -7"):
        other.restore_state_rank(state)
    native = get_savable_loader(get_train_dataset(spec_for(root, packing="native"), batch_size=2))
    with pytest.raises(StatefulsetError, match=r"packing: state has 'bestfit', this loader 'native'.*pad_id"):
        native.restore_state_rank(state)


def test_explain_names_the_documents_of_a_sample_and_inspect_shows_the_shares(corpus, windows):
    root, _ = corpus
    ds = get_train_dataset(spec_for(root, data_path={str(root / "web"): 0.75, str(root / "code"): 0.25}), batch_size=1)
    for p in (0, 5, 999, 10**10 + 3):
        found = ds.explain(p)
        text = ds[p]["text"]
        real = text[text != -1]
        from statefulset import IndexedDataset

        dataset = IndexedDataset(found.source)
        tokens = numpy.concatenate([piece.read(dataset) for piece in found.pieces])
        numpy.testing.assert_array_equal(tokens, real)
        assert (
            found.packing == "bestfit"
            and found.epoch == found.local_sample // ds.stream.sources[found.source_index].samples_per_epoch
        )
    from statefulset.streams.overview import describe

    overview = describe(ds.stream)
    assert [round(s.share, 2) for s in overview.sources] == [0.75, 0.25]
    assert [s.samples_per_epoch for s in overview.sources] == [s.samples_per_epoch for s in ds.stream.sources]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 200).flatmap(lambda c: st.tuples(st.just(c), st.lists(st.integers(0, c), max_size=300))))
def test_window_entries_list_each_bin_in_placement_order(case):
    capacity, sizes = case
    sizes = numpy.array(sizes, dtype=numpy.int64)
    bin_of, bins = pack_window(sizes, capacity)
    for native in (True, False):
        entries, bin_end = window_entries(sizes, capacity, native=native)
        assert bin_end.size == bins and (bins == 0 or int(bin_end[-1]) == entries.size)
        starts = numpy.concatenate([[0], bin_end[:-1]]).astype(numpy.int64)
        for b in range(bins):
            items = entries[starts[b] : bin_end[b]].astype(numpy.int64)
            assert (bin_of[items] == b).all()
            assert [(-int(sizes[i]), int(i)) for i in items] == sorted((-int(sizes[i]), int(i)) for i in items)
        assert sorted(entries.tolist()) == numpy.flatnonzero(sizes > 0).tolist()
