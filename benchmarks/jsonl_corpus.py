"""A deterministic synthetic JSON-lines corpus of pseudo-English, and a BPE tokenizer trained on it.

Each line is ``{"text": "..."}``. Document lengths are geometric (mean ~2,000 characters, seed
1234); words follow a Zipf law over ~60,000 pseudo-English words (a few hundred real function
words first, plus numbers and some non-ASCII words so UTF-8 and JSON escapes are exercised).
Punctuation, capitalisation after a sentence end and paragraph breaks (``\\n\\n`` inside the
JSON string) are drawn with the words.

Generation is vectorised: all draws are numpy arrays, and a batch of documents is materialised
as one gather over a table of pre-escaped JSON byte pieces, so no Python code runs per word.
The first k documents do not depend on ``--docs``: lengths come from one generator, and each
batch of documents has its own seed.

Run it directly to write the corpus (and optionally train the tokenizer)::

    python benchmarks/jsonl_corpus.py [--docs N] [--tokenizer]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy

DEFAULT_DOCS = 200_000
SEED = 1234
MEAN_CHARS = 2_000
BATCH_DOCS = 4_000
VOCAB_WORDS = 60_000
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
EOD_TOKEN = "<|endoftext|>"

_FUNCTION_WORDS = (
    "the of and to a in is that for it as was with be by on not he this are or his from at which but have an "
    "had they you were their one all we can her has there been if more when will would who so no she other its "
    "may these about than into them only some could time two new first then also any what like our over such "
    "after most made between over many those before must through where much should well people because each "
    "just how very while during being under both three since against without same another around however"
).split()
# Rare words that are not ASCII, so UTF-8 multi-byte sequences and surrogate pairs occur.
_UNICODE_WORDS = ("café", "naïve", "Zürich", "São", "façade", "東京", "Ελλάδα", "smörgåsbord", "😀", "Москва")
_ESCAPED = frozenset({"😀", "Москва"})
_ONSETS = (
    "", "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y", "z",
    "br", "ch", "cl", "cr", "dr", "fl", "fr", "gl", "gr", "pl", "pr", "sc", "sh", "sk", "sl", "sp", "st", "str",
    "th", "tr", "wh",
)  # fmt: skip
_NUCLEI = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "ai", "ea", "ee", "ie", "oo", "ou", "y")
_CODAS = ("", "", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "ll", "rt", "ss", "th", "tion")
# Separators in their JSON-escaped form, with probabilities; the sentence-ending ones capitalise the next word.
_SEPARATORS = (" ", ", ", ". ", "? ", "; ", ".\\n\\n", ' \\"', '\\" ')
_SEP_P = (0.835, 0.07, 0.06, 0.005, 0.005, 0.015, 0.005, 0.005)
_SENTENCE_END = (False, False, True, True, False, True, False, False)
_HEAD = '{"text": "'
_TAIL = '."}\n'


def default_path(docs: int, out_dir: str = OUT_DIR) -> str:
    return os.path.join(out_dir, f"preprocess_corpus_{docs}.jsonl")


def _vocabulary() -> list[str]:
    """Zipf-ranked words: function words first, then pseudo-words with some numbers and non-ASCII words."""
    rng = numpy.random.default_rng([SEED, 1])
    n = VOCAB_WORDS * 2  # generous, duplicates are removed below
    syllables = rng.choice([1, 2, 3, 4], size=n, p=[0.5, 0.35, 0.13, 0.02])
    onset = rng.integers(0, len(_ONSETS), size=(n, 4))
    nucleus = rng.integers(0, len(_NUCLEI), size=(n, 4))
    coda = rng.integers(0, len(_CODAS), size=(n, 4))
    # One Python pass over the (small, fixed) vocabulary, never over the corpus.
    parts = [
        "".join(_ONSETS[onset[i, j]] + _NUCLEI[nucleus[i, j]] + _CODAS[coda[i, j]] for j in range(int(syllables[i])))
        for i in range(n)
    ]
    seen = set(_FUNCTION_WORDS)
    words = list(dict.fromkeys(_FUNCTION_WORDS))
    for w in parts:
        if w not in seen:
            seen.add(w)
            words.append(w)
        if len(words) >= VOCAB_WORDS:
            break
    numbers = [str(x) for x in rng.integers(0, 3000, size=200)] + [f"{x:.2f}" for x in rng.random(50) * 100]
    extra = list(_UNICODE_WORDS) + numbers
    ranks = rng.choice(numpy.arange(150, len(words)), size=len(extra), replace=False)
    for rank, word in sorted(zip(ranks.tolist(), extra, strict=True), reverse=True):
        words.insert(rank, word)
    return words


class _PieceTable:
    """Every word (lower-case and capitalised) and separator as JSON-escaped UTF-8 bytes in one buffer."""

    def __init__(self, words: list[str]) -> None:
        capitalised = [w[:1].upper() + w[1:] for w in words]
        pieces = [*words, *capitalised, *_SEPARATORS, _TAIL + _HEAD, _TAIL]
        self_sep0 = 2 * len(words)  # separators and line ends are already in JSON form
        # Raw UTF-8 for most words, \\u escapes (a surrogate pair for the emoji) for a few, as real dumps mix both.
        encoded = [
            p.encode() if i >= self_sep0 else json.dumps(p, ensure_ascii=p in _ESCAPED)[1:-1].encode()
            for i, p in enumerate(pieces)
        ]
        self.buffer = numpy.frombuffer(b"".join(encoded), numpy.uint8)
        self.length = numpy.fromiter(map(len, encoded), numpy.int64, count=len(encoded))
        self.offset = numpy.cumsum(self.length) - self.length
        self.words = len(words)
        self.sep0 = 2 * len(words)
        self.doc_end = self.sep0 + len(_SEPARATORS)
        self.last_end = self.doc_end + 1
        zipf = 1.0 / (numpy.arange(len(words)) + 2.7)
        self.word_p = zipf / zipf.sum()
        self.mean_piece = float(self.word_p @ self.length[: len(words)]) + float(
            numpy.asarray(_SEP_P) @ self.length[self.sep0 : self.doc_end]
        )

    def gather(self, ids: numpy.ndarray) -> bytes:
        """The concatenated bytes of pieces ``ids``, without a Python loop."""
        lengths = self.length[ids]
        out_start = numpy.cumsum(lengths) - lengths
        index = numpy.repeat(self.offset[ids] - out_start, lengths) + numpy.arange(int(lengths.sum()))
        return self.buffer[index].tobytes()


def _batch(table: _PieceTable, batch: int, char_lengths: numpy.ndarray, last: bool) -> bytes:
    """JSON lines for one batch of documents, each at least ``char_lengths`` characters (rounded up to a word)."""
    rng = numpy.random.default_rng([SEED, 2, batch])
    n = char_lengths.size
    target = numpy.cumsum(char_lengths)
    count = int(target[-1] / table.mean_piece * 1.2) + 2 * n + 64
    while True:
        words = rng.choice(table.words, size=count, p=table.word_p)
        seps = rng.choice(len(_SEPARATORS), size=count, p=_SEP_P)
        ends = numpy.cumsum(table.length[words] + table.length[table.sep0 + seps])
        # Words each document ends with: the first word boundary at or after its target, and
        # strictly increasing so that every document has at least one word.
        stop = numpy.searchsorted(ends, target) + 1
        stop = numpy.maximum.accumulate(stop - numpy.arange(n)) + numpy.arange(n)
        if stop[-1] <= count:
            break
        count *= 2  # rare: the draw was too short; redraw (still deterministic)
    words, seps = words[: stop[-1]], seps[: stop[-1]]
    is_end = numpy.asarray(_SENTENCE_END)[seps]
    first = numpy.zeros(words.size, bool)
    first[0] = True
    first[stop[:-1]] = True
    capital = first | numpy.r_[False, is_end[:-1]]
    sep_ids = table.sep0 + seps
    sep_ids[stop - 1] = table.doc_end
    if last:
        sep_ids[-1] = table.last_end
    ids = numpy.empty(2 * words.size, numpy.int64)
    ids[0::2] = words + capital * table.words
    ids[1::2] = sep_ids
    return (_HEAD.encode() if batch == 0 else b"") + table.gather(ids)


def write_corpus(path: str, docs: int = DEFAULT_DOCS) -> dict[str, object]:
    """Write ``docs`` JSON lines to ``path`` (atomically) and return a description."""
    if docs < 1:
        raise ValueError(f"docs must be >= 1, got {docs}")
    start = time.perf_counter()
    lengths = numpy.random.default_rng(SEED).geometric(1.0 / MEAN_CHARS, size=docs)
    table = _PieceTable(_vocabulary())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        batches = range(0, docs, BATCH_DOCS)
        for b, first in enumerate(batches):
            # Every batch but the last ends with a document end followed by the next batch's head.
            f.write(_batch(table, b, lengths[first : first + BATCH_DOCS], last=first + BATCH_DOCS >= docs))
    os.replace(tmp, path)
    return {"path": path, "docs": docs, "bytes": os.path.getsize(path), "seconds": time.perf_counter() - start}


def ensure_corpus(docs: int = DEFAULT_DOCS, out_dir: str = OUT_DIR) -> dict[str, object]:
    """The corpus file for ``docs``, generated only if missing."""
    path = default_path(docs, out_dir)
    if os.path.exists(path):
        return {"path": path, "docs": docs, "bytes": os.path.getsize(path), "seconds": 0.0, "cached": True}
    os.makedirs(out_dir, exist_ok=True)
    return {**write_corpus(path, docs), "cached": False}


def train_tokenizer(corpus: str, path: str, vocab_size: int = 32_000, train_docs: int = 20_000) -> dict[str, object]:
    """Train a byte-level BPE (GPT-2 style) on the first ``train_docs`` lines of ``corpus``; save tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    start = time.perf_counter()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        with open(corpus, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i >= train_docs:
                    break
                yield json.loads(line)["text"]

    tokenizer.train_from_iterator(texts(), trainer=trainer)
    tmp = path + ".tmp"
    tokenizer.save(tmp)
    os.replace(tmp, path)
    return {
        "path": path,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "eod_id": tokenizer.token_to_id(EOD_TOKEN),
        "train_docs": train_docs,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=DEFAULT_DOCS, help=f"documents (default {DEFAULT_DOCS:,})")
    parser.add_argument("--out-dir", default=OUT_DIR, help="where the corpus goes (default benchmarks/out)")
    parser.add_argument("--tokenizer", action="store_true", help="also train <out-dir>/tokenizer.json")
    args = parser.parse_args()
    info = write_corpus(default_path(args.docs, args.out_dir), args.docs)
    print(f"{info['docs']:,} documents, {info['bytes']:,} B in {info['seconds']:.2f} s: {info['path']}")
    if args.tokenizer:
        tok = train_tokenizer(str(info["path"]), os.path.join(args.out_dir, "tokenizer.json"))
        print(f"tokenizer: vocab {tok['vocab_size']:,}, eod id {tok['eod_id']}, {tok['seconds']:.1f} s: {tok['path']}")


if __name__ == "__main__":
    main()
