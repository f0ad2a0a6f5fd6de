"""Chat data into segments: ``statefulset preprocess --chat-template FILE`` (docs/instruction-data.md).

A key holding a conversation ``[{"role": ..., "content": ...}, ...]`` is rendered with a Jinja
chat template in the Hugging Face format (``messages``, ``add_generation_prompt``; rendered in a
sandbox, with HF's ``trim_blocks``/``lstrip_blocks`` and ``raise_exception``), and cut into
segments by rendering it prefix by prefix: the text message ``i`` adds to the rendering of
messages ``[0, i)`` is its segment, with ``loss`` true when its role is in ``loss_roles`` (default
``assistant``). An assistant turn is cut once more: the generation prompt
(``add_generation_prompt=True``: e.g. the ``<|im_start|>assistant\\n`` header) is a segment of its
own with ``loss`` false, and the rest of the turn (content and end-of-turn marker) is learnt. Other
roles in ``loss_roles`` are learnt whole (header included).
A template that does not render a conversation as a growing prefix (one that rewrites earlier
turns, e.g. drops past reasoning) is refused naming the message, never cut wrongly.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from statefulset.errors import StatefulsetError


@dataclass(frozen=True)
class ChatSpec:
    """What a worker needs: the template's text (shipped, not its path) and the roles with loss."""

    template: str
    loss_roles: tuple[str, ...] = ("assistant",)
    where: str = "--chat-template"

    def fingerprint(self) -> str:
        """What a run's outputs depend on (a Ray run's manifest, a worker's setup key)."""
        digest = hashlib.blake2b(self.template.encode(), digest_size=12).hexdigest()
        return f"{digest}:{','.join(self.loss_roles)}"


def load(path: str, loss_roles: tuple[str, ...]) -> ChatSpec:
    """The template file, checked to compile here (fail fast, naming the file)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise StatefulsetError(f"--chat-template {path}: cannot read: {exc}") from None
    if not loss_roles:
        raise StatefulsetError("--loss-roles needs at least one role")
    spec = ChatSpec(text, tuple(loss_roles), f"--chat-template {path}")
    ChatRenderer(spec)
    return spec


class ChatRenderer:
    """A compiled template: conversations into segments."""

    def __init__(self, spec: ChatSpec) -> None:
        try:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise StatefulsetError(f"{spec.where}: chat templates need jinja2: pip install jinja2") from None
        self.spec = spec
        self._errors = TemplateError
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(spec.template)
        except TemplateError as exc:
            raise StatefulsetError(f"{spec.where}: not a Jinja template: {exc}") from None

    def _render(self, messages: list[dict[str, Any]], generation: bool) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=generation)
        except (self._errors, _TemplateRaised, TypeError, ValueError) as exc:
            raise _Refused(f"the chat template failed on it: {exc}") from None

    def segments(self, messages: object, key: str) -> list[tuple[str, bool]] | str:
        """``(text, loss)`` segments of a conversation, or the reason it is refused."""
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            return f"key {key!r}: a conversation must be a list of objects with string 'role' and 'content'"
        out: list[tuple[str, bool]] = []
        done = ""
        try:
            for i, message in enumerate(messages):
                learnt = message["role"] in self.spec.loss_roles
                if learnt and message["role"] == "assistant":  # the turn a generation prompt opens
                    head = self._render(messages[:i], True)
                    done = _grow(out, done, head, False, i, key)
                done = _grow(out, done, self._render(messages[: i + 1], False), learnt, i, key)
        except _Refused as exc:
            return f"key {key!r}: {exc}"
        return out


def _grow(out: list[tuple[str, bool]], done: str, now: str, loss: bool, i: int, key: str) -> str:
    if not now.startswith(done):
        raise _Refused(
            f"message {i}: the chat template does not render the conversation as a growing prefix (it changes "
            "earlier text), so its turns cannot be cut into segments"
        )
    if len(now) > len(done):
        out.append((now[len(done) :], loss))
    return now


class _Refused(Exception):
    pass


class _TemplateRaised(Exception):
    pass


def _raise(message: str) -> None:
    raise _TemplateRaised(message)
