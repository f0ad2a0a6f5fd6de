"""Code blocks of the Markdown docs, for tests/test_docs.py: parsing, output checks, shell commands.

The conventions (also in docs/README.md, "Docs are tests"):

- every fenced block is a :class:`Block`; the HTML comment on the line right before its fence is
  its marker: ``<!-- illustration: <why it cannot run here> -->`` skips it, ``<!-- output -->``
  says the block shows what the page's previous Python block printed;
- in a Python block, a comment on a ``print(...)`` line (or, when that line has none, a
  comment-only line right after it) shows what the call prints: the comment starts with it,
  followed by nothing, a space or a colon;
- in shown output (console transcripts, ``<!-- output -->`` blocks) ``...`` inside a line matches
  any text and a line holding only ``...`` matches any number of lines.
"""

from __future__ import annotations

import ast
import io
import re
import shlex
import tokenize
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*(illustration|output)\s*(?::(.*?))?\s*-->\s*$")
ANY_MARKER = re.compile(r"^\s*<!--\s*(illustration|output)\b")  # a marker line (prose may quote one)
PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell", "console"}


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # "illustration", "output" or None
    reason: str  # the illustration's reason ("" when there is none)

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


def parse(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, start = match.group(2), i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        marker = MARKER.match(lines[start - 1]) if start else None
        blocks.append(
            Block(
                path=path,
                line=start + 1,
                lang=match.group(3).lower(),
                code="\n".join(body) + "\n",
                marker=marker.group(1) if marker else None,
                reason=(marker.group(2) or "").strip() if marker else "",
            )
        )
        i += 1
    return blocks


def stray_markers(path: Path) -> list[str]:
    """Markers that are malformed or not on the line right before a fence (they would skip nothing)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    bad = []
    for n, line in enumerate(lines):
        if not ANY_MARKER.search(line):
            continue
        well_formed = MARKER.match(line)
        before_fence = n + 1 < len(lines) and FENCE.match(lines[n + 1])
        if not (well_formed and before_fence):
            bad.append(f"{path.name}:{n + 1}: {line.strip()}")
    return bad


# -- Python blocks ------------------------------------------------------------------------------
def _comments(code: str) -> dict[int, tuple[str, bool]]:
    """Line -> (comment text, whether the line holds nothing but the comment)."""
    found: dict[int, tuple[str, bool]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT:
            alone = not tok.line[: tok.start[1]].strip()
            found[tok.start[0]] = (tok.string[1:].strip(), alone)
    return found


def instrument(code: str, offset: int, filename: str) -> tuple[object, dict[int, str]]:
    """Compile ``code`` with each documented ``print`` recorded; return (code object, line -> expected).

    ``offset`` shifts line numbers so tracebacks name the Markdown file's own lines.
    """
    tree = ast.parse(code, filename)
    comments = _comments(code)
    expected: dict[int, str] = {}
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id == "print"
        ):
            continue
        end = node.end_lineno or node.lineno
        comment = comments.get(end)
        if comment is None or comment[1]:
            following = comments.get(end + 1)
            comment = following if following and following[1] else None
        if comment is None:
            continue
        expected[node.lineno + offset] = comment[0]
        node.value.func = ast.Name("__doc_print__", ast.Load())
        node.value.args.insert(0, ast.Constant(node.lineno + offset))
    ast.fix_missing_locations(tree)
    ast.increment_lineno(tree, offset)
    return compile(tree, filename, "exec"), expected


class PrintRecorder:
    """``__doc_print__``: prints as ``print`` does and remembers the text per source line."""

    def __init__(self) -> None:
        self.printed: dict[int, list[str]] = defaultdict(list)

    def __call__(self, line: int, *args: object, **kwargs: object) -> None:
        buffer = io.StringIO()
        print(*args, **{**kwargs, "file": buffer})
        text = buffer.getvalue()
        print(text, end="")
        self.printed[line].append(text.rstrip("\n"))

    def mismatches(self, expected: dict[int, str], filename: str) -> list[str]:
        problems = []
        for line, comment in sorted(expected.items()):
            outputs = self.printed.get(line)
            if not outputs:
                problems.append(f"{filename}:{line}: this print never ran")
                continue
            for out in outputs:
                if not shown_matches(comment, out):
                    problems.append(f"{filename}:{line}: prints {out!r}, the comment says {comment!r}")
        return problems


def shown_matches(comment: str, out: str) -> bool:
    """A comment shows ``out`` when it starts with it, then ends or goes on after a space or colon."""
    if "\n" in out:
        return False  # several lines: show them in an <!-- output --> block instead
    if "..." in comment:  # the comment elides part of the output
        pattern = ".*?".join(re.escape(part) for part in comment.split("..."))
        return re.fullmatch(pattern, out) is not None
    return re.match(re.escape(out) + r"(?=$|[ :])", comment) is not None


def output_matches(shown: str, actual: str) -> bool:
    """Shown output against real output: each shown line in order; ``...`` elides text or lines."""
    lines = [line.rstrip() for line in actual.splitlines()]
    pattern = []
    for line in shown.strip("\n").splitlines():
        line = line.rstrip()
        if line.strip() == "...":
            pattern.append(r"(?:.*\n)*?")
        else:
            pattern.append(".*?".join(re.escape(part) for part in line.split("...")) + r"\n")
    return re.search("^" + "".join(pattern), "\n".join(lines) + "\n", re.MULTILINE) is not None


# -- shell blocks -------------------------------------------------------------------------------
@dataclass
class Command:
    line: int  # line in the Markdown file
    text: str  # the statefulset command as written (first word and all)
    shown: str  # output shown after it (console transcripts), "" when none


def statefulset_commands(block: Block) -> list[Command]:
    """The ``statefulset ...`` commands of a bash/sh/console block, continuations joined, comments dropped."""
    console = block.lang == "console"
    found: list[Command] = []
    lines = block.code.splitlines()
    i = 0
    while i < len(lines):
        raw, start = lines[i], i
        if console and not raw.startswith("$ "):
            i += 1
            continue
        text = raw[2:] if console else raw
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        shown: list[str] = []
        if console:
            while i < len(lines) and not lines[i].startswith("$ "):
                shown.append(lines[i])
                i += 1
        for piece in _simple_commands(text):
            words = shlex.split(piece)
            if words and Path(words[0]).name == "statefulset":
                found.append(Command(block.line + 1 + start, piece.strip(), "\n".join(shown)))
    return found


def _simple_commands(text: str) -> list[str]:
    """Split a command line at ``&&``, ``||``, ``;`` and ``|``, dropping a trailing comment.

    Tokens keep their quotes (non-POSIX lexing), so a quoted glob stays quoted for the shell.
    """
    lexer = shlex.shlex(text, posix=False, punctuation_chars=";&|")
    lexer.commenters = "#"
    lexer.whitespace_split = True
    pieces: list[list[str]] = [[]]
    for token in lexer:
        if token in {"&&", "||", ";", "|", "&"}:
            pieces.append([])
        else:
            pieces[-1].append(token)
    return [" ".join(p) for p in pieces if p]
