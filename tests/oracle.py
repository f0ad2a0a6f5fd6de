"""megatron-core, the oracle of the exactness tests, imported only when a test uses it.

Only oracle tests may skip, and only because megatron-core is not installed: a test that compares
with megatron-core carries ``@pytest.mark.oracle`` (tests/conftest.py skips it where megatron-core
is absent, and with ``--no-skips`` fails the run on any other skip). Every other test in the same
module runs. Modules reach megatron-core through :func:`module` and :func:`null_tokenizer`, which
import on first use, so a module never skips as a whole. Where megatron-core is installed, an
import that fails is a failure, not a skip.
"""

from __future__ import annotations

import importlib
import importlib.util

MISSING = "oracle: megatron-core is not installed (tests/install.py installs it)"


def installed() -> bool:
    """Whether megatron-core can be found (without importing it: its import pulls in torch)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:  # no `megatron` package at all, or one that is not megatron-core's
        return False


class _Module:
    """A megatron-core module imported at its first attribute lookup."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str):
        return getattr(importlib.import_module(self._name), attribute)

    def __repr__(self) -> str:
        return f"<megatron-core module {self._name}, imported on use>"


def module(name: str) -> _Module:
    return _Module(name)


def null_tokenizer(vocab_size: int = 50256):
    """megatron-core's ``NullTokenizer``, the tokenizer its dataset configs need."""
    return null_tokenizer_class()(vocab_size)


def null_tokenizer_class():
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    return NullTokenizer
