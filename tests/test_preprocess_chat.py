"""``statefulset preprocess --chat-template FILE``: conversations into segments with loss on assistant turns.

A ChatML template in the Hugging Face format, real files, real worker processes and the command
line: the mask holds 0 on system and user turns and on the assistant header, 1 on the assistant's
content and end-of-turn marker; --workers 1 and 2 write the same bytes; --loss-roles changes the
roles that are learnt; a template that rewrites earlier turns and a malformed conversation are
refused naming the file and line.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys

import pytest

from statefulset import IndexedDataset, StatefulsetError
from statefulset.tools import chat
from statefulset.tools.preprocess import preprocess

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Drops the content of earlier assistant turns (as some reasoning templates do with past thinking).
REWRITES = (
    "{% for message in messages %}{% if loop.last or message['role'] != 'assistant' %}{{ message['content'] }}"
    "{% else %}...{% endif %}{% endfor %}"
)
CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
     {"role": "assistant", "content": "6, of course"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
]  # fmt: skip


def expected(conversation, roles=("assistant",)):
    """(text, mask) of one conversation under ChatML, as the module docstring describes the cut."""
    text, mask = "", []
    for m in conversation:
        if m["role"] in roles:
            head = "<|im_start|>assistant\n" if m["role"] == "assistant" else f"<|im_start|>{m['role']}\n"
            body = m["content"] + "<|im_end|>\n"
            if m["role"] != "assistant":  # the generation prompt is the assistant header: the whole turn
                head, body = "", f"<|im_start|>{m['role']}\n" + body
            text += head + body
            mask += [0] * len(head.encode()) + [1] * len(body.encode())
        else:
            turn = f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
            text += turn
            mask += [0] * len(turn.encode())
    return list(text.encode()), mask


@pytest.fixture
def files(tmp_path):
    (tmp_path / "chatml.jinja").write_text(CHATML)
    lines = [{"messages": c} for c in CONVERSATIONS * 30]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return tmp_path


def test_assistant_turns_have_loss_and_workers_agree(files):
    spec = chat.load(str(files / "chatml.jinja"), ("assistant",))
    for workers in (1, 2):
        preprocess([str(files / "chat.jsonl")], str(files / f"w{workers}"), json_keys=("messages",), chat=spec,
                   workers=workers, chunk_bytes=500, show_progress=False)  # fmt: skip
    tokens = IndexedDataset(files / "w1_messages_document")
    masks = IndexedDataset(files / "w1_messages_document_loss_mask")
    for i in range(len(tokens)):
        want_tokens, want_mask = expected(CONVERSATIONS[i % 2])
        assert tokens[i].tolist() == want_tokens and masks[i].tolist() == want_mask
    for name in ("_messages_document", "_messages_document_loss_mask"):
        for ext in (".bin", ".idx"):
            assert filecmp.cmp(files / f"w1{name}{ext}", files / f"w2{name}{ext}", shallow=False)


def test_the_command_line_and_loss_roles(files):
    run = subprocess.run(
        [sys.executable, "-m", "statefulset", "preprocess", "--input", str(files / "chat.jsonl"), "--output-prefix",
         str(files / "cli"), "--json-keys", "messages", "--chat-template", str(files / "chatml.jinja"),
         "--loss-roles", "assistant", "user", "--quiet"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "messages loss mask:" in run.stdout
    masks = IndexedDataset(files / "cli_messages_document_loss_mask")
    assert masks[1].tolist() == expected(CONVERSATIONS[1], ("assistant", "user"))[1]
    header = len("<|im_start|>user\nhi<|im_end|>\n")
    assert masks[1][:header].min() == 1 and masks[1][header : header + 22].max() == 0  # user learnt, header not


def test_refusals_name_the_file_and_line(files):
    (files / "rewrites.jinja").write_text(REWRITES)
    rewrites = chat.load(str(files / "rewrites.jinja"), ("assistant",))
    with pytest.raises(StatefulsetError, match=r"chat\.jsonl:1: key 'messages': message 3: the chat template does "
                                               r"not render the conversation as a growing prefix"):  # fmt: skip
        preprocess([str(files / "chat.jsonl")], str(files / "x"), json_keys=("messages",), chat=rewrites,
                   show_progress=False)  # fmt: skip
    bad = files / "bad.jsonl"
    bad.write_text(
        json.dumps({"messages": CONVERSATIONS[1]}) + "\n" + json.dumps({"messages": [{"role": "user"}]}) + "\n"
    )
    spec = chat.load(str(files / "chatml.jinja"), ("assistant",))
    with pytest.raises(
        StatefulsetError,
        match=r"bad\.jsonl:2: key 'messages': a conversation must be a list of objects with string 'role'",
    ):
        preprocess([str(bad)], str(files / "y"), json_keys=("messages",), chat=spec, show_progress=False)
    (files / "broken.jinja").write_text("{% for m in messages %}")
    with pytest.raises(StatefulsetError, match=r"--chat-template .*broken\.jinja: not a Jinja template"):
        chat.load(str(files / "broken.jinja"), ("assistant",))


def test_ray_renders_the_same_segments(files):
    pytest.importorskip("ray")
    spec = chat.load(str(files / "chatml.jinja"), ("assistant",))
    preprocess([str(files / "chat.jsonl")], str(files / "w1"), json_keys=("messages",), chat=spec, show_progress=False)
    run = subprocess.run(
        [sys.executable, "-m", "statefulset", "preprocess", "--input", str(files / "chat.jsonl"), "--output-prefix",
         str(files / "ray"), "--json-keys", "messages", "--chat-template", str(files / "chatml.jinja"),
         "--executor", "ray", "--task-bytes", "3000", "--chunk-bytes", "1024", "--quiet"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    for name in ("_messages_document", "_messages_document_loss_mask"):
        for ext in (".bin", ".idx"):
            assert filecmp.cmp(files / f"w1{name}{ext}", files / f"ray{name}{ext}", shallow=False)
