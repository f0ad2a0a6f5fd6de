"""Parquet input to ``statefulset preprocess``: row groups as units of work, the same bytes as JSON lines.

Real Parquet files written with pyarrow; byte identity against the same texts given as JSON lines
(plain and gzip), with 1 and 2 workers, with list columns and nulls; bad rows named by file and row.
"""

from __future__ import annotations

import filecmp
import gzip
import json
import random

import pytest

from statefulset import StatefulsetError
from statefulset.shards.tokenizers import TokenizerSpec
from statefulset.tools.preprocess import preprocess

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _rows(n: int, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    rows = []
    for i in range(n):
        text = "".join(r.choice("abcdé fgh\n") for _ in range(r.randint(0, 300)))
        rows.append({"text": text, "title": f"title {i}", "sections": [f"s{i}", "", "more é"][: r.randint(0, 3)]})
    return rows


def _same(a: str, b: str) -> bool:
    return all(filecmp.cmp(a + ext, b + ext, shallow=False) for ext in (".bin", ".idx"))


@pytest.mark.parametrize("workers", [1, 2])
def test_parquet_gives_the_bytes_of_the_same_json_lines(tmp_path, workers):
    rows = _rows(2500)
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    with gzip.open(tmp_path / "in.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet", row_group_size=300)
    keys = ("text", "title", "sections")
    common = {"json_keys": keys, "append_eod": True, "workers": workers, "show_progress": False,
              "tokenizer": TokenizerSpec("bytes")}  # fmt: skip
    ours = preprocess([str(tmp_path / "in.parquet")], str(tmp_path / "p"), **common)
    preprocess([str(tmp_path / "in.jsonl")], str(tmp_path / "j"), **common)
    preprocess([str(tmp_path / "in.jsonl.gz")], str(tmp_path / "g"), **common)
    assert ours.documents == len(rows)
    for key in keys:
        assert _same(str(tmp_path / f"p_{key}_document"), str(tmp_path / f"j_{key}_document")), key
        assert _same(str(tmp_path / f"p_{key}_document"), str(tmp_path / f"g_{key}_document")), key


def test_parquet_and_json_lines_inputs_mix_in_order(tmp_path):
    rows = _rows(600, seed=1)
    pq.write_table(pa.Table.from_pylist(rows[:200]), tmp_path / "a.parquet", row_group_size=64)
    with open(tmp_path / "b.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows[200:400])
    pq.write_table(pa.Table.from_pylist(rows[400:]), tmp_path / "c.parquet", row_group_size=1000)
    with open(tmp_path / "all.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    inputs = [str(tmp_path / n) for n in ("a.parquet", "b.jsonl", "c.parquet")]
    preprocess(inputs, str(tmp_path / "mixed"), workers=2, show_progress=False)
    preprocess([str(tmp_path / "all.jsonl")], str(tmp_path / "one"), show_progress=False)
    assert _same(str(tmp_path / "mixed_text_document"), str(tmp_path / "one_text_document"))


def test_bad_rows_are_named_by_file_and_row(tmp_path):
    rows = _rows(30, seed=2)
    rows[17]["text"] = None
    rows[25]["text"] = None
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet", row_group_size=8)
    with pytest.raises(StatefulsetError, match=r"bad.parquet:row 18: key 'text' must be a string .*got null"):
        preprocess([str(tmp_path / "bad.parquet")], str(tmp_path / "out"), show_progress=False)
    result = preprocess(
        [str(tmp_path / "bad.parquet")], str(tmp_path / "out"), skip_bad_lines=True, show_progress=False
    )
    assert result.bad_lines == 2 and result.documents == 28
    assert result.first_bad[1].startswith(f"{tmp_path / 'bad.parquet'}:row 26:")


def test_missing_columns_and_damaged_files_are_refused(tmp_path):
    pq.write_table(pa.Table.from_pylist(_rows(10)), tmp_path / "ok.parquet")
    with pytest.raises(StatefulsetError, match=r"ok.parquet: no column 'body' \(its columns: sections, text, title\)"):
        preprocess([str(tmp_path / "ok.parquet")], str(tmp_path / "out"), json_keys=("body",), show_progress=False)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1" + b"\0" * 64)
    with pytest.raises(StatefulsetError, match=r"broken.parquet: not a readable Parquet file"):
        preprocess([str(tmp_path / "broken.parquet")], str(tmp_path / "out"), show_progress=False)
