"""The oracle must be there: the exactness tests skip without megatron-core, so CI would pass blind."""

from __future__ import annotations

import importlib.metadata

from packaging.version import Version


def test_megatron_core_is_installed_and_recent_enough():
    version = Version(importlib.metadata.version("megatron-core"))
    assert version >= Version("0.16.1"), version  # .ci/run installs 0.19.2 (the `oracle` extra)
    import megatron.core.datasets.gpt_dataset  # noqa: F401  (its package import needs triton on 0.19)
