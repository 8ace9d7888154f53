"""Parquet files read a range of rows at a time: only the row groups that hold the rows, over HTTP range requests
(huggingface_hub's HfFileSystem) for a Hub dataset, from disk for a local one.

The index of a split is its files in order (the order `datasets` reads them in), and for each file its size, a
content key (a Hub file's LFS sha256, or a local file's footer digest) and the row count of each of its row groups.
Making it reads every file's footer once; a chain keeps it with its data pin, and later sessions take it from there
and read only the footers of the files their rows are in. Row i of the split is row i of the files laid end to end.
"""

from __future__ import annotations

import hashlib
import io
from bisect import bisect_right
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from fsdp_opt.base import DataError, first_line, size_text

FOOTER_THREADS = 8  # footers read at once when an index is made
PROGRESS_DELAY_S = 2.0  # a fetch that takes longer shows a progress bar


@dataclass(frozen=True)
class ParquetFileIndex:
    """One file of a split: where it is, what it holds."""

    name: str  # its path in the repo (or the folder): messages and the pin
    url: str  # what the reader opens: hf://datasets/{id}@{commit}/{name}, or a local path
    size: int
    key: str  # a Hub file's LFS sha256 (its git oid when stored without LFS); a local file's footer digest
    row_groups: tuple[int, ...]  # rows of each row group

    @property
    def rows(self) -> int:
        return sum(self.row_groups)


@dataclass(frozen=True)
class SplitIndex:
    """A split's parquet files in the order their rows are numbered, and how to type their columns."""

    files: tuple[ParquetFileIndex, ...]
    columns: tuple[str, ...]
    features: dict[str, Any] | None = None  # datasets' Features (as a dict) the card declares: rows are cast to them
    starts: tuple[int, ...] = field(default=(), compare=False)  # the first row of each file

    def __post_init__(self) -> None:
        starts, at = [], 0
        for f in self.files:
            starts.append(at)
            at += f.rows
        object.__setattr__(self, "starts", tuple(starts))

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": [{**asdict(f), "row_groups": list(f.row_groups)} for f in self.files],
            "columns": list(self.columns),
            "features": self.features,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SplitIndex:
        files = tuple(ParquetFileIndex(**{**f, "row_groups": tuple(f["row_groups"])}) for f in d["files"])
        return cls(files, tuple(d["columns"]), d.get("features"))

    def pieces(self, start: int, end: int) -> list[tuple[int, list[int], int, int]]:
        """The row groups that hold rows [start, end): (file number, its row groups, the first row they hold in the
        split, the rows to skip in them)."""
        out = []
        k = max(0, bisect_right(self.starts, start) - 1)
        while k < len(self.files) and self.starts[k] < end:
            f, at = self.files[k], self.starts[k]
            groups, first = [], None
            for g, n in enumerate(f.row_groups):
                if at + n > start and at < end:
                    groups.append(g)
                    first = at if first is None else first
                at += n
            if groups:
                out.append((k, groups, first, max(0, start - first)))
            k += 1
        return out


def footer_digest(meta: pq.FileMetaData) -> str:
    """A local file's content key without reading it whole: its footer (row groups, column chunk offsets, sizes and
    statistics) serialized."""
    sink = io.BytesIO()
    meta.write_metadata_file(sink)
    return hashlib.sha256(sink.getvalue()).hexdigest()


class ParquetReader:
    """Opens a split's files: the Hub's over HTTP range requests, local ones from disk."""

    def __init__(self, fs: Any | None = None) -> None:
        self.fs = fs  # an HfFileSystem for hf:// files
        self.fetched = 0  # bytes read from the files' data (column chunks), footers included

    def open(self, url: str):  # noqa: ANN201
        if url.startswith("hf://"):
            # NOTE: no read-ahead: pyarrow coalesces the column chunks of the row groups it is asked for (pre_buffer)
            # into few large reads, and a read-ahead block would fetch megabytes past each of them.
            return _Counted(self.fs.open(url, "rb", block_size=1 << 20, cache_type="none"), self)
        return _Counted(open(url, "rb"), self)  # noqa: SIM115 - closed with the ParquetFile

    def footer(self, url: str) -> pq.FileMetaData:
        with self.open(url) as f:
            return pq.ParquetFile(f).metadata

    def index_files(
        self, names: Sequence[str], urls: Sequence[str], sizes: Sequence[int], keys: Sequence[str | None]
    ) -> list[ParquetFileIndex]:
        """Each file's row groups, from its footer (read side by side); a local file's key from its footer."""

        def one(i: int) -> ParquetFileIndex:
            try:
                meta = self.footer(urls[i])
            except Exception as exc:  # noqa: BLE001 - a file that is not parquet, or cannot be read
                raise DataError(
                    f"--dataset: cannot read the parquet footer of {names[i]} ({first_line(exc)})"
                ) from None
            groups = tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups))
            return ParquetFileIndex(names[i], urls[i], sizes[i], keys[i] or footer_digest(meta), groups)

        with ThreadPoolExecutor(FOOTER_THREADS) as pool:
            return list(pool.map(one, range(len(urls))))

    def schema(self, url: str) -> pa.Schema:
        return self.footer(url).schema.to_arrow_schema()

    def read(
        self,
        index: SplitIndex,
        start: int,
        end: int,
        columns: Sequence[str],
        progress: Callable[[int, int], None] | None = None,
    ) -> pa.Table:
        """Rows [start, end) of the split, only `columns`. `progress(bytes, rows)` after each file's part."""
        parts = []
        for k, groups, first, skip in index.pieces(start, end):
            f = index.files[k]
            before = self.fetched
            with self.open(f.url) as handle:
                table = pq.ParquetFile(handle, pre_buffer=True).read_row_groups(groups, columns=list(columns))
            take = min(table.num_rows - skip, end - first - skip)
            parts.append(table.slice(skip, take))
            if progress:
                progress(self.fetched - before, take)
        if not parts:
            return pa.table({c: [] for c in columns})
        return pa.concat_tables(parts, promote_options="permissive") if len(parts) > 1 else parts[0]


class _Counted(io.RawIOBase):
    """A file whose reads are counted (the bytes a range read fetched, for the progress bar and the report)."""

    def __init__(self, inner: Any, reader: ParquetReader) -> None:
        self.inner, self.reader = inner, reader

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.inner.seek(offset, whence)

    def tell(self) -> int:
        return self.inner.tell()

    def readinto(self, buffer: Any) -> int:
        data = self.inner.read(len(buffer))
        buffer[: len(data)] = data
        self.reader.fetched += len(data)
        return len(data)

    def read(self, size: int = -1) -> bytes:
        data = self.inner.read(size)
        self.reader.fetched += len(data)
        return data

    def close(self) -> None:
        self.inner.close()
        super().close()

    @property
    def size(self) -> int:
        return getattr(self.inner, "size", None)


def fetched_line(what: str, nbytes: int, rows: int, seconds: float) -> str:
    return f"data: {what}: {rows:,} rows in {size_text(nbytes)} fetched in {seconds:.1f} s"
