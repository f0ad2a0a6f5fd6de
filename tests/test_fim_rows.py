"""FillInTheMiddle's compiled micro-batch path (statefulset.transforms.fim_rows, ``sf_fim_rows``) equals
``encode_sample`` per sample, field for field, over thousands of random samples: PSM and SPM,
``split_sample`` with fragment rates, ``no_prefix``, EOD segments, bestfit padding and loss masks,
document fields; and through the loader's workers it gives what ``ds[p]`` gives with every packing.
"""

from __future__ import annotations

import numpy
import pytest

from statefulset import IndexedDatasetWriter, WorkerConfig, get_savable_loader, get_train_dataset
from statefulset.index import compiled
from statefulset.streams.documents import Pieces, document_fields
from statefulset.transforms import FillInTheMiddle, TokenSample
from statefulset.transforms.fim_draws import inversion_constants
from statefulset.transforms.keyed import keyed_generator

P, M, S, PAD, EOD, SPLIT, NO_PREFIX = 1001, 1002, 1003, 1004, 3, 7, 5
FIELDS = ("text", "loss_mask", "cu_seqlens", "max_seqlen", "position_ids")

pytestmark = pytest.mark.skipif(not compiled.available(), reason="the compiled kernels are not built")


def _rows(rs: numpy.random.RandomState, count: int, width: int, fields: bool, varied: bool) -> dict:
    """A micro-batch as the loader builds it: short and long segments, EOD, split and no-prefix tokens;
    with ``fields``, bestfit padding, a loss mask (``varied``: some labels without loss) and documents."""
    text = rs.randint(8, 250, size=(count, width)).astype(numpy.int64)
    for row in text:
        row[rs.randint(0, width, size=rs.randint(0, max(2, width // 30)))] = EOD
        row[rs.randint(0, width, size=rs.randint(0, max(2, width // 50)))] = SPLIT
        if rs.rand() < 0.3:
            row[: rs.randint(1, 4)] = NO_PREFIX
    if not fields:
        return {"text": text}
    mask = numpy.ones((count, width - 1), numpy.float32)
    lengths, counts = [], []
    for r in range(count):
        padding = rs.randint(0, max(1, width // 4)) if rs.rand() < 0.5 else 0
        if padding:
            text[r, width - padding :] = -1
            mask[r, width - 1 - padding :] = 0.0
        if varied:
            mask[r, rs.rand(width - 1) < 0.2] = 0.0
        content = width - padding
        cuts = sorted({int(c) for c in rs.randint(1, max(2, content - 1), size=rs.randint(0, 8)) if 0 < c < content})
        piece = numpy.diff([0, *cuts, content])
        lengths.append(piece)
        counts.append(piece.size)
    used = numpy.array([width - int((text[r] == -1).sum()) for r in range(count)])
    doc = document_fields(Pieces(numpy.array(counts), numpy.concatenate(lengths), used), width - 1)
    return {"text": text, "loss_mask": mask, **doc}


def _reference(fim: FillInTheMiddle, rows: dict, ids: numpy.ndarray, key: int) -> list[TokenSample]:
    out = []
    for i, sample_id in enumerate(ids.tolist()):
        sample = TokenSample(rows["text"][i].copy(), sample_id, "src")
        for name in FIELDS[1:]:
            if name in rows:
                setattr(sample, name, rows[name][i].copy())
        out.append(fim.encode_sample(sample, keyed_generator(key, sample_id)))
    return out


def _check(fim: FillInTheMiddle, rows: dict, ids: numpy.ndarray, key: int) -> int:
    """The compiled path against the reference; returns how many rows changed."""
    expected = _reference(fim, rows, ids, key)
    got = {name: values.copy() for name, values in rows.items()}
    assert fim.encode_rows_in_place(got, ids, key)
    for i, sample in enumerate(expected):
        for name in rows:
            want = getattr(sample, name)
            assert numpy.array_equal(got[name][i], want), (name, i, int(ids[i]), fim)
            if name != "max_seqlen":
                assert got[name][i].dtype == numpy.asarray(want).dtype
    return int(sum((got["text"][i] != rows["text"][i]).any() for i in range(len(ids))))


CONFIGS = [
    dict(rate=0.5, spm_rate=0.5, eod_id=EOD),
    dict(rate=1.0, spm_rate=0.0),
    dict(rate=1.0, spm_rate=1.0, eod_id=EOD),
    dict(rate=0.9, spm_rate=0.8, eod_id=EOD),
    dict(rate=0.1, spm_rate=0.3, eod_id=EOD),
    dict(rate=0.7, spm_rate=0.5, split_sample=SPLIT, fragment_rate=0.5, eod_id=EOD),
    dict(rate=1.0, spm_rate=0.5, split_sample=SPLIT, fragment_rate=1.0),
    dict(rate=0.8, spm_rate=0.2, split_sample=SPLIT, fragment_rate=0.3, no_prefix=NO_PREFIX, eod_id=EOD),
    dict(rate=1.0, spm_rate=0.5, no_prefix=(NO_PREFIX, NO_PREFIX)),
    dict(rate=0.6, spm_rate=0.5, split_sample=EOD, fragment_rate=0.9),
]


@pytest.mark.parametrize("config", range(len(CONFIGS)))
@pytest.mark.parametrize("fields,varied", [(False, False), (True, False), (True, True)])
def test_compiled_rows_equal_encode_sample(config, fields, varied):
    """~100 samples per case, 30 cases: widths from 2 to 2049, keys above 2**63 included."""
    rs = numpy.random.RandomState(1000 * config + 10 * fields + varied)
    fim = FillInTheMiddle(prefix_id=P, middle_id=M, suffix_id=S, pad_id=PAD, **CONFIGS[config])
    changed = 0
    for width, count in ((2, 8), (3, 8), (17, 24), (160, 40), (2049, 20)):
        ids = rs.randint(0, 2**62, size=count).astype(numpy.int64)
        key = int(rs.randint(0, 2**62)) * 4 + int(rs.randint(0, 4))
        changed += _check(fim, _rows(rs, count, width, fields, varied), ids, key)
    assert changed


def test_rate_zero_and_the_paths_it_does_not_take(monkeypatch):
    """rate 0: nothing changes; tokenizer mode, a subclass's own encode_sample, fields the kernel does not
    know and no compiled kernels: False, nothing changed (the loader encodes per sample)."""
    from statefulset.shards.tokenizers import TokenizerSpec

    rs = numpy.random.RandomState(0)
    rows = _rows(rs, 4, 40, True, False)
    ids = numpy.arange(4, dtype=numpy.int64)
    before = {k: v.copy() for k, v in rows.items()}

    def same() -> bool:
        return all(numpy.array_equal(rows[k], before[k]) for k in rows)

    assert FillInTheMiddle(0.0, 0.5, P, M, S, PAD).encode_rows_in_place(rows, ids, 1) and same()
    tokenizer = FillInTheMiddle(1.0, 0.5, 300, 301, 302, 303, tokenizer=TokenizerSpec())
    assert not tokenizer.encode_rows_in_place(rows, ids, 1) and same()

    class Own(FillInTheMiddle):
        def encode_sample(self, sample, rng):
            return sample

    assert not Own(1.0, 0.5, P, M, S, PAD).encode_rows_in_place(rows, ids, 1) and same()
    fim = FillInTheMiddle(1.0, 0.5, P, M, S, PAD)
    assert not fim.encode_rows_in_place({**rows, "extra": rows["text"].copy()}, ids, 1) and same()
    assert not fim.encode_rows_in_place({"text": rows["text"].astype(numpy.int32)}, ids, 1) and same()
    assert not fim.encode_rows_in_place({"text": rows["text"], "position_ids": rows["position_ids"]}, ids, 1)
    assert same()
    with monkeypatch.context() as m:
        m.setenv("STATEFULSET_KERNELS", "0")
        compiled._reset()
        assert not fim.encode_rows_in_place(rows, ids, 1) and same()
    compiled._reset()
    assert fim.encode_rows_in_place(rows, ids, 1) and not same()


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """Documents whose tokens name them (document k: 100k, 100k+1, ...), EOD 3 ending each."""
    prefix = str(tmp_path_factory.mktemp("fimrows") / "docs")
    with IndexedDatasetWriter(prefix, numpy.int32) as writer:
        for k in range(120):
            n = 2 + (k * 7) % 29
            writer.add_document(numpy.append(numpy.arange(n - 1, dtype=numpy.int32) + 100 * k + 10, EOD), lengths=[n])
    return prefix


@pytest.mark.parametrize(
    "packing,boundaries,workers",
    [*((p, b, 2) for p in ("native", "megatron", "bestfit") for b in (False, True)), ("bestfit", True, 0)],
)
def test_through_the_loader_workers_equal_ds(shard, packing, boundaries, workers):
    """Two workers (the compiled path into the ring), or none (the trainer's own micro_batch), give what
    ``ds[p]`` gives (encode_sample per sample), every field."""
    spec = {"data_path": [shard], "seq_length": 31, "packing": packing, "split": "1", "seed": 5}
    fim = FillInTheMiddle(0.7, 0.5, 90001, 90002, 90003, 90004, split_sample=15, fragment_rate=0.5, eod_id=EOD)
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    ds = get_train_dataset(spec, batch_size=4, worker_config=wc, task_encoder=fim, document_boundaries=boundaries)
    fimmed, seen = 0, []
    for _, batch in zip(range(6), get_savable_loader(ds), strict=False):
        seen += batch["sample_id"].tolist()
        for j, position in enumerate(batch["sample_id"].tolist()):
            row = ds[position]
            for name, value in row.fields().items():
                if name in ("sample_id", "source"):
                    continue
                assert numpy.array_equal(batch[name][j].numpy(), numpy.asarray(value)), (name, position)
            fimmed += int((row.text == 90001).any())
    assert fimmed and seen == list(range(24))


def test_the_kernel_refuses_bad_arguments_before_writing():
    """Widths under 2, negative rows or no-prefix lengths, rates outside [0, 1] or inversion constants that
    could reject forever, too little work space: -1, nothing written."""
    lib = compiled.library()
    text = numpy.arange(12, dtype=numpy.int64).reshape(2, 6)
    ids, prefix = numpy.arange(2, dtype=numpy.int64), numpy.zeros(1, dtype=numpy.int64)
    good = [2, 6, 1, P, M, S, 0, 0, 0, 0, 0]
    rates = numpy.array([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5, *inversion_constants(0.5)])

    work = numpy.zeros(4096, dtype=numpy.int64)
    size = work.size

    def call(params, rate_values=rates) -> int:
        p = numpy.array(params, dtype=numpy.int64)
        r = numpy.array(rate_values, dtype=numpy.float64)
        return lib.sf_fim_rows(p.ctypes.data, r.ctypes.data, ids.ctypes.data, prefix.ctypes.data, text.ctypes.data,
                               None, None, None, None, work.ctypes.data, size)  # fmt: skip

    before = text.copy()
    for params in ([2, 1, *good[2:]], [-1, *good[1:]], [*good[:10], -1]):
        assert call(params) == -1
    for bad in ([1.5, 1.0, 0.0], [0.5, 0.0, 0.0], [0.5, 0.4, 0.6], [float("nan"), 1.0, 0.0]):
        assert call(good, [*bad, *rates[3:]]) == -1
    size = 100  # less work space than six-token rows need
    assert call(good) == -1
    size = work.size
    assert numpy.array_equal(text, before)
    assert call(good) == 0 and not numpy.array_equal(text, before)


def test_sentinels_beyond_the_corpus_dtype_leave_the_ring_and_stay_exact(tmp_path):
    """uint16 tokens, sentinels above 65535: the FIM'd rows do not fit the ring's dtype, so the micro-batch
    travels as the encoder's own collated batch (as_samples, then the default collate), still = ds[p]."""
    prefix = str(tmp_path / "small")
    with IndexedDatasetWriter(prefix, numpy.uint16) as writer:
        for k in range(60):
            n = 3 + (k * 5) % 17
            writer.add_document(numpy.append(numpy.arange(n - 1, dtype=numpy.uint16) + 100 * k + 10, EOD), lengths=[n])
    spec = {"data_path": [prefix], "seq_length": 23, "packing": "native", "split": "1", "seed": 2}
    fim = FillInTheMiddle(0.9, 0.5, 70001, 70002, 70003, 70004, eod_id=EOD)
    wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
    ds = get_train_dataset(spec, batch_size=4, worker_config=wc, task_encoder=fim)
    fimmed, seen = 0, []
    for _, batch in zip(range(4), get_savable_loader(ds), strict=False):
        for j, position in enumerate(batch["sample_id"].tolist()):
            row = ds[position]
            assert numpy.array_equal(batch["text"][j].numpy(), row.text), position
            fimmed += int((row.text == 70001).any())
            seen.append(position)
    assert fimmed and seen == list(range(16))  # each position once, in order
