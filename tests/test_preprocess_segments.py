"""``statefulset preprocess`` of segment lists: the token shard and its loss-mask shard (CONTRACT §16).

Real files, real worker processes: the mask holds each token's segment loss (the EOD the last
segment's), --workers 1 and 2 write the same bytes, a plain string among segment lists is one
loss=true segment, bad segment lists are named by file and line, Parquet list-of-struct columns
give the bytes of the same JSON lines, ``merge`` merges masks with their tokens, and a mask shard
that does not match its token shard is refused naming both files.
"""

from __future__ import annotations

import filecmp
import json
import random

import numpy
import pytest

from statefulset import IndexedDataset, IndexedDatasetWriter, StatefulsetError
from statefulset.shards import loss_masks
from statefulset.shards.merge import merge_datasets
from statefulset.shards.tokenizers import ByteTokenizer, HFTokenizer, TokenizerSpec
from statefulset.tools.preprocess import preprocess


def segment_records(n: int, seed: int = 0, plain_every: int = 5) -> list[dict]:
    r = random.Random(seed)
    records = []
    for i in range(n):
        if i % plain_every == 3:
            records.append({"text": f"plain text {i} " * r.randint(0, 3)})
            continue
        segs = [{"text": r.choice(["", "Q? ", "héllo ", "answer. "]) * r.randint(0, 4), "loss": r.random() < 0.5}
                for _ in range(r.randint(0, 5))]  # fmt: skip
        for s in segs:
            if r.random() < 0.2:
                del s["loss"]  # default true
        records.append({"text": segs})
    return records


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def expected(records, encode, eod):
    """(tokens, mask) per non-empty document, as the contract describes them."""
    docs = []
    for rec in records:
        value = rec["text"]
        segs = [{"text": value}] if isinstance(value, str) else value
        tokens, mask = [], []
        for s in segs:
            ids = encode(s["text"])
            tokens += ids
            mask += [int(s.get("loss", True))] * len(ids)
        if tokens and eod is not None:
            tokens.append(eod)
            mask.append(int(segs[-1].get("loss", True)))
        docs.append((tokens, mask))
    return docs


def same(a: str, b: str) -> bool:
    return all(filecmp.cmp(a + ext, b + ext, shallow=False) for ext in (".bin", ".idx"))


def check_output(prefix: str, records, encode, eod) -> None:
    tokens, mask = IndexedDataset(prefix), IndexedDataset(loss_masks.mask_prefix(prefix))
    assert mask.dtype == numpy.uint8
    assert numpy.array_equal(tokens.sequence_lengths, mask.sequence_lengths)
    assert numpy.array_equal(tokens.document_indices, mask.document_indices)
    want = expected(records, encode, eod)
    assert len(tokens.document_indices) == len(want) + 1
    got = iter(range(len(tokens)))
    for t, m in want:
        if not t:
            continue
        i = next(got)
        assert tokens[i].tolist() == t and mask[i].tolist() == m


@pytest.mark.parametrize("append_eod", [False, True])
def test_byte_tokenizer_masks_and_workers_identical(tmp_path, append_eod):
    records = segment_records(300)
    source = write_jsonl(tmp_path / "in.jsonl", records)
    kw = {"append_eod": append_eod, "show_progress": False, "chunk_bytes": 700}
    one = preprocess([source], str(tmp_path / "one"), workers=1, **kw)
    preprocess([source], str(tmp_path / "two"), workers=2, **kw)
    assert one.loss_masks == {"text": str(tmp_path / "one_text_document_loss_mask")}
    byte = ByteTokenizer()
    check_output(str(tmp_path / "one_text_document"), records, lambda s: byte.encode_batch([s])[0].tolist(),
                 byte.eod if append_eod else None)  # fmt: skip
    for name in ("_text_document", "_text_document_loss_mask"):
        assert same(str(tmp_path / ("one" + name)), str(tmp_path / ("two" + name)))


def test_segments_after_plain_chunks_get_ones_before_them(tmp_path):
    """The first segment list comes chunks after the start: the mask shard still covers every document."""
    records = [{"text": f"plain {i}"} for i in range(200)] + [{"text": [{"text": "q", "loss": False}, {"text": "a"}]}]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    for workers in (1, 2):
        preprocess([source], str(tmp_path / f"w{workers}"), workers=workers, append_eod=True, chunk_bytes=64,
                   show_progress=False)  # fmt: skip
    byte = ByteTokenizer()
    check_output(str(tmp_path / "w1_text_document"), records, lambda s: byte.encode_batch([s])[0].tolist(), byte.eod)
    assert same(str(tmp_path / "w1_text_document_loss_mask"), str(tmp_path / "w2_text_document_loss_mask"))


def test_bpe_tokenizer_tokenises_each_segment_on_its_own(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    records = segment_records(120, seed=3)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<|endoftext|>"])
    tok.train_from_iterator([json.dumps(r) for r in records] * 3, trainer)
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    source = write_jsonl(tmp_path / "in.jsonl", records)
    spec = TokenizerSpec(str(tmp_path / "tok"))
    for workers in (1, 2):
        preprocess([source], str(tmp_path / f"w{workers}"), tokenizer=spec, append_eod=True, workers=workers,
                   chunk_bytes=500, show_progress=False)  # fmt: skip
    hf = HFTokenizer(str(tmp_path / "tok"))
    check_output(str(tmp_path / "w1_text_document"), records, lambda s: hf._backend.encode(s).ids, hf.eod)
    for name in ("_text_document", "_text_document_loss_mask"):
        assert same(str(tmp_path / ("w1" + name)), str(tmp_path / ("w2" + name)))


BAD = [
    ('{"text": [{"text": "a"}, "b"]}', "key 'text': segment 1 must be an object with a string 'text'"),
    ('{"text": [{"loss": true}]}', "key 'text': segment 0 must be an object with a string 'text'"),
    ('{"text": [{"text": 5}]}', "key 'text': segment 0 must be an object with a string 'text'"),
    ('{"text": [{"text": "a", "loss": "yes"}]}', "key 'text': segment 0's 'loss' must be true or false"),
]


@pytest.mark.parametrize(("line", "reason"), BAD)
def test_a_bad_segment_list_is_named_by_file_and_line(tmp_path, line, reason):
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": [{"text": "ok", "loss": false}]}\n' * 3 + line + "\n")
    with pytest.raises(StatefulsetError, match=rf"in\.jsonl:4: {reason}"):
        preprocess([str(source)], str(tmp_path / "out"), workers=2, chunk_bytes=40, show_progress=False)
    assert not (tmp_path / "out_text_document.idx").exists()
    assert not (tmp_path / "out_text_document_loss_mask.idx").exists()


def test_plain_run_writes_no_mask_and_removes_a_stale_one(tmp_path):
    source = write_jsonl(tmp_path / "seg.jsonl", [{"text": [{"text": "ab", "loss": False}]}])
    preprocess([source], str(tmp_path / "out"), show_progress=False)
    assert (tmp_path / "out_text_document_loss_mask.idx").exists()
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"text": "abc"}])
    result = preprocess([plain], str(tmp_path / "out"), show_progress=False)
    assert result.loss_masks == {}
    assert not (tmp_path / "out_text_document_loss_mask.idx").exists()
    assert not (tmp_path / "out_text_document_loss_mask.bin").exists()


def test_parquet_list_of_struct_gives_the_bytes_of_json_lines(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    records = [r for r in segment_records(200, seed=5) if not isinstance(r["text"], str)]
    rows = [{"text": [{"text": s["text"], "loss": s.get("loss", True)} for s in r["text"]]} for r in records]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet", row_group_size=50)
    jsonl = write_jsonl(tmp_path / "in.jsonl", rows)
    for workers in (1, 2):
        preprocess([str(tmp_path / "in.parquet")], str(tmp_path / f"pq{workers}"), workers=workers, append_eod=True,
                   show_progress=False)  # fmt: skip
    preprocess([jsonl], str(tmp_path / "js"), append_eod=True, show_progress=False)
    for name in ("_text_document", "_text_document_loss_mask"):
        assert same(str(tmp_path / ("pq1" + name)), str(tmp_path / ("js" + name)))
        assert same(str(tmp_path / ("pq2" + name)), str(tmp_path / ("js" + name)))


def test_merge_carries_masks_and_gives_ones_to_unmasked_inputs(tmp_path):
    seg = segment_records(40, seed=7)
    plain = [{"text": f"plain {i}"} for i in range(30)]
    preprocess([write_jsonl(tmp_path / "a.jsonl", seg)], str(tmp_path / "a"), append_eod=True, show_progress=False)
    preprocess([write_jsonl(tmp_path / "b.jsonl", plain)], str(tmp_path / "b"), append_eod=True, show_progress=False)
    prefixes = [str(tmp_path / "b_text_document"), str(tmp_path / "a_text_document")]
    merge_datasets(prefixes, tmp_path / "m_text_document")
    byte = ByteTokenizer()
    check_output(str(tmp_path / "m_text_document"), plain + seg, lambda s: byte.encode_batch([s])[0].tolist(),
                 byte.eod)  # fmt: skip
    # both inputs plain: no mask shard, and a stale one at the output is removed
    merge_datasets([prefixes[0], prefixes[0]], tmp_path / "m_text_document")
    assert not (tmp_path / "m_text_document_loss_mask.idx").exists()


def test_a_mask_shard_that_does_not_match_is_refused_naming_both_files(tmp_path):
    with IndexedDatasetWriter(tmp_path / "t", numpy.uint16) as w:
        w.add_document([1, 2, 3])
        w.add_document([4, 5])
    with IndexedDatasetWriter(tmp_path / "t_loss_mask", numpy.uint8) as w:
        w.add_document([1, 1, 1])
        w.add_document([0, 1, 1])
    tokens = IndexedDataset(tmp_path / "t")
    with pytest.raises(StatefulsetError, match=r"t_loss_mask\.idx does not match its token shard .*t\.idx: sequence 1"):
        loss_masks.open_mask(tokens)
    with IndexedDatasetWriter(tmp_path / "t_loss_mask", numpy.uint8) as w:
        w.add_document([1, 1, 1])
    with pytest.raises(StatefulsetError, match=r"t_loss_mask\.idx does not match .*t\.idx: 1 sequences, the token"):
        loss_masks.open_mask(tokens)
    with pytest.raises(StatefulsetError, match=r"t_loss_mask\.idx does not match"):
        merge_datasets([tmp_path / "t"], tmp_path / "m")


def test_ray_writes_the_masks_of_local_workers(tmp_path):
    """Tasks without segment lists before and after ones with them, and a Parquet file of segments:
    the mask parts (and ones for the parts without) merge into the bytes of --workers 1."""
    pytest.importorskip("ray")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    import os
    import subprocess
    import sys

    plain = [{"text": f"plain text {i} " * (i % 7), "title": f"t{i}"} for i in range(400)]
    seg = [{**r, "title": "x"} for r in segment_records(400, seed=11, plain_every=10**9)]
    with open(tmp_path / "a.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in plain + seg[:200] + plain)
    rows = [{"text": [{"text": s["text"], "loss": s.get("loss", True)} for s in r["text"]], "title": "y"}
            for r in seg[200:]]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet", row_group_size=50)
    inputs = [str(tmp_path / "a.jsonl"), str(tmp_path / "c.parquet")]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    run = subprocess.run(
        [sys.executable, "-m", "statefulset", "preprocess", "--input", *inputs, "--output-prefix",
         str(tmp_path / "ray"), "--json-keys", "text", "title", "--executor", "ray", "--task-bytes", "6000",
         "--chunk-bytes", "2048", "--append-eod", "--quiet"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "text loss mask:" in run.stdout and "title loss mask" not in run.stdout
    preprocess(inputs, str(tmp_path / "w1"), json_keys=("text", "title"), append_eod=True, show_progress=False)
    for name in ("_text_document", "_text_document_loss_mask", "_title_document"):
        assert same(str(tmp_path / ("ray" + name)), str(tmp_path / ("w1" + name)))
    assert not (tmp_path / "ray_title_document_loss_mask.idx").exists()
    assert not (tmp_path / "ray.parts").exists()
