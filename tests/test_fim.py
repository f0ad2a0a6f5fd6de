"""FillInTheMiddle: Megatron-LM's FIM (megatron/training/datasets/fim_dataset.py at d98e8a6) over
token samples, with randomness only from the Generator it is given (CONTRACT §15, issue 27).

The expected layouts are rebuilt here from the rules as docs/transforms.md states them (Megatron-LM's):
draws in the order rate, two cut points in 0..n sorted, SPM choice; PSM ``<P> prefix <S> suffix <M>
middle``, SPM ``<P> <S> suffix <M> prefix middle``; the sample cut or padded at its end.
"""

from __future__ import annotations

import itertools
import pickle
from collections import Counter

import numpy
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statefulset import IndexedDatasetWriter, StatefulsetError, get_train_dataset
from statefulset.streams.documents import Pieces, document_fields
from statefulset.transforms import FillInTheMiddle, TokenSample

P, M, S, PAD = 1001, 1002, 1003, 1004  # sentinels above every content token (< 1000)
SENTINELS = (P, M, S)


def generator(seed: int) -> numpy.random.Generator:
    return numpy.random.Generator(numpy.random.Philox(key=seed))


def fim(rate=1.0, spm_rate=0.5, **kw) -> FillInTheMiddle:
    return FillInTheMiddle(rate, spm_rate, P, M, S, PAD, **kw)


def plain(tokens, sample_id: int = 0, **fields) -> TokenSample:
    return TokenSample(numpy.asarray(tokens, dtype=numpy.int64), sample_id, "src", **fields)


def layout(prefix, middle, suffix, spm: bool) -> list[int]:
    if spm:
        return [P, S, *suffix, M, *prefix, *middle]
    return [P, *prefix, S, *suffix, M, *middle]


def expected_token_fim(tokens: list[int], rate: float, spm_rate: float, seed: int) -> list[int]:
    """One segment, token mode, replaying the documented draws with the same generator."""
    g = generator(seed)
    if not g.binomial(1, rate):
        return tokens
    lo, hi = sorted(g.integers(0, len(tokens) + 1, size=2).tolist())
    spm = bool(g.binomial(1, spm_rate))
    return layout(tokens[:lo], tokens[lo:hi], tokens[hi:], spm)[: len(tokens)]


def test_rate_zero_is_the_identity():
    cu = numpy.array([0, 3, 9, 9, 9, 9, 9, 9, 9, 9], dtype=numpy.int32)
    sample = plain(range(10), loss_mask=numpy.ones(9, numpy.float32), cu_seqlens=cu, max_seqlen=numpy.int32(6))
    before = {k: numpy.copy(v) for k, v in sample.fields().items()}
    for encoder in (fim(0.0), fim(0.0, split_sample=4, fragment_rate=1.0), fim(0.0, no_prefix=(0,))):
        for seed in range(50):
            assert encoder.encode_sample(sample, generator(seed)) is sample
    assert all(numpy.array_equal(before[k], v) for k, v in sample.fields().items())


@pytest.mark.parametrize("seed", range(200))
def test_psm_and_spm_layouts_are_megatron_lms(seed):
    tokens = list(range(20 + seed % 13))
    out = fim(1.0, 0.5).encode_sample(plain(tokens), generator(seed))
    assert out.text.tolist() == expected_token_fim(tokens, 1.0, 0.5, seed)
    assert out.text.dtype == numpy.int64 and out.text.shape == (len(tokens),)


def test_rates_within_binomial_bounds():
    """10^4 samples, a generator each: FIM'd at ``rate``; SPM (``text[1] == <S>``) at ``spm_rate``
    plus the PSM samples whose prefix is empty (same tokens: P(lo = 0) = 1 - (n/(n+1))^2)."""
    n, rate, spm_rate, count = 40, 0.3, 0.25, 10_000
    encoder = fim(rate, spm_rate)
    sample = plain(range(n))
    outs = [encoder.encode_sample(sample, generator(i)).text for i in range(count)]
    fimmed = [t for t in outs if t[0] == P]
    assert all(t[0] < 1000 and t.tolist() == list(range(n)) for t in outs if t[0] != P)
    within(len(fimmed), count, rate)
    spm_like = sum(int(t[1] == S) for t in fimmed)
    within(spm_like, len(fimmed), spm_rate + (1 - spm_rate) * (1 - (n / (n + 1)) ** 2))


def within(hits: int, trials: int, p: float) -> None:
    sigma = (trials * p * (1 - p)) ** 0.5
    assert abs(hits - trials * p) <= 5 * sigma, (hits, trials, p)


def test_length_kept_and_tokens_kept_where_nothing_is_cut():
    """Bestfit padding (loss 0 at the end) makes room: the 3 sentinels take padding, no token is lost."""
    encoder = fim(1.0, 0.5)
    for seed in range(100):
        content = list(range(10 + seed % 7))
        text = content + [-1] * 8
        mask = numpy.array([1.0] * (len(content) - 1) + [0.0] * 8, numpy.float32)
        out = encoder.encode_sample(plain(text, loss_mask=mask), generator(seed))
        assert out.text.shape == (len(text),)
        kept = [t for t in out.text.tolist() if t not in SENTINELS and t != -1]
        assert Counter(kept) == Counter(content)
        assert out.text.tolist()[len(content) + 3 :] == [-1] * 5  # padding stays at the end
        assert out.loss_mask.tolist() == [1.0] * (len(content) + 2) + [0.0] * 5


def test_cut_at_the_end_when_longer():
    for seed in range(50):
        out = fim(1.0).encode_sample(plain(range(30)), generator(seed)).text.tolist()
        kept = [t for t in out if t not in SENTINELS]
        # the layout's last 3 tokens go: content, or <M> itself when the middle is empty
        assert (
            len(out) == 30 and len(kept) in (27, 28, 29) and len(set(kept)) == len(kept) and set(kept) <= set(range(30))
        )


def test_split_sample_fims_each_fragment_and_keeps_split_tokens():
    split = 999
    tokens = [*range(0, 8), split, *range(10, 17), split, split, *range(20, 26)]
    encoder = fim(1.0, 0.5, split_sample=split, fragment_rate=1.0)
    for seed in range(50):
        out = encoder.encode_sample(plain(tokens), generator(seed)).text.tolist()
        # each fragment grew by its 3 sentinels; every split token stays where its fragment ends
        # (Megatron-LM drops the one after an empty fragment)
        assert [i for i, t in enumerate(out) if t == split] == [11, 22, 23]
        for fragment in (out[:11], out[12:22]):
            assert fragment[0] == P and fragment.count(S) == 1 and fragment.count(M) == 1
    untouched = fim(1.0, split_sample=split, fragment_rate=0.0)
    sample = plain(tokens)
    assert all(untouched.encode_sample(sample, generator(s)) is sample for s in range(20))


def test_split_sample_rates_follow_megatron_lm():
    """The segment draw at ``rate`` gates; each fragment then at ``fragment_rate``; a segment without
    the split token is FIM'd at ``rate`` as a whole."""
    split, count = 999, 4000
    tokens = [*range(0, 10), split, *range(10, 20)]
    encoder = fim(0.5, 0.0, split_sample=split, fragment_rate=0.4)
    first_fimmed = 0
    for i in range(count):
        out = encoder.encode_sample(plain(tokens), generator(i)).text.tolist()
        first_fimmed += out[0] == P
    within(first_fimmed, count, 0.5 * 0.4)
    whole = fim(0.5, 0.0, split_sample=split, fragment_rate=0.0)
    hits = sum(whole.encode_sample(plain(range(20)), generator(i)).text[0] == P for i in range(count))
    within(int(hits), count, 0.5)


def test_no_prefix_leaves_matching_segments_alone():
    encoder = fim(1.0, split_sample=999, fragment_rate=1.0, no_prefix=(5, 6))
    tokens = [5, 6, 7, 8, 9, 999, 1, 2, 3, 4, 999, 5, 7, 8]
    for seed in range(30):
        out = encoder.encode_sample(plain(tokens), generator(seed)).text.tolist()
        assert out[:6] == [5, 6, 7, 8, 9, 999]
        assert out[6] == P  # the second fragment does not start with (5, 6)
    with pytest.raises(StatefulsetError, match="needs tokenizer"):
        fim(no_prefix="#!")
    with pytest.raises(StatefulsetError, match="empty"):
        fim(no_prefix=())


def test_eod_id_splits_like_megatron_lm():
    eod = 998
    tokens = [*range(0, 9), eod, *range(10, 19), eod, 20, 21, 22]
    for seed in range(30):
        out = fim(1.0, eod_id=eod).encode_sample(plain(tokens), generator(seed)).text.tolist()
        assert out[0] == P and out[12] == eod and out[13] == P  # each EOD stays after its FIM'd segment
        assert out[:12].count(P) == 1 and eod not in out[:12]


def test_same_seed_same_sample_and_no_global_rng():
    encoder = fim(0.5, 0.5, split_sample=7, fragment_rate=0.5)
    sample = plain(numpy.random.default_rng(0).integers(0, 20, 64))
    state = numpy.random.get_state()
    for seed in range(50):
        a = encoder.encode_sample(sample, generator(seed)).text
        numpy.random.seed(seed + 1)  # global RNGs play no part
        b = encoder.encode_sample(sample, generator(seed)).text
        assert numpy.array_equal(a, b)
    numpy.random.set_state(state)
    outs = {encoder.encode_sample(sample, generator(seed)).text.tobytes() for seed in range(50)}
    assert len(outs) > 10


def test_bad_parameters_are_named():
    with pytest.raises(StatefulsetError, match=r"rate=1\.5"):
        fim(1.5)
    with pytest.raises(StatefulsetError, match="prefix_id"):
        FillInTheMiddle(0.5, 0.5, "<fim_prefix>", M, S, PAD)
    with pytest.raises(StatefulsetError, match="loss_mask has shape"):
        fim(1.0).encode_sample(plain(range(8), loss_mask=numpy.ones(8, numpy.float32)), generator(0))


# ---------------------------------------------------------------- tokenizer mode (characters)

CODE = [
    "def add(a, b):\n    return a + b\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, x):\n        self.items.append(x)\n",
    "for i in range(10):\n    print(i * i)  # squares, café, naïve\n",
]


@pytest.fixture(scope="module")
def byte_level():
    """A byte-level BPE trained here (decode(encode(x)) == x), with FIM's tokens as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CODE * 20, trainer)
    return tok


def ids_of(tok, *names):
    return [tok.token_to_id(n) for n in names]


def test_tokenizer_mode_cuts_characters_as_megatron_lm(byte_level):
    """Megatron-LM: decode without special tokens, two cuts in 0..len(characters), each piece
    tokenised again without special tokens, PSM/SPM, then cut or padded with the pad token."""
    tok = byte_level
    eod, pre, mid, suf, pad = ids_of(tok, "<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>")
    encoder = FillInTheMiddle(1.0, 0.5, pre, mid, suf, pad, tokenizer=tok)
    ids = tok.encode("".join(CODE) * 3).ids
    padded = 0
    for seed in range(60):
        width = 20 + seed
        assert len(ids) > width
        tokens = ids[:width] if seed % 2 else ids[: width - 8] + [eod] * 8  # special tokens: not text
        sample = plain(tokens)
        out = encoder.encode_sample(sample, generator(seed))
        g = generator(seed)
        assert g.binomial(1, 1.0)
        contents = tok.decode(tokens, skip_special_tokens=True)
        lo, hi = sorted(g.integers(0, len(contents) + 1, size=2).tolist())
        pieces = [
            tok.encode(c, add_special_tokens=False).ids if c else []
            for c in (contents[:lo], contents[lo:hi], contents[hi:])
        ]
        spm = bool(g.binomial(1, 0.5))
        body = (
            [pre, suf, *pieces[2], mid, *pieces[0], *pieces[1]]
            if spm
            else [pre, *pieces[0], suf, *pieces[2], mid, *pieces[1]]
        )
        expected = (body + [pad] * width)[:width]
        assert out.text.tolist() == expected
        assert "".join(tok.decode(p) for p in pieces) == contents
        real = min(len(body), width)
        assert out.loss_mask.tolist() == [1.0] * (real - 1) + [0.0] * (width - real)  # no loss on padding
        padded += len(body) < width
    assert padded  # some samples shrank (special tokens are no text) and were padded


def test_tokenizer_mode_with_statefulset_byte_tokenizer_cuts_characters_not_bytes():
    from statefulset.shards.tokenizers import TokenizerSpec

    text = "é" * 12 + "ü" * 12  # two bytes per character
    ids = list(text.encode())
    encoder = FillInTheMiddle(1.0, 0.0, 300, 301, 302, 303, tokenizer=TokenizerSpec())
    encoder = pickle.loads(pickle.dumps(encoder))  # as a worker process receives it
    for seed in range(30):
        out = encoder.encode_sample(plain(ids), generator(seed)).text.tolist()
        g = generator(seed)
        g.binomial(1, 1.0)
        lo, hi = sorted(g.integers(0, len(text) + 1, size=2).tolist())
        body = [300, *text[:lo].encode(), 302, *text[hi:].encode(), 301, *text[lo:hi].encode()]
        assert out == body[: len(ids)]


def test_tokenizer_mode_no_prefix_is_text(byte_level):
    tok = byte_level
    pre, mid, suf, pad = ids_of(tok, "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>")
    encoder = FillInTheMiddle(1.0, 0.5, pre, mid, suf, pad, tokenizer=tok, no_prefix="class ")
    skipped = plain(tok.encode(CODE[1]).ids[:30])
    assert all(encoder.encode_sample(skipped, generator(s)).text.tolist() == skipped.text.tolist() for s in range(20))
    other = plain(tok.encode(CODE[0]).ids)
    assert encoder.encode_sample(other, generator(0)).text[0] == pre


# ---------------------------------------------------------------- documents and bestfit masks


@pytest.fixture(scope="module")
def bestfit(tmp_path_factory):
    """Documents whose tokens name them (document k: 100k, 100k+1, ...), packed by bestfit."""
    prefix = str(tmp_path_factory.mktemp("fim") / "docs")
    with IndexedDatasetWriter(prefix, numpy.int32) as writer:
        for k in range(80):
            n = 2 + (k * 7) % 23
            writer.add_document(numpy.arange(n, dtype=numpy.int32) + 100 * k, lengths=[n])
    spec = {"data_path": [prefix], "seq_length": 31, "packing": "bestfit", "split": "1", "seed": 5}
    return get_train_dataset(spec, batch_size=2, document_boundaries=True)


def sample_of(row: dict) -> TokenSample:
    fields = {k: row[k] for k in ("loss_mask", "cu_seqlens", "max_seqlen", "position_ids")}
    return TokenSample(row["text"], row["sample_id"], "docs", **fields)


def test_documents_follow_the_permuted_pieces(bestfit):
    encoder = fim(1.0, 0.5)
    padded = 0
    for position in range(40):
        sample = sample_of(bestfit[position])
        out = encoder.encode_sample(sample, generator(position))
        width = sample.text.size
        cu = out.cu_seqlens[: int((out.cu_seqlens < width - 1).sum()) + 1].tolist()
        bounds = [*cu[:-1], width]
        pieces = [out.text[a:b].tolist() for a, b in itertools.pairwise(bounds)]
        for k, piece in enumerate(pieces):  # each document: one original document's tokens, its sentinels
            real = [t for t in piece if t not in SENTINELS]
            assert len({t // 100 for t in real}) <= 1
            if -1 not in real:
                assert piece[0] == P
                if k < len(pieces) - 1:  # the last one may have lost its end to the cut
                    assert piece.count(S) == 1 and piece.count(M) == 1
        lengths = numpy.diff(bounds)
        expect = document_fields(Pieces(numpy.array([len(lengths)]), lengths, numpy.array([width])), width - 1)
        assert numpy.array_equal(out.cu_seqlens, expect["cu_seqlens"][0])
        assert numpy.array_equal(out.position_ids, expect["position_ids"][0])
        assert int(out.max_seqlen) == int(expect["max_seqlen"][0])
        pad = out.text[1:] == -1
        assert (out.loss_mask[pad] == 0).all() and (out.loss_mask[~pad] == 1).all()
        padded += bool(pad.any())
    assert padded


def test_loss_mask_follows_its_tokens_in_token_mode():
    """A §16 mask (loss only on some tokens): each token keeps whether its label has loss."""
    tokens = list(range(24))
    mask = numpy.array([float(i % 3 != 0) for i in range(1, 24)], numpy.float32)  # label i: loss if i % 3
    for seed in range(40):
        out = fim(1.0).encode_sample(plain(tokens, loss_mask=mask), generator(seed))
        for token, loss in zip(out.text[1:].tolist(), out.loss_mask.tolist(), strict=True):
            if token not in SENTINELS and token != 0:
                assert loss == float(token % 3 != 0)


# ---------------------------------------------------------------- properties


@st.composite
def samples(draw):
    width = draw(st.integers(2, 60))
    text = draw(st.lists(st.integers(0, 30), min_size=width, max_size=width))
    cuts = sorted(set(draw(st.lists(st.integers(1, width - 2), max_size=5)))) if width > 2 else []
    padding = draw(st.integers(0, width - 1))
    return width, text, cuts, padding


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    samples(),
    st.integers(0, 2**32),
    st.sampled_from([1.0, 0.5, 0.0]),
    st.sampled_from([None, 7]),
    st.sampled_from([None, 3]),
)
def test_any_sample_keeps_its_shape_and_tokens(drawn, seed, rate, split, eod):
    width, text, cuts, padding = drawn
    text = text[: width - padding] + [-1] * padding
    mask = numpy.array([1.0] * (width - 1 - padding) + [0.0] * padding, numpy.float32)
    lengths = numpy.diff([0, *[c for c in cuts if c < width - padding], width - padding])
    fields = document_fields(Pieces(numpy.array([lengths.size]), lengths, numpy.array([width - padding])), width - 1)
    sample = plain(text, loss_mask=mask, **{k: v[0] for k, v in fields.items()})
    encoder = FillInTheMiddle(rate, 0.5, 101, 102, 103, 104, split_sample=split, fragment_rate=0.5, eod_id=eod)
    out = encoder.encode_sample(sample, generator(seed))
    again = encoder.encode_sample(sample, generator(seed))
    assert all(numpy.array_equal(a, b) for a, b in zip(out.fields().values(), again.fields().values(), strict=True))
    assert out.text.shape == (width,) and out.loss_mask.shape == (width - 1,) and out.position_ids.shape == (width - 1,)
    kept = Counter(t for t in out.text.tolist() if t < 100)
    assert not kept - Counter(text)  # nothing new but sentinels; in token mode nothing is padded
    assert (out.loss_mask[out.text[1:] == -1] == 0).all()
    if rate == 0.0:
        assert out is sample
    cu = out.cu_seqlens.astype(numpy.int64)
    assert cu[0] == 0 and (numpy.diff(cu) >= 0).all() and cu[-1] == width - 1
    for a, b in itertools.pairwise(cu):
        assert out.position_ids[a:b].tolist() == list(range(b - a))


# ---------------------------------------------------------------- through the loader


@pytest.mark.parametrize("tokenizer", [None, "bytes"])
def test_through_the_loader_workers_equal_ds_and_collate(tmp_path, tokenizer):
    """As ``task_encoder=``: two workers give what ``ds[p]`` gives (the encoded TokenSample); in
    tokenizer mode every sample has a ``loss_mask`` (padding may appear), so batches collate it."""
    from statefulset import WorkerConfig, get_savable_loader
    from statefulset.shards.tokenizers import TokenizerSpec
    from statefulset.tools.demo import demo_spec

    spec = demo_spec(str(tmp_path), documents=200, seq_length=64)
    codec = TokenizerSpec() if tokenizer else None
    encoder = FillInTheMiddle(0.7, 0.5, 257, 258, 259, 260, eod_id=256, tokenizer=codec)
    wc = WorkerConfig(rank=0, world_size=1, num_workers=2)
    ds = get_train_dataset(spec, batch_size=4, worker_config=wc, task_encoder=encoder)
    batches = [b for _, b in zip(range(3), get_savable_loader(ds), strict=False)]
    fimmed = 0
    for batch in batches:
        assert ("loss_mask" in batch) == bool(tokenizer)
        for j, position in enumerate(batch["sample_id"].tolist()):
            row = ds[position]
            assert numpy.array_equal(batch["text"][j].numpy(), row.text)
            if tokenizer:
                assert numpy.array_equal(batch["loss_mask"][j].numpy(), row.loss_mask)
                assert (batch["loss_mask"][j][batch["text"][j][1:] == 260] == 0).all()
            fimmed += int((row.text == 257).any())
    assert fimmed


def test_trailing_tokens_without_loss_are_fimmed_with_their_document():
    """Only padding (one value, no loss) stays at the end: a §16 document whose last labels carry no
    loss (a prompt cut by the sample's end) is FIM'd whole, its tokens keeping their mask."""
    tokens = list(range(24))
    mask = numpy.array([1.0] * 19 + [0.0] * 4, numpy.float32)  # labels 20..23: no loss
    moved = 0
    for seed in range(40):
        out = fim(1.0).encode_sample(plain(tokens, loss_mask=mask), generator(seed))
        text = out.text.tolist()
        moved += 21 in text and M in text and text.index(21) < text.index(M)
        for token, loss in zip(text[1:], out.loss_mask.tolist(), strict=True):
            if token not in SENTINELS and token != 0:
                assert loss == float(token < 20)
    assert moved


@settings(max_examples=60, deadline=None)
@given(
    st.text(alphabet="ab c\né€😀", min_size=1, max_size=40),
    st.integers(0, 2**32),
    st.integers(0, 4),
    st.sampled_from([0.0, 0.5, 1.0]),
)
def test_any_text_through_the_byte_tokenizer(text, seed, eods, spm_rate):
    """Character cuts through statefulset's byte tokenizer: the length is kept, the pieces are the
    text's own bytes (never a split character), padding (EODs decode to no text) has no loss."""
    from statefulset.shards.tokenizers import TokenizerSpec

    text = "x" + text  # a sample has at least 2 tokens
    ids = [*text.encode(), *[256] * eods]
    encoder = FillInTheMiddle(1.0, spm_rate, 300, 301, 302, 303, tokenizer=TokenizerSpec())
    out = encoder.encode_sample(plain(ids), generator(seed))
    got = out.text.tolist()
    assert len(got) == len(ids) and out.loss_mask.shape == (len(ids) - 1,)
    pieces = bytes(t for t in got if t < 256)
    assert not Counter(pieces) - Counter(text.encode())
    padded = len(ids) - (len(text.encode()) + 3)  # EODs dropped by the decode, 3 sentinels added
    if padded > 0:
        assert got[-padded:] == [303] * padded and out.loss_mask[-padded:].tolist() == [0.0] * padded
        assert sorted(pieces) == sorted(text.encode())  # nothing cut: every byte is there


def test_a_state_is_refused_by_a_fim_with_other_parameters(tmp_path):
    """The encoder identity a state records is ``module.Class@version``: with a constant version, a
    state saved under FillInTheMiddle(rate=0.9) restored silently into rate=0.1 (other samples FIM'd
    from then on, no error). Saw this test fail before the version covered the parameters."""
    from statefulset import WorkerConfig, get_savable_loader

    rng = numpy.random.default_rng(3)
    with IndexedDatasetWriter(tmp_path / "c") as w:
        for _ in range(50):
            w.add_document(rng.integers(10, 500, int(rng.integers(5, 60))))
    spec = {"data_path": str(tmp_path / "c"), "seq_length": 32, "packing": "native", "path_to_cache": str(tmp_path)}

    def fim(rate, **kw):
        encoder = FillInTheMiddle(rate, 0.5, prefix_id=1, middle_id=2, suffix_id=3, pad_id=0, **kw)
        wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
        return get_savable_loader(get_train_dataset(spec, batch_size=2, worker_config=wc, task_encoder=encoder))

    first = fim(0.9)
    next(iter(first))
    state = first.save_state_rank()
    fim(0.9).restore_state_rank(state)  # the same parameters restore
    for other in (fim(0.1), fim(0.9, eod_id=0), fim(0.9, fragment_rate=0.5)):
        with pytest.raises(StatefulsetError, match=r"FillInTheMiddle@1-[0-9a-f]+.*FillInTheMiddle@1-[0-9a-f]+"):
            other.restore_state_rank(state)
    assert FillInTheMiddle(0.9, 0.5, 1, 2, 3, 0).version == FillInTheMiddle(0.9, 0.5, 1, 2, 3, 0).version
