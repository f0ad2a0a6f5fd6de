"""Input files cut into chunks for ``preprocess``: byte ranges of plain JSON lines, runs of decompressed
lines of gzip files, row groups of Parquet files; and a chunk's lines or rows, read where it is encoded."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from statefulset.errors import StatefulsetError
from statefulset.tools import locations


@dataclass(frozen=True)
class Chunk:
    """A run of whole lines: given as ``lines`` (decompressed input), or as a byte range of a
    plain file that the worker reads itself, so the main process never touches the data; or
    row group ``offset`` of a Parquet file (``parquet``)."""

    path: str
    nbytes: int
    offset: int = 0
    lines: list[bytes] | None = None
    parquet: bool = False
    gzip: bool = False  # a whole gzip file (a unit of --executor ray): its task streams it in chunk_bytes pieces
    span: bool = False  # a raw byte range (a unit of --executor ray): its task finds the line ends (span_chunks)


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Files and glob patterns (local paths or fsspec URLs), each pattern's matches in natural order."""
    return locations.expand(list(inputs))


def is_gzip(path: str) -> bool:
    if path.endswith(".gz"):
        return True
    with locations.open_read(path) as f:
        return f.read(2) == b"\x1f\x8b"


def is_parquet(path: str) -> bool:
    """A Parquet file: by its name, or by its magic bytes (``PAR1``)."""
    if path.endswith(".parquet"):
        return True
    with locations.open_read(path) as f:
        return f.read(4) == b"PAR1"


def parquet_module():
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise StatefulsetError(
            "reading Parquet needs pyarrow: pip install 'statefulset[parquet]' (or pyarrow)"
        ) from None
    return parquet


def parquet_chunks(path: str, keys: tuple[str, ...]) -> Iterator[Chunk]:
    """One chunk per row group (Parquet's unit of reading); the columns checked once, here."""
    parquet = parquet_module()
    with locations.open_read(path) as f:
        try:
            opened = parquet.ParquetFile(f)
            meta, schema = opened.metadata, opened.schema_arrow
        except Exception as exc:  # pyarrow's own errors for a damaged footer
            raise StatefulsetError(f"{path}: not a readable Parquet file: {exc}") from exc
    columns = set(schema.names)  # top-level columns (a list column's leaf is "element")
    missing = [k for k in keys if k not in columns]
    if missing:
        raise StatefulsetError(
            f"{path}: no column {', '.join(map(repr, missing))} (its columns: {', '.join(sorted(columns))}); "
            "--json-keys names the columns to tokenise"
        )
    for group in range(meta.num_row_groups):
        rg = meta.row_group(group)
        size = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
        yield Chunk(path, size, offset=group, parquet=True)


def chunks(
    paths: list[str], chunk_bytes: int, keys: tuple[str, ...] = ("text",), whole_gzip: bool = False
) -> Iterator[Chunk]:
    for path in paths:
        try:
            if is_parquet(path):
                yield from parquet_chunks(path, keys)
            elif is_gzip(path) and whole_gzip:
                yield Chunk(path, locations.size(path), gzip=True)
            elif is_gzip(path):
                yield from gzip_chunks(path, chunk_bytes)
            else:
                yield from plain_chunks(path, chunk_bytes)
        except OSError as exc:
            raise StatefulsetError(f"{path}: cannot read: {exc}") from exc


def plain_chunks(path: str, chunk_bytes: int) -> Iterator[Chunk]:
    """Byte ranges ending at line ends: one seek and one short readline per chunk."""
    size = locations.size(path)
    with locations.open_read(path) as f:
        start = 0
        while start < size:
            f.seek(min(start + chunk_bytes, size))
            f.readline()
            end = min(f.tell(), size)
            yield Chunk(path, end - start, offset=start)
            start = end


def gzip_chunks(path: str, chunk_bytes: int) -> Iterator[Chunk]:
    """Runs of decompressed lines of about ``chunk_bytes``: one gzip stream is read in order, never whole."""
    with locations.open_read(path) as raw, gzip.GzipFile(fileobj=raw) as stream:
        position = 0
        while True:
            try:
                lines = stream.readlines(chunk_bytes)
            except (OSError, EOFError, zlib.error) as exc:
                raise StatefulsetError(f"{path}: cannot decompress: {exc}") from exc
            if not lines:
                return
            now = raw.tell()
            yield Chunk(path, now - position, lines=lines)
            position = now


def rows(chunk: Chunk, keys: tuple[str, ...]) -> list[object]:
    """A row group's ``keys`` columns as one dict per row (what a JSON line parses into)."""
    parquet = parquet_module()
    try:
        with locations.open_read(chunk.path) as f:
            table = parquet.ParquetFile(f).read_row_group(chunk.offset, columns=list(keys))
    except Exception as exc:
        raise StatefulsetError(f"{chunk.path}: cannot read row group {chunk.offset}: {exc}") from exc
    return table.to_pylist()


def lines_of(chunk: Chunk) -> list[bytes]:
    if chunk.lines is not None:
        return chunk.lines
    with locations.open_read(chunk.path) as f:
        f.seek(chunk.offset)
        data = f.read(chunk.nbytes)
    lines = data.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()  # the newline ending the last line
    return lines
