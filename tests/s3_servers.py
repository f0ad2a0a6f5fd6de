"""Real S3 API servers on loopback for tests and benchmarks: moto's server, s3rver, and the fault proxy.

- :func:`moto_server`: ``python -m moto.server`` (PyPI ``moto[server]``): in memory, quick to start.
- :func:`s3rver_server`: npm ``s3rver`` (objects are files, ranged GETs at constant cost); needs
  Node and the package (``.ci/run`` does not install it: the benchmarks use it).
- :func:`proxy`: ``tests/s3_proxy.py`` in front of either, to add latency and faults.

Every start waits a bounded time for the port and says which server did not come up.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
KEY, SECRET = "testing", "testing"
S3RVER_KEY, S3RVER_SECRET = "S3RVER", "S3RVER"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening on port {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{what} did not listen on port {port} within {seconds:g} s")


@dataclass
class Server:
    endpoint: str
    port: int
    key: str
    secret: str
    proc: subprocess.Popen

    def options(self) -> dict[str, object]:
        """storage_options for s3fs pointing at this server."""
        return {"endpoint_url": self.endpoint, "key": self.key, "secret": self.secret}

    def env(self) -> dict[str, str]:
        """The same through the environment variables boto reads."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": "us-east-1",
        }


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def moto_server() -> Iterator[Server]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port, proc, "moto server")
        yield Server(f"http://127.0.0.1:{port}", port, KEY, SECRET, proc)
    finally:
        _stop(proc)


def s3rver_command() -> list[str] | None:
    """How to run s3rver here, or None (``S3RVER_BIN``, then ``s3rver`` on PATH)."""
    explicit = os.environ.get("S3RVER_BIN")
    if explicit:
        return [explicit]
    found = shutil.which("s3rver")
    return [found] if found else None


@contextlib.contextmanager
def s3rver_server(folder: str) -> Iterator[Server]:
    command = s3rver_command()
    if command is None:
        raise RuntimeError("s3rver is not installed (npm install s3rver, then put it on PATH or set S3RVER_BIN)")
    port = free_port()
    proc = subprocess.Popen(
        [
            *command,
            "--directory",
            folder,
            "--address",
            "127.0.0.1",
            "--port",
            str(port),
            "--silent",
            "--allow-mismatched-signatures",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port, proc, "s3rver")
        yield Server(f"http://127.0.0.1:{port}", port, S3RVER_KEY, S3RVER_SECRET, proc)
    finally:
        _stop(proc)


@dataclass
class Proxy:
    endpoint: str
    port: int
    proc: subprocess.Popen

    def _get(self, path: str) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.endpoint}/__proxy__/{path}", timeout=10) as answer:
            return json.loads(answer.read())

    def set(self, **faults: float) -> None:
        self._get("set?" + "&".join(f"{k}={v}" for k, v in faults.items()))

    def reset(self) -> None:
        self._get("reset")

    def stats(self) -> dict[str, float]:
        return self._get("stats")


@contextlib.contextmanager
def proxy(upstream: Server) -> Iterator[Proxy]:
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "s3_proxy.py"), str(upstream.port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith("port="):
            raise RuntimeError(f"the fault proxy did not start (said {line!r})")
        port = int(line.strip().split("=")[1])
        yield Proxy(f"http://127.0.0.1:{port}", port, proc)
    finally:
        _stop(proc)


def upload(server: Server, bucket: str, files: dict[str, str]) -> None:
    """Create ``bucket`` (if needed) and put local files under the given keys."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.key,
        aws_secret_access_key=server.secret,
        region_name="us-east-1",
    )
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        client.create_bucket(Bucket=bucket)
    for key, path in files.items():
        client.upload_file(path, bucket, key)
