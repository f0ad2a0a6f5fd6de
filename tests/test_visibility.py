"""What the tools tell a user: --version, preprocess's EOD line, progress on a terminal and in a log."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

import statefulset
from statefulset.tools.cli import main
from statefulset.tools.progress import Progress

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "statefulset", *map(str, args)], capture_output=True, text=True, **kwargs
    )


def test_version_is_the_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"statefulset {statefulset.__version__}\n"
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert declared is not None and declared.group(1) == statefulset.__version__


def write_lines(path: Path, count: int = 40) -> Path:
    path.write_text("".join(json.dumps({"text": f"document {i} of the visibility test"}) + "\n" for i in range(count)))
    return path


def test_preprocess_names_the_eod_token_it_appended(tmp_path):
    source = write_lines(tmp_path / "in.jsonl")
    run = cli("preprocess", "--input", source, "--output-prefix", tmp_path / "b", "--append-eod", "--quiet")
    assert run.returncode == 0, run.stderr
    assert "appended EOD token 256 (the byte tokenizer's end of document) to each document" in run.stdout
    run = cli("preprocess", "--input", source, "--output-prefix", tmp_path / "n", "--quiet")
    assert "appended no end-of-document token (--append-eod adds one)" in run.stdout


def test_preprocess_names_a_hugging_face_eod_token(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<|endoftext|>"])
    tok.train_from_iterator(["document of the visibility test"] * 5, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    source = write_lines(tmp_path / "in.jsonl")
    args = ["--input", source, "--output-prefix", tmp_path / "h", "--tokenizer", tmp_path / "tokenizer.json"]
    run = cli("preprocess", *args, "--append-eod", "--quiet")
    assert run.returncode == 0, run.stderr
    assert "appended EOD token 1 '<|endoftext|>' to each document" in run.stdout


def test_progress_in_a_log_file_is_plain_lines(tmp_path):
    """stderr is a pipe here: no carriage-return bar, one line with the totals at the end."""
    source = write_lines(tmp_path / "in.jsonl")
    run = cli("preprocess", "--input", source, "--output-prefix", tmp_path / "o")
    assert run.returncode == 0, run.stderr
    assert "\r" not in run.stderr
    (line,) = run.stderr.splitlines()
    assert re.fullmatch(
        r"preprocess: 100% of input, 40 docs, \d[\d,]* tokens, .* docs/s, .* tokens/s, done in .* s", line
    )
    assert cli("preprocess", "--input", source, "--output-prefix", tmp_path / "q", "--quiet").stderr == ""


def test_progress_on_a_terminal_is_a_tqdm_bar(tmp_path):
    source = write_lines(tmp_path / "in.jsonl")
    leader, follower = pty.openpty()
    # A fresh pty is 0 columns wide, in which tqdm draws nothing; give it a terminal's size.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    try:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "statefulset",
                "preprocess",
                "--input",
                str(source),
                "--output-prefix",
                str(tmp_path / "t"),
            ],
            stdout=subprocess.PIPE,
            stderr=follower,
            text=True,
            timeout=120,
        )
        os.close(follower)
        follower = -1
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed
                break
            if not chunk:
                break
            shown += chunk
    finally:
        if follower >= 0:
            os.close(follower)
        os.close(leader)
    assert run.returncode == 0
    text = shown.decode()
    assert "preprocess: 100%|" in text and "40 docs" in text and "docs/s" in text


def test_progress_lines_come_at_most_every_interval(monkeypatch):
    out = io.StringIO()
    progress = Progress("merge", total_bytes=1000, stream=out)
    for _ in range(5):
        progress.update(1, 10, 100)
    assert out.getvalue() == ""  # within the first interval: nothing yet
    monkeypatch.setattr("statefulset.tools.progress.LINE_EVERY_S", 0.0)
    progress.update(1, 10, 100)
    progress.close()
    first, last = out.getvalue().splitlines()
    assert first.startswith("merge: 60% of input, 6 docs, 60 tokens, ")
    # Completed, it read all its input (units need not count every byte: a Parquet footer): 100%, done.
    assert last.startswith("merge: 100% of input, 6 docs, 60 tokens, ") and "done in" in last
    stopped = io.StringIO()
    interrupted = Progress("preprocess", total_bytes=1000, stream=stopped)
    interrupted.update(1, 10, 300)
    interrupted.close(completed=False)  # an error or Ctrl-C: neither 100% nor "done" (issue 25)
    line = stopped.getvalue().strip()
    assert line.startswith("preprocess: 30% of input, 1 docs, 10 tokens, ") and "stopped after" in line
    assert "done" not in line
    quiet = io.StringIO()
    silent = Progress("x", None, enabled=False, stream=quiet)
    silent.update(1, 1, 1)
    silent.close()
    assert quiet.getvalue() == "" and silent.documents == 1
