"""storage_options["config_kwargs"] reach obstore (review C12): timeouts, proxies, addressing style, region.

The proxy test runs moto behind tests/s3_proxy.py used as a forward proxy: the ranged reads obstore
makes must go through the proxy named in ``config_kwargs["proxies"]``. A botocore option obstore
cannot honour keeps the reads on s3fs, which honours it, instead of being dropped.
"""

from __future__ import annotations

import logging
import sys

import pytest
from s3_servers import moto_server, proxy, upload

from statefulset.errors import StatefulsetError
from statefulset.shards import obstore_client
from statefulset.shards.remote import RemoteFile

pytest.importorskip("obstore")


def test_config_kwargs_map_to_obstore_settings():
    options = {"config_kwargs": {"connect_timeout": 5, "read_timeout": 30.5, "region_name": "eu-west-1",
                                 "s3": {"addressing_style": "virtual"}, "proxies": {"https": "http://proxy:3128"},
                                 "retries": {"total_max_attempts": 1}}}  # fmt: skip
    config, client = obstore_client.client_settings(options, "https://store.example")
    assert config == {"region": "eu-west-1", "virtual_hosted_style_request": True}
    assert client == {"allow_http": True, "connect_timeout": "5s", "timeout": "30.5s", "proxy_url": "http://proxy:3128"}
    config, client = obstore_client.client_settings({}, "http://127.0.0.1:9000")
    assert config == {"virtual_hosted_style_request": False}  # a custom endpoint without a style: path-style
    assert client == {"allow_http": True, "connect_timeout": "10s", "timeout": "60s"}
    url = "s3://b/k.bin"
    assert obstore_client.wanted(url, options)
    assert not obstore_client.wanted(url, {"config_kwargs": {"signature_version": "s3v4"}})  # s3fs honours it
    assert not obstore_client.wanted(url, {"config_kwargs": {"s3": {"use_accelerate_endpoint": True}}})


def test_options_obstore_cannot_honour_warn_once_naming_them(caplog):
    """A fallback to s3fs that slows the reads is a WARNING, once per process, naming the keys and the remedy."""
    options = {"requester_pays": True, "config_kwargs": {"signature_version": "s3v4"}}
    with caplog.at_level(logging.WARNING, logger="statefulset"):
        assert not obstore_client.wanted("s3://b/a.bin", options)
        assert not obstore_client.wanted("s3://b/b.bin", options)
    warned = [r for r in caplog.records if "cannot be honoured by obstore" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING, caplog.text
    text = warned[0].getMessage()
    assert "s3://b/a.bin: storage_options requester_pays, config_kwargs.signature_version" in text, text
    assert "through s3fs, slower" in text and "STATEFULSET_S3_CLIENT=s3fs" in text, text


def test_the_read_timeout_defaults_to_the_storage_call_setting(monkeypatch):
    """STATEFULSET_STORAGE_CALL_SECONDS is the S3 clients' read timeout where storage_options set none
    (settings.py); obstore's was hard-wired to 60 s (seen: "timeout": "60s" with the setting at 7)."""
    monkeypatch.setenv("STATEFULSET_STORAGE_CALL_SECONDS", "7")
    _, client = obstore_client.client_settings({}, "http://127.0.0.1:9000")
    assert client["timeout"] == "7s"
    _, client = obstore_client.client_settings({"config_kwargs": {"read_timeout": 30}}, None)
    assert client["timeout"] == "30s"  # storage_options still win


def test_obstore_reads_go_through_the_proxy_config_kwargs_name(tmp_path, monkeypatch):
    """Failed on 5cf6a81: obstore ignored config_kwargs, so the reads bypassed the proxy."""
    monkeypatch.setenv("STATEFULSET_S3_CLIENT", "obstore")
    data = bytes(range(256)) * 1000
    (tmp_path / "x.bin").write_bytes(data)
    with moto_server() as server, proxy(server) as p:
        upload(server, "options", {"x.bin": str(tmp_path / "x.bin")})
        options = {**server.options(), "config_kwargs": {"proxies": {"http": p.endpoint}, "connect_timeout": 5,
                                                         "s3": {"addressing_style": "path"}}}  # fmt: skip
        assert obstore_client.wanted("s3://options/x.bin", options)
        remote = RemoteFile("s3://options/x.bin", options)
        p.reset()
        assert remote.read_ranges([0, 200_000], [16, 16]) == [data[:16], data[200_000:200_016]]
        # The reads went through the proxy (0 before the fix). One GET or two: a process whose
        # requests were throttled earlier (the limiter is per process) coalesces wider.
        assert p.stats()["ranged"] >= 1


def test_obstore_asked_for_but_unusable_is_an_error_naming_the_url_and_the_cause(monkeypatch):
    """STATEFULSET_S3_CLIENT=obstore is a request, not a preference: options obstore cannot honour, or
    obstore missing, raise at open instead of falling back to s3fs (before: a WARNING and s3fs reads)."""
    monkeypatch.setenv("STATEFULSET_S3_CLIENT", "obstore")
    with pytest.raises(StatefulsetError, match=r"s3://b/k\.bin: STATEFULSET_S3_CLIENT=obstore.*requester_pays"):
        obstore_client.wanted("s3://b/k.bin", {"requester_pays": True})
    with pytest.raises(StatefulsetError, match=r"s3://b/k\.bin: .*requester_pays"):
        RemoteFile("s3://b/k.bin", {"requester_pays": True})  # where a dataset's open meets it
    monkeypatch.setitem(sys.modules, "obstore", None)  # obstore not installed: its import fails
    with pytest.raises(StatefulsetError, match=r"s3://b/k\.bin: STATEFULSET_S3_CLIENT=obstore, but obstore cannot be"):
        obstore_client.wanted("s3://b/k.bin", {})
    monkeypatch.setenv("STATEFULSET_S3_CLIENT", "auto")  # the default still falls back, with its WARNING
    assert not obstore_client.wanted("s3://b/k.bin", {})
