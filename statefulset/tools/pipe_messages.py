"""Pickled messages over one-way pipes, for :mod:`statefulset.tools.worker_pool`.

A message is an 8-byte length and a pickle. The main process's ends are non-blocking: it writes
what a pipe accepts now and reads what has arrived, keeping the rest for later, so it never blocks
in a send while a worker blocks sending to it (the deadlock of a shared duplex socket whose ~200 KB
buffers each way filled with a 1 MiB task one way and a several-MB result the other). A worker's
ends are ordinary blocking ones: it does one thing at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import struct
from collections import deque
from typing import Any

HEADER = struct.Struct("<Q")
PIPE_BYTES = 1 << 20  # asked of the kernel per pipe (Linux); fewer wake-ups for MiB-sized messages
READ_BYTES = 1 << 20


def pipe() -> tuple[int, int]:
    """A one-way pipe ``(read end, write end)``, as large as the kernel grants up to ``PIPE_BYTES``."""
    r, w = os.pipe()
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is not None:
        with contextlib.suppress(OSError):  # above /proc/sys/fs/pipe-max-size: the default stays
            fcntl.fcntl(w, set_size, PIPE_BYTES)
    return r, w


def _non_blocking(fd: int) -> None:
    os.set_blocking(fd, False)


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class Sender:
    """The main process's write end: :meth:`put` queues, :meth:`flush` writes what the pipe accepts."""

    def __init__(self, fd: int) -> None:
        _non_blocking(fd)
        self.fd = fd
        self._out: deque[memoryview] = deque()

    def put(self, payload: bytes) -> None:
        self._out.append(memoryview(HEADER.pack(len(payload))))
        self._out.append(memoryview(payload))

    @property
    def waiting(self) -> bool:
        """Bytes queued that the pipe has not taken yet."""
        return bool(self._out)

    def flush(self) -> None:
        """Writes until the pipe is full or nothing is left; BrokenPipeError when the reader is gone."""
        while self._out:
            head = self._out[0]
            try:
                n = os.write(self.fd, head)
            except BlockingIOError:
                return
            if n == len(head):
                self._out.popleft()
            else:
                self._out[0] = head[n:]

    def close(self) -> None:
        self._out.clear()
        with contextlib.suppress(OSError):
            os.close(self.fd)


class Receiver:
    """The main process's read end: :meth:`pump` returns the messages complete so far."""

    def __init__(self, fd: int) -> None:
        _non_blocking(fd)
        self.fd = fd
        self._header = bytearray()
        self._body: bytearray | None = None
        self._filled = 0

    def pump(self) -> list[bytearray]:
        """Complete payloads read now (EOFError when the writer closed its end mid-message or idle, and
        this call read no complete payload: the ones it read come first, the error at the next call)."""
        done: list[bytes] = []
        while True:
            try:
                if self._body is None:
                    data = os.read(self.fd, HEADER.size - len(self._header))
                    if not data:
                        if done:
                            return done
                        raise EOFError
                    self._header += data
                    if len(self._header) == HEADER.size:
                        (size,) = HEADER.unpack(self._header)
                        self._header, self._body, self._filled = bytearray(), bytearray(size), 0
                        if size == 0:
                            done.append(self._take())
                    continue
                view = memoryview(self._body)[self._filled :]
                n = os.readv(self.fd, [view[:READ_BYTES]])
                if n == 0:
                    if done:
                        return done
                    raise EOFError
                self._filled += n
                if self._filled == len(self._body):
                    done.append(self._take())
            except BlockingIOError:
                return done

    def _take(self) -> bytearray:
        body, self._body = self._body, None
        assert body is not None
        return body

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def write_blocking(fd: int, payload: bytes) -> None:
    """A worker's send: the whole message, blocking (BrokenPipeError when the main process is gone)."""
    for part in (HEADER.pack(len(payload)), memoryview(payload)):
        view = memoryview(part)
        while view:
            view = view[os.write(fd, view) :]


def _read_exactly(fd: int, size: int) -> bytearray | None:
    buffer = bytearray(size)
    view, filled = memoryview(buffer), 0
    while filled < size:
        n = os.readv(fd, [view[filled : filled + READ_BYTES]])
        if n == 0:
            return None
        filled += n
    return buffer


def read_blocking(fd: int) -> bytearray | None:
    """A worker's receive: the next payload, or None when the main process closed its end."""
    header = _read_exactly(fd, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    body = _read_exactly(fd, size)
    if body is None:
        return None
    return body
