"""Ranged reads of ``s3://`` objects through obstore (Rust's ``object_store``), when it is installed.

s3fs spends several times obstore's client CPU per ranged GET (botocore signs, parses and retries
in Python): an unrecorded profile on this project's 2-core machine gave ~2.8 against ~0.4 ms;
``benchmarks/bench_request_cpu.py`` measures it (docs/object-storage.md). A training host's CPUs
feed GPUs; a loader that needs one request per sample should not burn a core on them. So when
``obstore`` is importable (the ``s3`` extra installs it) and the spec's ``storage_options`` are
ones it can honour, the ``.bin`` ranges of an ``s3://`` object go through obstore; sizes, the
``.idx`` download and every other scheme stay on fsspec.

The same configuration reaches both: the endpoint (``endpoint_url``, ``client_kwargs``, or
``AWS_ENDPOINT_URL[_S3]``), the region, and credentials resolved by botocore exactly as s3fs
would (``key``/``secret``/``token``, ``profile``, environment, config files, instance roles),
refreshed through obstore's boto3 credential provider. ``STATEFULSET_S3_CLIENT=s3fs`` turns the
fast path off.

obstore runs a tokio runtime whose threads do not survive ``fork`` (a child that uses the
parent's runtime hangs; obstore's maintainers say it is not fork-safe). So a process uses obstore
only if no ancestor it was forked from had started it: DataLoader workers forked from a trainer
that read through obstore (``num_workers=0`` before, ``ds[p]``) read through s3fs instead, and
spawned workers, or workers of a trainer that never read a batch itself, use obstore. The trainer's
one-off reads at open (a ``.bin``'s keyed sample, statefulset.shards.digests) ask for a ``fork_safe``
read and go through s3fs, so that opening a dataset does not put its workers on s3fs (issue 26:
3.3-3.7 ms of worker CPU per ranged GET through s3fs against 0.6 through obstore).

Every fallback to s3fs that the user did not ask for (``STATEFULSET_S3_CLIENT=s3fs`` asks) logs one
WARNING per process and reason, naming why, what it costs and what to do: a process forked after
its parent started obstore's runtime (in each such worker), ``storage_options`` obstore cannot honour,
obstore not installed (in the process that opens the dataset). ``STATEFULSET_S3_CLIENT=obstore``
makes the last two an error at open instead (the user asked for obstore; nothing falls back
silently); a forked worker cannot be known at open, so that case keeps its WARNING.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from statefulset import settings
from statefulset.errors import StatefulsetError

log = logging.getLogger("statefulset")

# storage_options keys obstore can honour; with any other key the reads stay on s3fs.
_MAPPABLE = {"endpoint_url", "key", "secret", "token", "anon", "profile", "client_kwargs", "config_kwargs"}
_CLIENT_KWARGS = {"endpoint_url", "region_name"}
# botocore Config keys (storage_options["config_kwargs"]) obstore honours; with any other, reads stay on s3fs.
# "retries" is statefulset's own business (statefulset.shards.ranged_reads), whatever the client.
_CONFIG_KWARGS = {"connect_timeout", "read_timeout", "proxies", "s3", "region_name", "retries"}


# The pid of the process that started obstore's runtime (inherited by forked children).
_started_in: int | None = None
# (pid, reason) of the fallback WARNINGs logged: once per process (a forked child inherits the set).
_warned: set[tuple[int, str]] = set()
_COST = (
    "s3fs spends several times obstore's client CPU per ranged GET (issue 26 measured 3.4 ms against "
    "0.6 ms in a DataLoader worker) and keeps at most 10 requests in flight (botocore's default pool)"
)


def _warn_once(reason: str, message: str, *args: Any) -> None:
    if (os.getpid(), reason) not in _warned:
        _warned.add((os.getpid(), reason))
        log.warning(message, *args)


def usable() -> bool:
    """False in a process forked from one that had started obstore's runtime; the first time in a
    process, with a WARNING (the reads go through s3fs instead)."""
    if _started_in is None or _started_in == os.getpid():
        return True
    _warn_once(
        "fork",
        "statefulset: obstore's runtime was started in process %d before it forked this one (pid %d), and "
        "obstore does not survive fork: this process reads s3:// ranges through s3fs instead, slower: %s. "
        "Remedy: read no batch through obstore in the trainer before the DataLoader forks its workers "
        "(no ds[p], no num_workers=0 iteration first), or start the workers with "
        "multiprocessing_context='forkserver' (or 'spawn') given to get_savable_loader",
        _started_in,
        os.getpid(),
        _COST,
    )
    return False


def started_here() -> bool:
    """True when this process has started obstore's runtime (its reads may go on using it)."""
    return _started_in == os.getpid()


def wanted(url: str, storage_options: dict[str, Any] | None) -> bool:
    """True when ``url``'s ranged reads should go through obstore; a WARNING (once per process) when
    they fall back to s3fs for a reason other than ``STATEFULSET_S3_CLIENT=s3fs``. With
    ``STATEFULSET_S3_CLIENT=obstore`` there is no fallback: options obstore cannot honour, or obstore
    missing, raise ``StatefulsetError`` naming the URL and the cause."""
    choice = settings.S3_CLIENT.get()
    if choice == "s3fs":
        return False
    if not url.startswith(("s3://", "s3a://")):
        return False
    unmappable = unhonoured(storage_options or {})
    if unmappable and choice == "obstore":
        raise StatefulsetError(
            f"{url}: STATEFULSET_S3_CLIENT=obstore, but obstore cannot honour storage_options {unmappable}: "
            "drop those options, or set STATEFULSET_S3_CLIENT=auto (reads through s3fs, with a WARNING) or s3fs"
        )
    if unmappable:
        _warn_once(
            "options " + unmappable,
            "statefulset: %s: storage_options %s cannot be honoured by obstore, so the s3:// ranges of objects "
            "opened with them are read through s3fs, slower: %s. Remedy: drop those options, or set "
            "STATEFULSET_S3_CLIENT=s3fs to choose s3fs (and silence this)",
            url,
            unmappable,
            _COST,
        )
        return False
    try:
        import obstore  # noqa: F401
    except ImportError as exc:
        if choice == "obstore":
            raise StatefulsetError(
                f"{url}: STATEFULSET_S3_CLIENT=obstore, but obstore cannot be imported ({exc}): "
                "pip install 'statefulset[s3]' (or obstore), or set STATEFULSET_S3_CLIENT=auto or s3fs"
            ) from exc
        _warn_once(
            "import",
            "statefulset: %s: obstore cannot be imported (%s), so s3:// ranges are read through s3fs, slower: %s. "
            "Remedy: pip install 'statefulset[s3]' (or obstore), or set STATEFULSET_S3_CLIENT=s3fs to choose "
            "s3fs (and silence this)",
            url,
            exc,
            _COST,
        )
        return False
    return True


def unhonoured(options: dict[str, Any]) -> str:
    """The ``storage_options`` keys obstore cannot honour, named (``""``: none)."""
    client = options.get("client_kwargs") or {}
    config = options.get("config_kwargs") or {}
    keys = sorted(set(options) - _MAPPABLE)
    keys += [f"client_kwargs.{k}" for k in sorted(set(client) - _CLIENT_KWARGS)]
    keys += [f"config_kwargs.{k}" for k in sorted(set(config) - _CONFIG_KWARGS)]
    keys += [f"config_kwargs.s3.{k}" for k in sorted(set(config.get("s3") or {}) - {"addressing_style"})]
    return ", ".join(keys)


def endpoint(options: dict[str, Any]) -> str | None:
    """The S3 endpoint botocore uses for these options: theirs, else AWS_ENDPOINT_URL[_S3]."""
    return (
        options.get("endpoint_url")
        or (options.get("client_kwargs") or {}).get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )


def _seconds(value: Any) -> str:
    return f"{float(value):g}s"


def client_settings(options: dict[str, Any], endpoint: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """obstore's S3 ``config`` additions and ``client_options`` for these storage options: the endpoint's
    addressing style and botocore's ``config_kwargs`` (timeouts, proxies, addressing style, region)."""
    kwargs = options.get("config_kwargs") or {}
    config: dict[str, Any] = {}
    if kwargs.get("region_name"):
        config["region"] = kwargs["region_name"]
    style = (kwargs.get("s3") or {}).get("addressing_style")
    if style in ("virtual", "path"):
        config["virtual_hosted_style_request"] = style == "virtual"
    elif endpoint:  # botocore's "auto" with a custom endpoint: path-style, as s3fs sends it
        config["virtual_hosted_style_request"] = False
    client = {
        "allow_http": bool(endpoint and endpoint.startswith("http://")),
        "connect_timeout": _seconds(kwargs.get("connect_timeout", 10)),
        "timeout": _seconds(kwargs.get("read_timeout", settings.STORAGE_CALL_SECONDS.get())),
    }
    proxies = kwargs.get("proxies") or {}
    scheme = "http" if endpoint and endpoint.startswith("http://") else "https"
    proxy = proxies.get(scheme) or proxies.get("https") or proxies.get("http")
    if proxy:
        client["proxy_url"] = proxy
        client["allow_http"] = client["allow_http"] or proxy.startswith("http://")
    return config, client


def open_store(url: str, storage_options: dict[str, Any] | None, etag: str = "") -> tuple[Any, str]:
    """``(store, key)`` for an ``s3://bucket/key`` URL; with ``etag``, a store pinned to that version of
    the object: every request it sends carries ``If-Match: <etag>`` (its client's default headers), so
    a GET of another version is refused (412) by the store itself. Such a store serves this one object."""
    import botocore.session
    from obstore.auth.boto3 import Boto3CredentialProvider
    from obstore.store import S3Store

    options = dict(storage_options or {})
    bucket, _, key = url.split("://", 1)[1].partition("/")
    session = botocore.session.Session(profile=options.get("profile"))
    region = (
        (options.get("client_kwargs") or {}).get("region_name") or session.get_config_variable("region") or "us-east-1"
    )
    config: dict[str, Any] = {"region": region}
    found = endpoint(options)
    if found:
        config["endpoint"] = found
    extra_config, client_options = client_settings(options, found)
    config.update(extra_config)
    if etag:
        client_options["default_headers"] = {"If-Match": etag}
    provider = None
    if options.get("anon"):
        config["skip_signature"] = True
    elif options.get("key") and options.get("secret"):
        config.update(access_key_id=options["key"], secret_access_key=options["secret"])
        if options.get("token"):
            config["session_token"] = options["token"]
    else:
        provider = Boto3CredentialProvider(session)  # raises ValueError without credentials
    store = S3Store(
        bucket,
        config=config,
        credential_provider=provider,
        # statefulset.shards.faults retries (bounded); object_store would retry 10 times over 3 minutes.
        retry_config={"max_retries": 0},
        client_options=client_options,
    )
    return store, key


def gets(store: Any, key: str, starts: list[int], ends: list[int]) -> list[Callable[[], Awaitable[bytes]]]:
    """One ranged GET per ``[start, end)`` through obstore, each one awaitable (``get_range_async``: the
    request and its body in one Rust future); ``store`` from :func:`open_store`, pinned to the ETag
    recorded at open. Run them with :func:`statefulset.shards.ranged_reads.run`.

    ``get_range_async`` takes no options, so ``If-Match`` rides on the pinned store's default headers.
    The alternative, ``get_async`` with ``If-Match`` among its options and then ``bytes_async``, makes
    two futures per request, each handed back to the event loop from tokio's threads: issue 26 measured
    it at about 40% more client CPU per request than one future, at 32 requests in flight."""
    import obstore

    global _started_in
    _started_in = os.getpid()

    def make(start: int, end: int) -> Callable[[], Awaitable[bytes]]:
        async def get() -> bytes:
            if end <= start:
                return b""
            return bytes(await obstore.get_range_async(store, key, start=start, end=end))

        return get

    return [make(s, e) for s, e in zip(starts, ends, strict=True)]
