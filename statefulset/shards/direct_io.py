"""Append-only file output that bypasses the page cache where the filesystem allows it.

Writing a shard through the page cache makes the kernel find a fresh page for every 4 KiB,
which on virtual machines that hand free memory back to the host costs more than the data
itself (measured in docs/benchmarks.md). Here every byte goes through one reused, page-aligned
staging buffer and leaves it in large ``O_DIRECT`` writes. Filesystems that refuse
``O_DIRECT`` (tmpfs, some network filesystems) get ordinary buffered writes of the same
buffer. ``STATEFULSET_DIRECT_IO=0`` turns direct writes off.
"""

from __future__ import annotations

import errno
import mmap
import os

from statefulset import settings

_ALIGN = 4096
_BUFFER_BYTES = 32 << 20


def _direct_wanted() -> bool:
    return hasattr(os, "O_DIRECT") and settings.DIRECT_IO.get()


class SequentialWriter:
    """Create ``path`` (mode 0666 less the umask; it must not exist) and append to it."""

    def __init__(self, path: str, buffer_bytes: int = _BUFFER_BYTES) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        self._direct = False
        if _direct_wanted():
            try:
                import fcntl

                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) | os.O_DIRECT)
                self._direct = True
            except OSError:
                pass
        self._buffer = mmap.mmap(-1, buffer_bytes)  # anonymous maps are page-aligned
        self._view = memoryview(self._buffer)
        self._fill = 0
        self.size = 0

    @property
    def direct(self) -> bool:
        return self._direct

    def write(self, data: object) -> None:
        source = memoryview(data).cast("B")  # type: ignore[arg-type]
        capacity = len(self._view)
        while len(source):
            take = min(len(source), capacity - self._fill)
            self._view[self._fill : self._fill + take] = source[:take]
            self._fill += take
            self.size += take
            source = source[take:]
            if self._fill == capacity:
                self._drain(capacity)

    def _drain(self, nbytes: int) -> None:
        done = 0
        while done < nbytes:
            try:
                done += os.write(self._fd, self._view[done:nbytes])
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self._direct:
                    raise
                self._buffered()  # the filesystem took the flag but refuses the writes
        self._fill = 0

    def _buffered(self) -> None:
        import fcntl

        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self._direct = False

    def close(self) -> None:
        """Write the tail, trim the padding direct I/O needs, and fsync."""
        if self._fd < 0:
            return
        try:
            tail = self._fill
            if self._direct and tail % _ALIGN:
                padded = -(-tail // _ALIGN) * _ALIGN
                self._view[tail:padded] = bytes(padded - tail)
                self._drain(padded)
                os.ftruncate(self._fd, self.size)
            else:
                self._drain(tail)
            os.fsync(self._fd)
        finally:
            self._release()

    def abort(self) -> None:
        if self._fd >= 0:
            self._release()

    def _release(self) -> None:
        os.close(self._fd)
        self._fd = -1
        self._view.release()
        self._buffer.close()
