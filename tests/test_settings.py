"""statefulset.settings: one typed reader for every environment variable (issue 24, §2)."""

from __future__ import annotations

import pytest

from statefulset import StatefulsetError, settings
from statefulset.tools.worker_pool import ordered_map


def _double(x: int) -> int:
    return 2 * x


def _nothing() -> None:
    return None


@pytest.mark.parametrize("setting", settings.ALL, ids=lambda s: s.name)
def test_blank_means_unset(setting, monkeypatch):
    monkeypatch.setenv(setting.name, "  ")
    assert setting.get() == setting.default


BAD = {
    "STATEFULSET_WORKER_START_TIMEOUT": ["0", "-1", "soon", "nan"],
    "STATEFULSET_READ_AHEAD": ["-1", "2.5", "many"],
    "STATEFULSET_TASK_TIMEOUT": ["0", "x"],
    "STATEFULSET_POOL_LOG_SECONDS": ["0", "-3"],
    "STATEFULSET_KERNELS": ["maybe"],
    "STATEFULSET_S3_CLIENT": ["boto"],
    "STATEFULSET_STORAGE_RETRIES": ["-1", "1.5"],
    "STATEFULSET_STORAGE_RETRY_SECONDS": ["-1", "inf"],
    "STATEFULSET_CACHE_WAIT": ["0", "soon"],
    "STATEFULSET_LOCK": ["nfs"],
    "STATEFULSET_DIRECT_IO": ["sometimes"],
}


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, values in BAD.items() for v in values])
def test_a_bad_value_is_named(name, value, monkeypatch):
    setting = next(s for s in settings.ALL if s.name == name)
    monkeypatch.setenv(name, value)
    with pytest.raises(StatefulsetError, match=f"environment variable {name}={value!r}: must be {setting.must_be}"):
        setting.get()


def test_booleans_share_one_spelling(monkeypatch):
    for word, value in [("0", False), ("off", False), ("No", False), ("1", True), ("TRUE", True), ("on", True)]:
        monkeypatch.setenv("STATEFULSET_DIRECT_IO", word)
        monkeypatch.setenv("STATEFULSET_KERNELS", word)
        assert settings.DIRECT_IO.get() is value and settings.KERNELS.get() is value


def test_pool_log_seconds_zero_is_refused_not_a_busy_loop(monkeypatch):
    """On 5cf6a81 STATEFULSET_POOL_LOG_SECONDS=0 was taken as is and made every wait a log-spamming spin."""
    monkeypatch.setenv("STATEFULSET_POOL_LOG_SECONDS", "0")
    with pytest.raises(StatefulsetError, match="STATEFULSET_POOL_LOG_SECONDS='0': must be a positive number"):
        list(ordered_map(_double, range(3), workers=1, initializer=_nothing))


def test_user_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert settings.user_cache_dir() == str(tmp_path / "statefulset")
