"""``statefulset merge`` refuses to interleave shards of different JSON keys unless asked, in natural order."""

from __future__ import annotations

import pytest

from statefulset import IndexedDataset, IndexedDatasetWriter
from statefulset.shards.names import OTHER_NAMES, key_groups
from statefulset.tools.cli import main


@pytest.fixture
def folder(tmp_path):
    """What ``preprocess --json-keys text title`` writes for three inputs: part_{1,2,10}_{text,title}_document."""
    shards = tmp_path / "shards"
    for part in (10, 2, 1):
        for code, key in ((0, "text"), (1, "title")):
            with IndexedDatasetWriter(shards / f"part_{part}_{key}_document") as w:
                w.add_document([part, code])
    return shards


def merged_rows(prefix) -> list[list[int]]:
    return [s.tolist() for s in IndexedDataset(prefix)]


def test_a_folder_of_two_keys_is_refused_naming_the_groups(folder, tmp_path, capsys):
    assert main(["merge", "--input", str(folder), "--output-prefix", str(tmp_path / "all")]) == 2
    err = capsys.readouterr().err
    assert "the shards come from 2 different JSON keys" in err
    assert (
        "text_document: part_1_text_document, part_2_text_document, part_10_text_document; "
        "title_document: part_1_title_document, part_2_title_document, part_10_title_document" in err
    )
    assert f"--input '{folder}/*_text_document'" in err and "--allow-mixed-keys" in err
    assert not (tmp_path / "all.idx").exists()


def test_one_key_by_glob_merges_in_natural_order(folder, tmp_path):
    out = tmp_path / "text"
    assert main(["merge", "--input", f"{folder}/*_text_document", "--output-prefix", str(out)]) == 0
    assert merged_rows(out) == [[1, 0], [2, 0], [10, 0]]  # part_2 before part_10


def test_allow_mixed_keys_merges_everything_in_natural_order(folder, tmp_path):
    out = tmp_path / "all"
    args = ["merge", "--input", str(folder), "--output-prefix", str(out), "--allow-mixed-keys"]
    assert main(args) == 0
    assert merged_rows(out) == [[1, 0], [1, 1], [2, 0], [2, 1], [10, 0], [10, 1]]


def test_names_without_a_key_are_a_group_of_their_own(tmp_path, capsys):
    shards = tmp_path / "mixed"
    for name in ("part_1_text_document", "part_2_text_document", "notes"):
        with IndexedDatasetWriter(shards / name) as w:
            w.add_document([1])
    assert main(["merge", "--input", str(shards), "--output-prefix", str(tmp_path / "o")]) == 2
    assert f"{OTHER_NAMES}: notes" in capsys.readouterr().err


def test_key_groups():
    names = ["a/x_text_document", "a/x_raw_content_document", "a/y_text_document", "a/z_text_sentence", "a/plain"]
    assert key_groups(names) == {
        "text_document": ["a/x_text_document", "a/y_text_document"],
        "content_document": ["a/x_raw_content_document"],
        "text_sentence": ["a/z_text_sentence"],
        OTHER_NAMES: ["a/plain"],
    }


def test_an_earlier_output_among_the_inputs_is_refused(folder, tmp_path, capsys):
    """Merging into the input folder, then running the same command again, would repeat the first merge."""
    out = folder / "all_text_document"
    args = ["merge", "--input", f"{folder}/*_text_document", "--output-prefix", str(out)]
    assert main(args) == 0
    assert main(args) == 2
    assert "all_text_document: the output is also one of the inputs" in capsys.readouterr().err
    assert merged_rows(out) == [[1, 0], [2, 0], [10, 0]]  # the first merge, untouched
