"""Docs are tests: README.md and docs/*.md run as written, and configs/*.yaml open for real.

- Every ```python block runs, unless the line right before its fence is
  ``<!-- illustration: <why it cannot run here> -->``. The blocks of one page run in order in one
  namespace, as one session (pages read top to bottom, later snippets use earlier names), in a
  fresh folder holding a copy of the workspace below. A comment on a ``print`` line must show what
  it prints (tests/docblocks.py); an ``<!-- output -->`` block must show what the page's previous
  Python block printed.
- Every ``statefulset ...`` command of a ```bash / ```sh / ```console block runs (same marker
  rule), in order per page, in a fresh copy of the workspace, and must succeed; a console
  transcript's shown output must be what the command prints (then it may also fail, as shown).
- Every ``configs/*.yaml`` loads with its shards checked and opens every split it builds.

The workspace is what a new user has after ``statefulset demo`` in a fresh clone, plus the
inputs the docs' commands name: ``statefulset-demo/`` (made once per session by running
``statefulset demo``, the README's own command), ``configs/``, JSON lines in ``data/`` and
``corpus.jsonl.gz`` (keys ``text`` and ``title``), a BPE ``tokenizer.json`` (also at
``path/to/tokenizer.json``) trained here with ``tokenizers``, a ``dataset.yaml`` (megatron packing
over the demo shards) and ``nemo_run.ckpt`` (the data-module entry of a NeMo checkpoint with
``consumed_samples`` 4096). ``$HOME`` points into the session
folder, so ``demo_spec()`` writes its corpus there once for every page.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from docblocks import (
    PYTHON,
    SHELL,
    PrintRecorder,
    instrument,
    output_matches,
    parse,
    shown_matches,
    statefulset_commands,
)
from docblocks import stray_markers as find_stray_markers

from statefulset import load_spec, merge_datasets, open_stream
from statefulset.tools.demo import generate_documents

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
DATASET_YAML = """\
data_path: [0.5, statefulset-demo/shards/part_1_text_document, 0.3, statefulset-demo/shards/part_2_text_document,
            0.2, statefulset-demo/shards/part_10_text_document]
seq_length: 128
split: 98,2,0
seed: 1234
packing: megatron
num_samples: 20000
path_to_cache: .statefulset_cache
"""
PAGE_SECONDS = 180  # a page that takes longer is a hang (an endless loader loop), not slowness


def _blocks(langs: set[str]) -> dict[str, list]:
    found = {page.relative_to(ROOT).as_posix(): [b for b in parse(page) if b.lang in langs] for page in PAGES}
    return {name: blocks for name, blocks in found.items() if blocks}


PYTHON_PAGES = _blocks(PYTHON)
SHELL_PAGES = {name: blocks for name, blocks in _blocks(SHELL).items() if any(statefulset_commands(b) for b in blocks)}


def _cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


# -- the workspace ------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("docs")


@pytest.fixture(scope="session")
def demo_corpus(session_dir) -> Path:
    """``statefulset demo`` run once, as the README says, in the folder the workspaces link to."""
    run = subprocess.run(
        [sys.executable, "-m", "statefulset", "demo"],
        cwd=session_dir,
        env=_cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and "demo: PASS" in run.stdout, run.stdout + run.stderr
    return session_dir / "statefulset-demo"


def _train_tokenizer(path: Path, texts: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))


@pytest.fixture(scope="session")
def workspace(session_dir, demo_corpus) -> Path:
    folder = session_dir / "workspace"
    folder.mkdir()
    (folder / "statefulset-demo").symlink_to(demo_corpus, target_is_directory=True)
    shutil.copytree(ROOT / "configs", folder / "configs")
    docs = [{"text": d["text"], "title": d["text"][:24]} for d in generate_documents(600, seed=7)]
    (folder / "data").mkdir()
    for part, chunk in (("part_1", docs[:200]), ("part_2", docs[200:400]), ("part_10", docs[400:])):
        with gzip.open(folder / "data" / f"{part}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(d) + "\n" for d in chunk)
    with gzip.open(folder / "corpus.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    _train_tokenizer(folder / "tokenizer.json", [d["text"] for d in docs])
    (folder / "path" / "to").mkdir(parents=True)
    shutil.copy(folder / "tokenizer.json", folder / "path" / "to" / "tokenizer.json")
    (folder / "dataset.yaml").write_text(DATASET_YAML)
    torch.save({"PreTrainingDataModule": {"consumed_samples": 4096}}, folder / "nemo_run.ckpt")
    (session_dir / "home").mkdir()
    return folder


@pytest.fixture
def fresh_workspace(workspace, tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "ws"
    shutil.copytree(workspace, folder, symlinks=True)
    monkeypatch.chdir(folder)
    monkeypatch.setenv("HOME", str(workspace.parent / "home"))
    return folder


@contextlib.contextmanager
def _time_limit(seconds: int, what: str):
    def expire(signum, frame):
        raise TimeoutError(f"{what} still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# -- the conventions ----------------------------------------------------------------------------
def test_markers_are_well_formed_and_give_reasons():
    problems = [line for page in PAGES for line in find_stray_markers(page)]
    problems += [
        f"{b.where}: illustration without a reason"
        for page in PAGES
        for b in parse(page)
        if b.marker == "illustration" and not b.reason
    ]
    assert not problems, "\n".join(problems)


def test_every_page_with_code_is_collected():
    assert "README.md" in PYTHON_PAGES and "README.md" in SHELL_PAGES
    assert len(PYTHON_PAGES) >= 10, sorted(PYTHON_PAGES)


def test_the_conventions_themselves(tmp_path):
    assert shown_matches("5000: a finite stream", "5000") and shown_matches("0 5 0 1 4", "0 5 0 1 4")
    assert not shown_matches("50001", "5000") and not shown_matches("4999: no", "5000")
    assert shown_matches("...x.yaml: key 'seed': bad", "/tmp/ws/x.yaml: key 'seed': bad")
    assert output_matches("a\n...\nd ... f", "a\nb\nc\nd e f\n") and not output_matches("a\nd", "a\nb\nd")
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- illustration: needs a GPU -->\n```python\nx = 1\n```\n\n<!-- illustration -->\n"
        "```console\n$ statefulset inspect a \\\n    --json  # note\n{\n$ ls && statefulset merge --input 'p/*' "
        "--output-prefix o\n```\n<!-- illustration: nothing follows -->\ntext\n"
    )
    blocks = parse(page)
    assert [(b.lang, b.marker, b.reason) for b in blocks] == [
        ("python", "illustration", "needs a GPU"),
        ("console", "illustration", ""),
    ]
    commands = statefulset_commands(blocks[1])
    assert [(c.text, c.shown) for c in commands] == [
        ("statefulset inspect a --json", "{"),
        ("statefulset merge --input 'p/*' --output-prefix o", ""),
    ]
    assert find_stray_markers(page) == ["page.md:13: <!-- illustration: nothing follows -->"]


# -- Python blocks ------------------------------------------------------------------------------
@pytest.mark.parametrize("page", sorted(PYTHON_PAGES))
def test_python_blocks_run(page, fresh_workspace):
    namespace: dict[str, object] = {"__name__": "__docs__"}
    recorder = PrintRecorder()
    namespace["__doc_print__"] = recorder
    last_output = ""
    problems: list[str] = []
    try:
        for block in parse(ROOT / page):
            if block.marker == "illustration":
                continue
            if block.marker == "output":
                if not output_matches(block.code, last_output):
                    problems.append(f"{block.where}: shown output differs from the previous block's:\n{last_output}")
                continue
            if block.lang not in PYTHON:
                continue
            code, expected = instrument(block.code, block.line, str(ROOT / page))
            buffer = io.StringIO()
            with _time_limit(PAGE_SECONDS, block.where), contextlib.redirect_stdout(buffer):
                try:
                    exec(code, namespace)
                except Exception as error:
                    raise AssertionError(f"{block.where}: the block fails ({type(error).__name__}: {error})") from error
            last_output = buffer.getvalue()
            problems += recorder.mismatches(expected, page)
    finally:
        # Functions defined by the blocks hold the namespace, a cycle: left to the cyclic garbage
        # collector, every loader in it would wait out torch's 5 s worker-join timeout later on.
        namespace.clear()
    assert not problems, "\n".join(problems)


# -- statefulset commands -----------------------------------------------------------------------
def _run_command(text: str, cwd: Path) -> subprocess.CompletedProcess:
    rest = text.partition(" ")[2]  # the first word is statefulset (or a path to it)
    argv0 = f"{shlex.quote(sys.executable)} -m statefulset"
    return subprocess.run(
        ["bash", "-c", f"{argv0} {rest}"], cwd=cwd, env=_cli_env(), capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("page", sorted(SHELL_PAGES))
def test_statefulset_commands_run(page, fresh_workspace):
    for block in SHELL_PAGES[page]:
        if block.marker == "illustration":
            continue
        for command in statefulset_commands(block):
            if shlex.split(command.text)[1:] == ["demo"]:
                continue  # exactly what the demo_corpus fixture ran for the whole session
            run = _run_command(command.text, fresh_workspace)
            where = f"{page}:{command.line}: {command.text}"
            output = run.stdout + run.stderr
            if command.shown:
                assert output_matches(command.shown, output), f"{where}: shown output differs from:\n{output}"
            else:
                assert run.returncode == 0, f"{where}: exit {run.returncode}\n{output}"


# -- configs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_config_opens_for_real(config, fresh_workspace):
    path = fresh_workspace / "configs" / config.name
    text = path.read_text()
    if "s3://" in text:
        # No bucket here: the same file with its URLs on fsspec's memory filesystem, each holding the
        # demo corpus three times over (its 1/1000 validation split then still fills a 4096-token sample).
        import fsspec

        corpus = merge_datasets(["statefulset-demo/corpus_text_document"] * 3, "tripled").path_prefix
        fs = fsspec.filesystem("memory")
        for url in re.findall(r"s3://(\S+?):", text):
            for ext in (".bin", ".idx"):
                fs.pipe(f"/{url}{ext}", Path(corpus + ext).read_bytes())
        path.write_text(text.replace("s3://", "memory://"))
    spec = load_spec(path)  # checks that every shard exists
    splits = [s for s in ("train", "valid", "test") if spec.blend_for(s) is not None]
    assert "train" in splits
    for split in splits:
        stream = open_stream(path, split)
        assert len(stream) > 0, (config.name, split)
        assert stream.gather([0, len(stream) - 1]).shape == (2, spec.seq_length + 1)
