"""A weighted mixture of datasets over one index space: the mixture file, and row i of the mixture defined exactly.

The file takes TRL's `DatasetMixtureConfig` layout (a `datasets:` list of sources: `path`, `name`, `split`,
`data_files`, `columns`), with a `weight` on each source (1 when none is given), and two keys of this tool's own: a
source's `data_format` (its rows' format, when its columns do not say; sources of different formats mix in one run)
and its `eval_split` (the split its held-out rows come from).

Row i is defined with no random draw, by proportional selection over integer weights P = (p_1, ..., p_n):
`counts(k)` is how many rows each source gives to the first k rows of the mixture, computed by walking the sources in
their listed order (R = p_1 + ... + p_n): `rest = k * (R - p_j) // R`, `count_j = k - rest`, `R -= p_j`, `k = rest`.
Exactly one source's count grows from `counts(i)` to `counts(i + 1)`: row i is that source's row `counts(i + 1)_j - 1`,
numbered as a run on that source alone numbers its rows. So rows [s, e) of the mixture need rows
[counts(s)_j, counts(e)_j) of each source, which are contiguous, and row i never depends on the rows before it. A
source's share of the first k rows stays within n - 1 rows of k * p_j / R.

The mixture's length N is the largest N at which every source still has its `counts(N)_j` rows: it stops at the
first source used up. A source that grows by appended rows changes no row below the old N.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

from fsdp_opt.base import DataError
from fsdp_opt.config.choices import DATA_FORMATS
from fsdp_opt.data.resolve import DEFAULT_SPLIT, DataSource
from fsdp_opt.data.table import Table

MIXTURE_SUFFIXES = (".yaml", ".yml", ".json")
SOURCE_KEYS = ("path", "name", "split", "data_files", "columns", "weight", "data_format", "eval_split")
FILE_KEYS = ("datasets", "streaming")  # TRL's `streaming` is accepted and changes nothing: ranges are read by range
MAX_MIXTURE_BYTES = 1 << 20  # a .json file larger than this is a dataset of rows


def is_mixture_file(spec: str) -> bool:
    """--dataset names a mixture file (a .yaml, .yml or .json file holding a `datasets:` list)."""
    path = Path(spec)
    if path.suffix.lower() not in MIXTURE_SUFFIXES or not path.is_file():
        return False
    if path.suffix.lower() != ".json":
        return True
    if path.stat().st_size > MAX_MIXTURE_BYTES:  # a dataset of rows, not read here to find out
        return False
    try:  # a .json file may be a dataset of rows instead: a mixture file is one object with a `datasets` list
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and "datasets" in data


@dataclass(frozen=True)
class MixtureSource:
    """One source of a mixture: where its rows come from, its weight as written, and what it says of its rows."""

    source: DataSource
    weight: Fraction
    columns: tuple[str, ...] | None = None
    data_format: str | None = None  # None: --data_format (auto: found from the source's columns)
    eval_split: str | None = None  # the split its held-out rows come from

    def record(self) -> dict[str, Any]:
        """What a chain's pin records of the source besides its rows' identity: its weight and what names it."""
        out = {"dataset": self.source.dataset, **self.source.names(), "weight": str(self.weight)}
        out |= {"columns": list(self.columns)} if self.columns else {}
        out |= {"data_format": self.data_format} if self.data_format else {}
        return out | ({"eval_split": self.eval_split} if self.eval_split else {})


@dataclass(frozen=True)
class Mixture:
    file: str
    sources: tuple[MixtureSource, ...]
    weights: tuple[int, ...] = field(default=())  # the integer weights P, reduced by their gcd

    def describe(self) -> str:
        parts = [f"{s.source.describe()} x{w}" for s, w in zip(self.sources, self.weights)]
        return f"mixture {self.file}: " + ", ".join(parts)


def integer_weights(weights: Sequence[Fraction | int | float | str]) -> tuple[int, ...]:
    """The weights as integers in the same ratio, reduced by their gcd: decimals are scaled exactly, as written
    (0.5, 0.3, 0.2 -> 5, 3, 2; 1/3 as a fraction -> exact too)."""
    fractions = [w if isinstance(w, Fraction) else Fraction(str(w)) for w in weights]
    if not fractions or any(f <= 0 for f in fractions):
        raise ValueError(f"weights must be positive: {weights}")
    scale = math.lcm(*(f.denominator for f in fractions))
    ints = [int(f * scale) for f in fractions]
    g = math.gcd(*ints)
    return tuple(i // g for i in ints)


def counts(k: int, weights: Sequence[int]) -> list[int]:
    """How many rows each source gives to the first k rows of the mixture."""
    total = sum(weights)
    out = []
    for p in weights:
        rest = k * (total - p) // total
        out.append(k - rest)
        total -= p
        k = rest
    return out


def source_of(i: int, weights: Sequence[int]) -> tuple[int, int]:
    """Row i of the mixture: (the source, that source's row)."""
    (j,) = order(i, i + 1, weights)
    return j, counts(i + 1, weights)[j] - 1


def source_ranges(start: int, end: int, weights: Sequence[int]) -> list[tuple[int, int]]:
    """The rows [counts(start)_j, counts(end)_j) of each source that rows [start, end) of the mixture hold."""
    return list(zip(counts(start, weights), counts(end, weights)))


def mixture_length(sizes: Sequence[int], weights: Sequence[int]) -> int:
    """The largest N at which every source still has its counts(N)_j rows (counts only grow with N)."""
    lo, hi = 0, sum(sizes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if all(c <= n for c, n in zip(counts(mid, weights), sizes)):
            lo = mid
        else:
            hi = mid - 1
    return lo


def order(start: int, end: int, weights: Sequence[int]) -> list[int]:
    """The source of each of rows [start, end), in the mixture's order."""
    out, before = [], counts(start, weights)
    for i in range(start, end):
        after = counts(i + 1, weights)
        out.append(next(j for j, (a, b) in enumerate(zip(before, after)) if b != a))
        before = after
    return out


class MixtureTable:
    """Rows [start, end) of the mixture read as each source's contiguous range (a parquet source reads only the row
    groups that hold it), interleaved in the mixture's order. Its columns are those every source has (of the ones a
    source keeps, when it names them): the columns asked for are read from each, or each source's own (`each`) where
    its rows are of another format."""

    def __init__(
        self,
        tables: Sequence[Table],
        weights: Sequence[int],
        identity: dict[str, Any] | None = None,
        kept: Sequence[Sequence[str] | None] | None = None,
        names: Sequence[str] | None = None,
        formats: Sequence[str | None] | None = None,
        held: Sequence[DataSource | None] | None = None,
    ) -> None:
        self.tables, self.weights = list(tables), tuple(weights)
        self.identity = identity or {}
        self.kept = list(kept or [None] * len(self.tables))
        self.names = list(names or [f"source {n}" for n in range(1, len(self.tables) + 1)])
        self.formats = list(formats or [None] * len(self.tables))  # each source's data_format, None: the run's
        self.held = list(held or [None] * len(self.tables))  # each source's eval split, where it names one
        self.length = mixture_length([len(t) for t in self.tables], self.weights)

    @property
    def source_columns(self) -> list[list[str]]:
        """Each source's columns (the ones it keeps, when it names them)."""
        return [list(k) if k else t.column_names for t, k in zip(self.tables, self.kept)]

    @property
    def column_names(self) -> list[str]:
        each = self.source_columns
        return [c for c in each[0] if all(c in other for other in each[1:])]

    def given_line(self, start: int, end: int) -> str:
        """What each source gives to rows [start, end), as the run's summary says it."""
        parts = [
            f"{n:,} of {name} (rows [{a:,}, {b:,}))"
            for name, n, (a, b) in zip(
                self.names, self.given(start, end), source_ranges(start, min(end, self.length), self.weights)
            )
        ]
        return (
            f"data: mixture rows [{start:,}, {min(end, self.length):,}), weights {':'.join(map(str, self.weights))}: "
            + ", ".join(parts)
        )

    def __len__(self) -> int:
        return self.length

    def rows(
        self, start: int, end: int, columns: Sequence[str], each: Sequence[Sequence[str]] | None = None
    ) -> list[dict[str, Any]]:
        end = min(end, self.length)
        if start >= end:
            return []
        wanted = each or [columns] * len(self.tables)
        parts = [
            iter(t.rows(a, b, c)) if b > a else iter(())
            for t, c, (a, b) in zip(self.tables, wanted, source_ranges(start, end, self.weights))
        ]
        return [next(parts[j]) for j in order(start, end, self.weights)]

    def origins(self, start: int, end: int) -> list[int]:
        """The source of each of rows [start, end)."""
        return order(start, min(end, self.length), self.weights)

    def given(self, start: int, end: int) -> list[int]:
        """How many of rows [start, end) each source gives."""
        return [b - a for a, b in source_ranges(start, min(end, self.length), self.weights)]


class After:
    """A table's rows from `start` on, numbered from 0: a source's rows after the ones a slice took."""

    def __init__(self, table: Table, start: int) -> None:
        self.table, self.start = table, min(start, len(table))

    @property
    def column_names(self) -> list[str]:
        return self.table.column_names

    def __len__(self) -> int:
        return len(self.table) - self.start

    def rows(self, start: int, end: int, columns: Sequence[str]) -> list[dict[str, Any]]:
        return self.table.rows(self.start + start, self.start + end, columns)


def _fail(file: str, what: str) -> DataError:
    return DataError(f"--dataset {file}: {what}")


def _weight(file: str, where: str, value: Any) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _fail(file, f"{where}: weight {value!r} is not a number")
    try:
        weight = Fraction(str(value).strip())
    except (ValueError, ZeroDivisionError):
        raise _fail(file, f"{where}: weight {value!r} is not a number") from None
    if weight <= 0:
        raise _fail(file, f"{where}: weight {value} must be greater than 0")
    return weight


def read_mixture(file: str, revision: str | None = None) -> Mixture:
    """The mixture file, checked: one line naming the file and the key when something in it is wrong."""
    path = Path(file)
    try:
        text = path.read_text()
    except OSError as exc:
        raise _fail(file, f"cannot read the mixture file ({exc.strerror})") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except Exception as exc:  # noqa: BLE001 - a parse error of either format, shown as one line
        raise _fail(file, f"not a readable mixture file ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise _fail(file, "a mixture file holds a `datasets:` list of sources")
    unknown = [k for k in data if k not in FILE_KEYS]
    if unknown:
        raise _fail(file, f"unknown key {unknown[0]!r} (a mixture file has: {', '.join(FILE_KEYS)})")
    entries = data.get("datasets")
    if not isinstance(entries, list) or not entries:
        raise _fail(file, "lists no source (a `datasets:` list with at least one `path`)")
    sources = []
    for n, entry in enumerate(entries, 1):
        where = f"source {n}"
        if not isinstance(entry, dict):
            raise _fail(file, f"{where} is not a mapping of {', '.join(SOURCE_KEYS)}")
        unknown = [k for k in entry if k not in SOURCE_KEYS]
        if unknown:
            raise _fail(file, f"{where}: unknown key {unknown[0]!r} (a source has: {', '.join(SOURCE_KEYS)})")
        if not isinstance(entry.get("path"), str) or not entry["path"].strip():
            raise _fail(file, f"{where} has no `path` (a Hub id, or a local file or folder)")
        where = f"source {n} ({entry['path']})"
        data_format = entry.get("data_format")
        if data_format is not None and data_format not in DATA_FORMATS:
            raise _fail(file, f"{where}: data_format {data_format!r} is not one of {', '.join(DATA_FORMATS)}")
        eval_split = entry.get("eval_split")
        if eval_split is not None and (not isinstance(eval_split, str) or not eval_split.strip()):
            raise _fail(file, f"{where}: eval_split must be a split's name")
        if eval_split is not None and eval_split == (entry.get("split") or DEFAULT_SPLIT):
            raise _fail(file, f"{where}: eval_split {eval_split} is the split it trains on")
        columns = entry.get("columns")
        if columns is not None and (not isinstance(columns, list) or not all(isinstance(c, str) for c in columns)):
            raise _fail(file, f"{where}: columns must be a list of column names")
        data_files = entry.get("data_files")
        if data_files is not None and not isinstance(data_files, str):
            raise _fail(file, f"{where}: data_files must be one file name or glob")
        local = (path.parent / entry["path"]) if not Path(entry["path"]).is_absolute() else Path(entry["path"])
        dataset = str(local) if local.exists() else entry["path"]  # a local path is read beside the mixture file
        source = DataSource(dataset, entry.get("name"), entry.get("split") or DEFAULT_SPLIT, data_files, revision)
        sources.append(
            MixtureSource(
                source,
                _weight(file, where, entry.get("weight", 1)),
                tuple(columns) if columns else None,
                data_format,
                eval_split,
            )
        )
    return Mixture(file, tuple(sources), integer_weights([s.weight for s in sources]))
