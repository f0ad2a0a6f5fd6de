"""Tokenizer-mode FIM of a sample without loss mask or documents (Megatron-LM's case) takes its own
path (statefulset.transforms.fim_text.text_fim: slices and one array per FIM'd fragment); it must
give exactly what the general path gives the same sample with a loss mask of ones (which is what the
general path made for it before): tokens, loss mask, and the generator's later draws.
``tests/test_fim_pinned.py`` pins its outputs to the digests of before it existed.
"""

from __future__ import annotations

import numpy
import pytest

from statefulset.shards.tokenizers import TokenizerSpec
from statefulset.transforms import FillInTheMiddle, TokenSample

P, M, S, PAD, EOD, SPLIT = 300, 301, 302, 303, 10, 35  # byte ids: EOD a newline, SPLIT '#'
TEXT = (
    b"def add(a, b):\n    return a + b\n# squares\nfor i in range(10):\n    print(i * i)\n"
    b"class Stack:\n    def push(self, x):\n        self.items.append(x)  # caf\xc3\xa9, na\xc3\xafve\n"
)


def _bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "<x>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT.decode()] * 20, trainer)
    return tok


CONFIGS = {
    "bytes_eod": dict(rate=0.7, spm_rate=0.5, eod_id=EOD),
    "bytes_whole": dict(rate=1.0, spm_rate=0.3),
    "bytes_split": dict(rate=0.9, spm_rate=0.5, eod_id=EOD, split_sample=SPLIT, fragment_rate=0.6),
    "bytes_no_prefix_text": dict(rate=0.9, spm_rate=0.5, eod_id=EOD, no_prefix="    "),
    "bytes_no_prefix_ids": dict(rate=0.9, spm_rate=0.5, eod_id=EOD, no_prefix=(32, 32)),
    "bpe_eod": dict(rate=0.6, spm_rate=0.5, eod_id=0),
}


def _texts(config: str, count: int) -> list[numpy.ndarray]:
    rs = numpy.random.RandomState(len(config))
    if config.startswith("bpe"):
        ids = numpy.array(_bpe().encode(TEXT.decode() * 8).ids, dtype=numpy.int64)
    else:
        ids = numpy.frombuffer(TEXT * 8, numpy.uint8).astype(numpy.int64)
    out = []
    for _ in range(count):
        width = int(rs.randint(2, 400))
        start = int(rs.randint(0, ids.size - width))
        text = ids[start : start + width].copy()
        if config.startswith("bpe"):
            text[rs.rand(width) < 0.02] = 0  # EOD
            text[rs.rand(width) < 0.15] = 1  # another special token: no text, so FIM'd segments shrink
        out.append(text)
    return out


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_text_path_equals_the_general_path_with_a_mask_of_ones(config):
    tokenizer = _bpe() if config.startswith("bpe") else TokenizerSpec()
    fim = FillInTheMiddle(prefix_id=P, middle_id=M, suffix_id=S, pad_id=PAD, tokenizer=tokenizer, **CONFIGS[config])
    changed = padded = 0
    for i, text in enumerate(_texts(config, 150)):
        fast_rng = numpy.random.Generator(numpy.random.Philox(key=i))
        general_rng = numpy.random.Generator(numpy.random.Philox(key=i))
        fast = fim.encode_sample(TokenSample(text, i, "src"), fast_rng)
        ones = numpy.ones(text.size - 1, dtype=numpy.float32)
        general = fim.encode_sample(TokenSample(text, i, "src", loss_mask=ones), general_rng)
        assert fast.text.dtype == general.text.dtype and numpy.array_equal(fast.text, general.text), i
        assert fast.loss_mask.dtype == numpy.float32 and numpy.array_equal(fast.loss_mask, general.loss_mask), i
        assert fast.cu_seqlens is None and fast.sample_id == i and fast.source == "src"
        assert numpy.array_equal(fast_rng.integers(0, 2**62, size=4), general_rng.integers(0, 2**62, size=4)), i
        changed += fast.text is not text
        padded += bool(fast.loss_mask[-1] == 0.0)
    assert changed > 30  # the configurations FIM most samples; some shrink and are padded
    if config.startswith("bpe"):
        assert padded
