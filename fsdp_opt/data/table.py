"""A dataset split as the trainer reads it: its length, its columns, and rows [start, end) of some columns, read when
asked. A rows table holds rows built here (the built-ins); an in-memory table wraps a `datasets.Dataset` (local
JSON/CSV/text, a split that had to be downloaded whole); a parquet table reads only the row groups that hold the rows
asked for.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from fsdp_opt.data.parquet import ParquetReader, SplitIndex, fetched_line
from fsdp_opt.runtime.distributed import print0

PROGRESS_DELAY_S = 2.0  # a fetch that takes longer shows a progress bar (bytes and rows)


class Table(Protocol):
    identity: dict[str, Any]  # what the rows come from, as a chain pins it (data/pin.py)

    @property
    def column_names(self) -> list[str]: ...

    def __len__(self) -> int: ...

    def rows(self, start: int, end: int, columns: Sequence[str]) -> list[dict[str, Any]]: ...


class MemoryTable:
    """A `datasets.Dataset` (or anything with its select / select_columns / column_names)."""

    def __init__(self, ds: Any, identity: dict[str, Any] | None = None) -> None:
        self.ds = ds
        self.identity = identity or {}

    @property
    def column_names(self) -> list[str]:
        return list(self.ds.column_names)

    def __len__(self) -> int:
        return len(self.ds)

    def rows(self, start: int, end: int, columns: Sequence[str]) -> list[dict[str, Any]]:
        return list(self.ds.select(range(start, end)).select_columns(list(columns)))


class RowsTable:
    """Rows built by this package (the built-in datasets), kept as they are. Not a `datasets.Dataset`: building one
    from Python objects hashes them for its fingerprint, which fails on some platforms' package sets (a pandas 3
    image: "Can't pickle <class 'MonthDayNano'>"), and nothing here needs its cache."""

    def __init__(self, rows: list[dict[str, Any]], identity: dict[str, Any] | None = None) -> None:
        self._rows = rows
        self._columns = list(rows[0]) if rows else []
        self.identity = identity or {}

    @property
    def column_names(self) -> list[str]:
        return list(self._columns)

    def __len__(self) -> int:
        return len(self._rows)

    def rows(self, start: int, end: int, columns: Sequence[str]) -> list[dict[str, Any]]:
        missing = [c for c in columns if c not in self._columns]
        if missing:
            raise KeyError(f"no column {missing[0]!r} (the columns: {', '.join(self._columns)})")
        return [{c: row[c] for c in columns} for row in self._rows[start:end]]


def as_table(data: Any) -> Table:
    """A Table as it is, a `datasets.Dataset` wrapped."""
    return data if hasattr(data, "rows") and hasattr(data, "identity") else MemoryTable(data)


class ParquetTable:
    """A split's parquet files (data/parquet.py): rows are read by row group, cast to the features the dataset card
    declares, as `datasets` casts them."""

    def __init__(self, index: SplitIndex, reader: ParquetReader, identity: dict[str, Any], what: str) -> None:
        self.index, self.reader, self.identity, self.what = index, reader, identity, what

    @property
    def column_names(self) -> list[str]:
        return list(self.index.columns)

    def __len__(self) -> int:
        return self.index.rows

    def rows(self, start: int, end: int, columns: Sequence[str]) -> list[dict[str, Any]]:
        from tqdm.auto import tqdm

        remote = any(f.url.startswith("hf://") for f in self.index.files)
        started, before = time.perf_counter(), self.reader.fetched
        with tqdm(
            desc=f"data: rows [{start:,}, {end:,}) of {self.what}",
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            delay=PROGRESS_DELAY_S,
            disable=not remote,
            leave=False,
        ) as bar:
            got = [0]

            def progress(nbytes: int, rows: int) -> None:
                got[0] += rows
                bar.update(nbytes)
                bar.set_postfix(rows=f"{got[0]:,}", refresh=False)

            table = self.reader.read(self.index, start, end, columns, progress)
        if remote:
            print0(
                fetched_line(
                    f"rows [{start:,}, {end:,}) of {self.what}",
                    self.reader.fetched - before,
                    table.num_rows,
                    time.perf_counter() - started,
                )
            )
        if self.index.features:
            from datasets import Features
            from datasets.table import table_cast

            features = Features.from_dict({c: self.index.features[c] for c in columns if c in self.index.features})
            if len(features) == len(columns):
                table = table_cast(table, features.arrow_schema)
        return table.to_pylist()
