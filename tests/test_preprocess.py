"""statefulset preprocess against Megatron's preprocess_data.py semantics, and its error handling."""

from __future__ import annotations

import filecmp
import gzip
import json

import numpy
import oracle
import pytest

from statefulset import IndexedDataset, StatefulsetError
from statefulset.shards.tokenizers import ByteTokenizer, HFTokenizer, TokenizerSpec
from statefulset.tools.preprocess import preprocess

mcore = oracle.module("megatron.core.datasets.indexed_dataset")

RECORDS = [
    {"text": "Hello, world.", "title": "first"},
    {"text": "", "title": "empty text makes a document with no sequences"},
    {"text": ["Sentence one.", "", "Sentence three: ünïcödé ✓"], "title": ""},
    {"text": "x" * 3000, "title": "long"},
] + [{"text": f"document number {i} " * (i % 7), "title": str(i)} for i in range(300)]


def write_jsonl(path, records, compress=False):
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    if compress:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


def megatron_reference(records, prefix, key, encode, eod, append_eod, dtype):
    """What preprocess_data.py's Encoder.encode + IndexedDatasetBuilder write, line by line."""
    builder = mcore.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for record in records:
        text = record[key]
        sentences = text if isinstance(text, list) else [text]
        doc_ids, lens = [], []
        for sentence in sentences:
            ids = encode(sentence)
            if len(ids) > 0:
                doc_ids.extend(ids)
                lens.append(len(ids))
        if len(doc_ids) > 0 and append_eod:
            doc_ids.append(eod)
            lens[-1] += 1
        builder.add_document(doc_ids, lens)
    builder.finalize(f"{prefix}.idx")


def same(a, b):
    return all(filecmp.cmp(f"{a}.{e}", f"{b}.{e}", shallow=False) for e in ("bin", "idx"))


@pytest.mark.oracle
@pytest.mark.parametrize("append_eod", [True, False])
def test_byte_tokenizer_matches_megatron_semantics(tmp_path, append_eod):
    source = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    result = preprocess(
        [str(source)],
        str(tmp_path / "ours"),
        json_keys=["text", "title"],
        append_eod=append_eod,
        show_progress=False,
    )
    assert result.documents == len(RECORDS)
    for key in ("text", "title"):
        megatron_reference(
            RECORDS,
            tmp_path / f"theirs_{key}",
            key,
            lambda s: list(s.encode()),
            256,
            append_eod,
            numpy.uint16,
        )
        assert same(tmp_path / f"ours_{key}_document", tmp_path / f"theirs_{key}")


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]", "<|endoftext|>"])
    tok.train_from_iterator([json.dumps(r) for r in RECORDS] * 3, trainer)
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.oracle
def test_hf_tokenizer_matches_megatron_semantics(tmp_path, hf_tokenizer_dir):
    source = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    spec = TokenizerSpec(str(hf_tokenizer_dir))
    preprocess([str(source)], str(tmp_path / "ours"), tokenizer=spec, append_eod=True, workers=2, show_progress=False)
    tok = HFTokenizer(str(hf_tokenizer_dir))
    assert tok.eod == tok._backend.token_to_id("<|endoftext|>")
    megatron_reference(
        RECORDS,
        tmp_path / "theirs",
        "text",
        lambda s: tok._backend.encode(s).ids,
        tok.eod,
        True,
        numpy.uint16,
    )
    assert same(tmp_path / "ours_text_document", tmp_path / "theirs")


def test_workers_and_gzip_give_identical_output(tmp_path):
    plain = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    packed = write_jsonl(tmp_path / "in.jsonl.gz", RECORDS, compress=True)
    kwargs = {"append_eod": True, "show_progress": False, "chunk_bytes": 512}
    preprocess([str(plain)], str(tmp_path / "one"), workers=1, **kwargs)
    preprocess([str(packed)], str(tmp_path / "three"), workers=3, **kwargs)
    assert same(tmp_path / "one_text_document", tmp_path / "three_text_document")


def test_several_inputs_and_globs_keep_order(tmp_path):
    for i in (1, 2, 10):
        write_jsonl(tmp_path / f"p_{i}.jsonl", [{"text": f"part {i}"}])
    preprocess([str(tmp_path / "p_*.jsonl")], str(tmp_path / "out"), show_progress=False)
    tok = ByteTokenizer()
    assert [tok.decode(s) for s in IndexedDataset(tmp_path / "out_text_document")] == [
        "part 1",
        "part 2",
        "part 10",
    ]


BAD = [
    (b'{"text": "ok"}\n{"text": oops}\n', 2, "invalid JSON"),
    (b'{"text": "ok"}\n{"other": "x"}\n', 2, "missing key 'text'"),
    (b'{"text": 5}\n', 1, "key 'text' must be a string or a list of strings or of segments, got int"),
    (b"[1, 2]\n", 1, "expected a JSON object, got list"),
    (b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', 2, "invalid JSON"),
]


@pytest.mark.parametrize(("content", "line", "reason"), BAD)
def test_bad_line_stops_with_file_and_line(tmp_path, content, line, reason):
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"text": "a"}\n' * 3 + content)
    with pytest.raises(StatefulsetError, match=rf"in\.jsonl:{line + 3}: {reason}"):
        preprocess([str(source)], str(tmp_path / "out"), show_progress=False, workers=2, chunk_bytes=16)
    assert not (tmp_path / "out_text_document.idx").exists()


def test_skip_bad_lines_counts_and_reports(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"text": "a"}\nnot json\n\n{"text": "b"}\n{"nope": 1}\n')
    result = preprocess([str(source)], str(tmp_path / "out"), skip_bad_lines=True, show_progress=False)
    assert result.documents == 2 and result.bad_lines == 2 and result.blank_lines == 1
    assert "in.jsonl:2: invalid JSON" in result.summary() and "in.jsonl:5: missing key" in result.summary()
    assert len(IndexedDataset(tmp_path / "out_text_document")) == 2


def test_input_and_tokenizer_errors(tmp_path):
    with pytest.raises(StatefulsetError, match=r"missing\.jsonl: no such input file"):
        preprocess([str(tmp_path / "missing.jsonl")], str(tmp_path / "o"), show_progress=False)
    with pytest.raises(StatefulsetError, match="the pattern matches no file"):
        preprocess([str(tmp_path / "*.jsonl")], str(tmp_path / "o"), show_progress=False)
    source = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2])
    with pytest.raises(StatefulsetError, match="no such tokenizer file"):
        preprocess([str(source)], str(tmp_path / "o"), tokenizer=TokenizerSpec(str(tmp_path)), show_progress=False)
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(StatefulsetError, match=r"broken\.json: not a valid tokenizer\.json"):
        TokenizerSpec(str(tmp_path / "broken.json")).build()
    bad_gz = tmp_path / "bad.jsonl.gz"
    bad_gz.write_bytes(gzip.compress(b'{"text": "a"}\n' * 100)[:40])
    with pytest.raises(StatefulsetError, match=r"bad\.jsonl\.gz: cannot decompress"):
        preprocess([str(bad_gz)], str(tmp_path / "o"), show_progress=False)
    with pytest.raises(StatefulsetError, match=r"token 256 .* does not fit uint8"):
        preprocess([str(source)], str(tmp_path / "o"), dtype="uint8", append_eod=True, show_progress=False)


def test_bad_options(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2])
    with pytest.raises(StatefulsetError, match="lists a key twice"):
        preprocess([str(source)], str(tmp_path / "o"), json_keys=["text", "text"], show_progress=False)
    with pytest.raises(StatefulsetError, match="--chunk-bytes must be positive"):
        preprocess([str(source)], str(tmp_path / "o"), chunk_bytes=0, show_progress=False)
    with pytest.raises(StatefulsetError, match="--workers must be at least 1"):
        preprocess([str(source)], str(tmp_path / "o"), workers=0, show_progress=False)


def test_a_shipped_tokenizer_builds_without_its_file(tmp_path, hf_tokenizer_dir):
    """Ray tasks on other machines get the tokenizer's text, not its path: same tokens, same end-of-document
    token (resolved on the driver from tokenizer_config.json), and a fingerprint that follows the file's bytes."""
    import shutil

    folder = tmp_path / "tok"
    shutil.copytree(hf_tokenizer_dir, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[UNK]"}))
    spec = TokenizerSpec(str(folder))
    here = spec.build()
    shipped = spec.shipped()
    before = spec.fingerprint()
    shutil.rmtree(folder)  # what a node without the file sees
    there = shipped.build()
    texts = [r["text"] for r in RECORDS if isinstance(r.get("text"), str)]
    assert there.eod == here.eod == here._backend.token_to_id("[UNK]")
    for a, b in zip(here.encode_batch(texts), there.encode_batch(texts), strict=True):
        assert numpy.array_equal(a, b)
    assert repr(shipped) == repr(TokenizerSpec(str(folder), "[UNK]"))  # the text stays out of logs and manifests
    shutil.copytree(hf_tokenizer_dir, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[UNK]"}))
    assert TokenizerSpec(str(folder)).fingerprint() == before
    (folder / "tokenizer.json").write_text((folder / "tokenizer.json").read_text().replace('"[UNK]"', '"[UNK2]"'))
    assert TokenizerSpec(str(folder)).fingerprint() != before
