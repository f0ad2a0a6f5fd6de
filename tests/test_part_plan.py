"""The Ray executor's plan: raw byte ranges whose tasks find the line ends (no probing by the planner).

A line belongs to the range it starts in; whatever the range and block sizes, the ranges of a file
together yield every line once, in order, and their byte counts add up to the file's size.
"""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from statefulset.tools.locations import Folder
from statefulset.tools.part_merge import committed_numbers, part_name
from statefulset.tools.part_tasks import plan, span_chunks

line = st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"."))


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(line, max_size=30),
    final_newline=st.booleans(),
    task_bytes=st.integers(1, 120),
    chunk_bytes=st.integers(1, 64),
)
def test_ranges_yield_every_line_once_in_order(tmp_path_factory, lines, final_newline, task_bytes, chunk_bytes):
    data = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    assume(not data.startswith((b"PAR1", b"\x1f\x8b")))  # Parquet or gzip by their magic bytes
    path = tmp_path_factory.mktemp("span") / "in.jsonl"
    path.write_bytes(data)
    tasks = plan([str(path)], ("text",), task_bytes)
    got, total = [], 0
    for task in tasks:
        for unit in task.chunks:
            assert unit.span and unit.nbytes <= task_bytes
            for piece in span_chunks(unit.path, unit.offset, unit.nbytes, chunk_bytes):
                got += piece.lines
                total += piece.nbytes
    expected = data.split(b"\n")
    if expected and not expected[-1]:
        expected.pop()
    assert got == expected
    assert total == len(data)


def test_committed_parts_past_a_million_tasks_are_found_by_their_numbers(tmp_path):
    """On 5cf6a81 the resume read ``int(name[5:11])``: part-1000000.done was taken for task 100000 and
    part-12345678.done for 123456, so a resume of a run past 999,999 tasks skipped and redid the wrong parts."""
    numbers = {0, 42, 999_999, 1_000_000, 1_234_567, 12_345_678}
    for n in numbers:
        (tmp_path / (part_name(n) + ".done")).write_text("{}")
        (tmp_path / f"{part_name(n)}_text_document.bin").write_bytes(b"")
    (tmp_path / "manifest.json").write_text("{}")
    (tmp_path / "part-000007.done.tmp").write_text("")  # never committed
    assert part_name(1_000_000) == "part-1000000"
    assert committed_numbers(Folder(str(tmp_path)).names()) == numbers
