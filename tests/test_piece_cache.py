"""The piece cache gives a GPT-2 style byte-level BPE's own ids, byte for byte in the shards."""

from __future__ import annotations

import filecmp
import json
import random

import numpy
import pytest

from statefulset.shards import piece_cache
from statefulset.shards.tokenizers import HFTokenizer, TokenizerSpec
from statefulset.tools.preprocess import preprocess

pytest.importorskip("tokenizers")

EOD = "<|endoftext|>"
WORDS = "the of and to a in is that it's we'll they're I'd you've I'm don't café naïve 東京 😀 x2 42 3.14".split()
ASCII = "".join(map(chr, range(128)))


def fuzz(rng: random.Random, n: int) -> list[str]:
    """Texts that stress the split: every ASCII character, runs of mixed whitespace, contractions,
    digits against letters, punctuation runs, and some non-ASCII and end-of-text markers."""
    pieces = [*WORDS, " ", "  ", "\n\n", "\t", " \n ", "\x0b", "\x0c", "\x1c\x1d\x1e\x1f", "\r\n", "'", "'s",
              "''s", "'ll", "'LL", "...", "?!", "--", "<|", "|>", "\x00", "\x7f", "\u00a0", "\u2019", "\u3000",
              "\x85", "\u180e", "\u2028", "Ωμέγα", "١٢٣", "Ⅻ", "½", "ß"]  # fmt: skip
    texts = []
    for _ in range(n):
        parts = [rng.choice(pieces) if rng.random() < 0.7 else char(rng) for _ in range(rng.randint(0, 40))]
        texts.append("".join(parts))
    return texts


def char(rng: random.Random) -> str:
    """Mostly ASCII, else any code point of the first plane but a surrogate (unassigned ones included)."""
    code = rng.randrange(0x10000)
    return rng.choice(ASCII) if rng.random() < 0.6 or 0xD800 <= code < 0xE000 else chr(code)


@pytest.fixture(scope="module")
def gpt2_style(tmp_path_factory):
    """A byte-level BPE as GPT-2's (and the benchmark's) is built, trained on the fuzz texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=[EOD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(fuzz(random.Random(1), 2000), trainer=trainer)
    path = tmp_path_factory.mktemp("gpt2") / "tokenizer.json"
    tok.save(str(path))
    return path


def edge_texts() -> list[str]:
    return [
        "", " ", "  ", "\n", "a", " a", "a ", "a  b", "a \n b", "\t\tx", "x\x0b\x0cy", "x\x1c y", "don't", "DON'T",
        "'s's's", "it''s", "1,000,000.5", "a1b2", f"before{EOD}after", EOD, f"{EOD}{EOD}", "<|endoftext|", "ünïcödé ✓",
        "mixed café and plain", "x" * 100_000, "word " * 20_000, ASCII, ASCII[::-1],
    ]  # fmt: skip


def pipeline_ids(tokenizer: HFTokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer._backend.encode_batch(texts)]


def test_piece_cache_gives_the_pipelines_ids(gpt2_style):
    tokenizer = HFTokenizer(str(gpt2_style))
    assert tokenizer.piece_cache() is not None  # the cache applies to this tokenizer
    texts = edge_texts() + fuzz(random.Random(2), 3000)
    for start in range(0, len(texts), 500):  # several batches: pieces learnt in one are reused in the next
        batch = texts[start : start + 500]
        tokens, lengths = tokenizer.encode_batch(batch)
        expected = pipeline_ids(tokenizer, batch)
        assert lengths.tolist() == [len(ids) for ids in expected]
        assert tokens.tolist() == [i for ids in expected for i in ids]
    assert tokenizer.piece_cache().texts_fast > 0 and tokenizer.piece_cache().texts_slow > 0  # both paths ran


def test_the_split_is_the_pre_tokenizers():
    """Every text the cache takes splits as tokenizers' ByteLevel pre-tokenizer splits it: the fuzz texts, and
    every character the cache accepts between letters, digits, spaces and punctuation of its own kind."""
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    to_byte = {c: b for b, c in zip(range(256), _byte_alphabet(), strict=True)}
    split, foreign = piece_cache.patterns()
    accepted = [chr(c) for c in range(0x10000) if foreign.search(chr(c)) is None]
    assert len(accepted) > 40_000 and "\U0001f600" not in accepted and "\ud800" not in accepted
    contexts = [f"x{c}{c} {c}1{c}\n{c}'s{c}  {c}.{c}\t" for c in accepted]
    texts = ["".join(contexts[k : k + 50]) for k in range(0, len(contexts), 50)] + fuzz(random.Random(3), 2000)
    checked = 0
    for text in texts:
        if foreign.search(text) is not None:
            continue
        pieces = [piece for piece, _ in byte_level.pre_tokenize_str(text)]
        theirs = [bytes(to_byte[c] for c in piece).decode() for piece in pieces]
        assert split.findall(text) == theirs, repr(text)
        checked += 1
    assert checked > 1500


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def test_other_tokenizers_keep_the_pipeline(gpt2_style, tmp_path):
    config = json.loads(gpt2_style.read_text())
    assert piece_cache.unsupported(config) is None
    changed = {
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {**config["pre_tokenizer"], "add_prefix_space": True},
        "model": {**config["model"], "dropout": 0.1},
        "post_processor": {"type": "TemplateProcessing", "single": [], "pair": [], "special_tokens": {}},
    }
    for key, value in changed.items():
        reason = piece_cache.unsupported({**config, key: value})
        assert reason is not None, key
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps({**config, key: value}))
        if key != "post_processor":  # (a bare template is not loadable; the reason above is enough)
            assert HFTokenizer(str(path)).piece_cache() is None


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_writes_the_same_bytes_either_way(gpt2_style, tmp_path, monkeypatch, workers):
    texts = edge_texts() + fuzz(random.Random(4), 1500)
    records = [{"text": t} for t in texts] + [{"text": [t, "", t.upper()]} for t in texts[:200]]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = TokenizerSpec(str(gpt2_style))
    run = dict(tokenizer=spec, append_eod=True, workers=workers, chunk_bytes=64 << 10, show_progress=False)
    preprocess([str(source)], str(tmp_path / "cached"), **run)
    monkeypatch.setenv("STATEFULSET_PIECE_CACHE", "0")
    assert HFTokenizer(str(gpt2_style)).piece_cache() is None
    preprocess([str(source)], str(tmp_path / "pipeline"), **run)
    for ext in ("bin", "idx"):
        a, b = tmp_path / f"cached_text_document.{ext}", tmp_path / f"pipeline_text_document.{ext}"
        assert filecmp.cmp(a, b, shallow=False), ext
    assert numpy.fromfile(tmp_path / "cached_text_document.bin", numpy.uint16).size > 100_000


def test_a_full_table_starts_again_with_the_same_ids(gpt2_style, monkeypatch):
    """Past its bounds (here 50 pieces, 2,000 characters) the table is emptied at the next batch."""
    monkeypatch.setattr(piece_cache, "MAX_PIECES", 50)
    monkeypatch.setattr(piece_cache, "MAX_CHARS", 2_000)
    tokenizer = HFTokenizer(str(gpt2_style))
    texts = fuzz(random.Random(5), 400)
    sizes = []
    for start in range(0, len(texts), 40):
        batch = texts[start : start + 40]
        tokens, lengths = tokenizer.encode_batch(batch)
        expected = pipeline_ids(tokenizer, batch)
        assert tokens.tolist() == [i for ids in expected for i in ids]
        assert lengths.tolist() == [len(ids) for ids in expected]
        sizes.append(len(tokenizer.piece_cache().index))
    assert max(sizes) > 50 and min(sizes[1:]) < max(sizes)  # it filled up and started again
