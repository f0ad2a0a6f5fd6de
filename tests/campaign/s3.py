"""The campaign's S3 side: one moto server per session (tests/s3_servers.py), a boto3 client, and a
fault proxy (tests/s3_proxy.py) per case that injects faults, so cases never share fault settings."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = SECRET = "testing"


def client(endpoint: str):
    import boto3

    return boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET, region_name="us-east-1"
    )


def ensure_bucket(s3, bucket: str) -> None:
    with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
        s3.create_bucket(Bucket=bucket)


def put_file(s3, path: str, bucket: str, key: str) -> None:
    """One PutObject: no transfer-manager threads in a case process that forks afterwards."""
    with open(path, "rb") as f:
        s3.put_object(Bucket=bucket, Key=key, Body=f.read())


def upload_copy(s3, bucket: str, shards: dict[str, str], prefix: str) -> None:
    for name, local in shards.items():
        for ext in (".bin", ".idx"):
            put_file(s3, local + ext, bucket, f"{prefix}/{name}{ext}")


def env_for(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
    }


class CaseProxy:
    """tests/s3_proxy.py in front of the session's server, for one case."""

    def __init__(self, endpoint: str) -> None:
        upstream = endpoint.rsplit(":", 1)[1]
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(TESTS, "s3_proxy.py"), upstream],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith("port="):
            self.close()
            raise RuntimeError(f"the fault proxy did not start (said {line!r})")
        self.endpoint = f"http://127.0.0.1:{int(line.strip().split('=')[1])}"

    def set(self, **faults: float) -> None:
        query = "&".join(f"{k}={v}" for k, v in faults.items())
        with urllib.request.urlopen(f"{self.endpoint}/__proxy__/set?{query}", timeout=10) as answer:
            json.loads(answer.read())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
