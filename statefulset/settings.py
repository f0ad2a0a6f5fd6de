"""Every environment variable the library reads, in one place, each with its type, default and meaning.

A variable is read when it is used (not at import), so launchers and tests may set it at any time
before. A blank value means "not set" for every variable. A value that does not parse raises a
:class:`StatefulsetError` naming the variable, the value and what it must be.

``docs/settings.md`` is generated from :data:`ALL` (``python docs/build_settings.py``) and a test
checks it matches, and that the package reads no ``STATEFULSET_*`` variable missing here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from statefulset.errors import StatefulsetError

T = TypeVar("T")


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError
    return value


def _non_negative_seconds(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise ValueError
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError
    return value


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _boolean(text: str) -> bool:
    lowered = text.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        lowered = text.lower()
        if lowered not in allowed:
            raise ValueError
        return lowered

    return parse


def _text(text: str) -> str:
    return text


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: ``get()`` gives its typed value, or ``default`` when unset or blank."""

    name: str
    default: T
    parse: Callable[[str], T]
    must_be: str
    meaning: str

    def raw(self) -> str | None:
        text = os.environ.get(self.name, "")
        return text.strip() or None

    def get(self) -> T:
        text = self.raw()
        if text is None:
            return self.default
        try:
            return self.parse(text)
        except ValueError:
            raise StatefulsetError(
                f"environment variable {self.name}={os.environ.get(self.name)!r}: must be {self.must_be}"
            ) from None

    def is_set(self) -> bool:
        return self.raw() is not None


# --------------------------------------------------------------------------- loading

WORKER_START_TIMEOUT = Setting(
    "STATEFULSET_WORKER_START_TIMEOUT", 30.0, _positive_seconds, "a positive number of seconds",
    "A forked DataLoader worker silent this long after the fork is taken for dead (CPython gh-112275) and "
    "the workers start again from the next undelivered batch.",
)  # fmt: skip
READ_AHEAD = Setting(
    "STATEFULSET_READ_AHEAD", 8, _non_negative_int, "a whole number of batches >= 0",
    "Batches a process reads ahead from object storage, and with num_workers=0 the batches its "
    "helper thread builds a request (0 turns read-ahead off).",
)  # fmt: skip

# --------------------------------------------------------------------------- preprocessing

TASK_TIMEOUT = Setting(
    "STATEFULSET_TASK_TIMEOUT", 3600.0, _positive_seconds, "a positive number of seconds",
    "preprocess stops, naming the units still held, when no worker or Ray task finished anything for this long.",
)  # fmt: skip
TEST_GATE = Setting(
    "STATEFULSET_TEST_GATE", "", _text, "a file path",
    "Tests only: while this file exists, preprocess units wait before they start (a Ray task only when its "
    "number is at least the one the file holds; blank holds all), at most STATEFULSET_TASK_TIMEOUT, so that "
    "a fault test's kill always lands mid-run.",
)  # fmt: skip
PIECE_CACHE = Setting(
    "STATEFULSET_PIECE_CACHE", True, _boolean, "one of 1/true/yes/on or 0/false/no/off",
    "0 sends every text through the Hugging Face tokenizer's own pipeline; by default a GPT-2 style byte-level "
    "BPE encodes each distinct piece of ASCII text once per process (the same ids, faster).",
)  # fmt: skip
POOL_LOG_SECONDS = Setting(
    "STATEFULSET_POOL_LOG_SECONDS", 60.0, _positive_seconds, "a positive number of seconds",
    "preprocess --workers logs what it still waits for at this interval.",
)  # fmt: skip

# --------------------------------------------------------------------------- compiled kernels

KERNELS = Setting(
    "STATEFULSET_KERNELS", True, _boolean, "one of 1/true/yes/on or 0/false/no/off",
    "0 turns the compiled kernels off: the pure-Python implementations (same results, 10-100x slower) run.",
)  # fmt: skip
KERNEL_DIR = Setting(
    "STATEFULSET_KERNEL_DIR", "", _text, "a folder",
    "Where the kernel library is compiled at run time when the installed one is missing or stale; "
    "it must be owned by this user and writable by nobody else, or it is refused. Default: <user cache>/kernels.",
)  # fmt: skip
CC = Setting("CC", "cc", _text, "a compiler command", "The C compiler used when kernels are compiled at run time.")

# --------------------------------------------------------------------------- object storage

S3_CLIENT = Setting(
    "STATEFULSET_S3_CLIENT", "auto", _choice("auto", "obstore", "s3fs"), "auto, obstore or s3fs",
    "Which client makes ranged reads of s3:// shards: obstore where installed and the storage options allow, "
    "or s3fs. auto falls back to s3fs with a WARNING; obstore makes options it cannot honour, or obstore "
    "missing, an error at open.",
)  # fmt: skip
STORAGE_RETRIES = Setting(
    "STATEFULSET_STORAGE_RETRIES", 6, _non_negative_int, "a whole number >= 0",
    "Attempts after the first for a storage request that failed transiently (throttling, 5xx, timeouts).",
)  # fmt: skip
STORAGE_RETRY_SECONDS = Setting(
    "STATEFULSET_STORAGE_RETRY_SECONDS", 120.0, _non_negative_seconds, "a number of seconds >= 0",
    "The whole time budget for one storage request's retries.",
)  # fmt: skip
STORAGE_CALL_SECONDS = Setting(
    "STATEFULSET_STORAGE_CALL_SECONDS", 60.0, _positive_seconds, "a number of seconds > 0",
    "The longest one storage call of preprocessing waits (an upload, a download, a listing ...) before it "
    "counts as a transient timeout and is retried; uploads and downloads get one more second per 8 MiB "
    "they move. Also the S3 clients' read timeout (s3fs: per socket read; obstore: per request) where "
    "storage_options set none.",
)  # fmt: skip
STORAGE_MAX_REQUESTS = Setting(
    "STATEFULSET_STORAGE_MAX_REQUESTS", 32, _positive_int, "a whole number >= 1",
    "The most ranged reads of object storage a process keeps in flight, shared by all its readers; the "
    "limit halves when the store fails transiently (throttling, timeouts) and grows back as it answers.",
)  # fmt: skip
REMOTE_CACHE = Setting(
    "STATEFULSET_REMOTE_CACHE", "", _text, "a folder",
    "Where local copies of remote .idx files are kept. Default: <user cache>/remote-idx.",
)  # fmt: skip

# --------------------------------------------------------------------------- caches, locks, files

CACHE_WAIT = Setting(
    "STATEFULSET_CACHE_WAIT", 3600.0, _positive_seconds, "a positive number of seconds",
    "How long a process waits for another that holds a lock on shared work (an index build, a download).",
)  # fmt: skip
LOCK = Setting(
    "STATEFULSET_LOCK", "flock", _choice("flock", "file"), "flock or file",
    "file: lock files with heartbeats instead of flock, for file systems whose flock is local to a node "
    "(NFS local_lock, Lustre localflock). Temporary files of shards being written never use flock: another "
    "node's are judged by their heartbeat (stale after 300 s) in either mode.",
)  # fmt: skip
DIRECT_IO = Setting(
    "STATEFULSET_DIRECT_IO", True, _boolean, "one of 1/true/yes/on or 0/false/no/off",
    "0 turns O_DIRECT writes of large shards off (writes then go through the page cache).",
)  # fmt: skip
CACHE_HOME = Setting(
    "XDG_CACHE_HOME", "", _text, "a folder",
    "The user cache folder is $XDG_CACHE_HOME/statefulset (default ~/.cache/statefulset).",
)  # fmt: skip

ALL: tuple[Setting, ...] = tuple(v for v in globals().values() if isinstance(v, Setting))


def user_cache_dir() -> str:
    """This user's cache folder for statefulset: ``$XDG_CACHE_HOME/statefulset`` or ``~/.cache/statefulset``."""
    base = CACHE_HOME.get() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "statefulset")


def table() -> str:
    """The Markdown table of docs/settings.md."""
    rows = ["| variable | default | must be | meaning |", "|---|---|---|---|"]
    for setting in ALL:
        default = setting.default
        shown = "unset" if default == "" else ("on" if default is True else str(default))
        rows.append(f"| `{setting.name}` | {shown} | {setting.must_be} | {setting.meaning} |")
    return "\n".join(rows) + "\n"
