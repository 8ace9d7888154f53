"""Where rows come from: a built-in (data/builtins.py), a local file or folder, or a Hub dataset, each opened as a
Table (data/table.py) of one split; or a weighted mixture of them (data/mixture.py), whose range reads a range of
each. data/formats.py reads a slice's rows.

A Hub dataset or local folder stored as parquet is read by row group: a session fetches the rows of its range (and
its held-out rows), not the dataset. Anything else is read whole, as `datasets.load_dataset` reads it."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fsdp_opt.base import DataError, first_line, looks_like_path, quiet_hub_logs
from fsdp_opt.config.choices import BUILTIN_DATASETS
from fsdp_opt.data.builtins import builtin_split
from fsdp_opt.data.mixture import After, Mixture, MixtureTable, is_mixture_file, read_mixture, source_ranges
from fsdp_opt.data.parquet import ParquetReader, SplitIndex
from fsdp_opt.data.pin import pinned_revision
from fsdp_opt.data.resolve import (
    DEFAULT_SPLIT,
    DataSource,
    Resolved,
    download_line,
    export_files,
    index_split,
    listing,
    split_files,
)
from fsdp_opt.data.table import MemoryTable, ParquetTable, Table
from fsdp_opt.runtime.distributed import print0

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def check_exists(src: DataSource, eval_split: str | None = None) -> None:
    """That the dataset the flags name is there: a built-in, a local file or folder, or a Hub dataset (one metadata
    request, no card or file read). Run before anything is taken or built: the chain's lease, the model. A mixture
    file: each of its sources."""
    if is_mixture_file(src.dataset):
        mix = _mixture_file(src)
        if eval_split:
            raise DataError(
                f"--eval_split {eval_split}: not with a mixture file (--dataset {src.dataset}): its "
                "held-out rows are the mixture's rows right after the slice (--eval_rows alone)"
            )
        for n, ms in enumerate(mix.sources, 1):
            with _in_mixture(src, n, ms.source):
                check_exists(ms.source)
        return
    if src.dataset in BUILTIN_DATASETS or Path(src.dataset).expanduser().exists():
        return
    if looks_like_path(src.dataset, tuple(LOCAL_FORMATS)):
        raise DataError(f"--dataset {src.dataset}: no such file or folder")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    where = src.dataset + (f" at revision {src.revision}" if src.revision else "")
    try:
        with quiet_hub_logs():
            HfApi().dataset_info(src.dataset, revision=src.revision)
    except RevisionNotFoundError:
        raise DataError(f"--dataset_revision {src.revision}: {src.dataset} has no such revision") from None
    except RepositoryNotFoundError:
        raise DataError(
            f"--dataset {where}: no such dataset on the Hugging Face Hub (or it is private or gated: log "
            "in with HF_TOKEN); the built-ins are " + ", ".join(BUILTIN_DATASETS)
        ) from None
    except Exception as exc:  # noqa: BLE001 - the network: one line
        raise DataError(
            f"--dataset {where}: cannot load it from the Hugging Face Hub ({first_line(exc)}). Check the id "
            f"and the network, or use a local file or a built-in ({', '.join(BUILTIN_DATASETS)})"
        ) from None


def load_rows(spec: str, revision: str | None = None, split: str = DEFAULT_SPLIT) -> Table:
    """A dataset's split, as --dataset (and --dataset_split) name it: open_source without the other flags."""
    return open_source(DataSource(spec, split=split, revision=revision))


def open_source(src: DataSource, pin: dict[str, Any] | None = None) -> Table:
    """The split the flags name, as a Table. `pin`: the chain's record of the source (data/pin.py); a Hub dataset
    recorded with its parquet index at this revision is opened from it, without reading any footer or card."""
    import datasets

    datasets.disable_progress_bars()
    if src.revision and (src.dataset in BUILTIN_DATASETS or Path(src.dataset).expanduser().exists()):
        raise DataError(
            f"--dataset_revision {src.revision}: only for a Hub dataset id (--dataset {src.dataset} is not one)"
        )
    if is_mixture_file(src.dataset):
        return _mixture(src, pin)
    if src.dataset in BUILTIN_DATASETS:
        if src.config or src.files:
            raise DataError(f"--dataset_{'config' if src.config else 'files'}: not for the built-in {src.dataset}")
        return builtin_split(src.dataset, src.split)
    path = Path(src.dataset).expanduser()
    if path.is_file():
        return _local_file(src, path)
    if path.is_dir():
        return _local_folder(src, path)
    if looks_like_path(src.dataset, tuple(LOCAL_FORMATS)):
        raise DataError(f"--dataset {src.dataset}: no such file or folder")
    return _hub(src, pin)


def mixture_definition(src: DataSource) -> dict[str, Any] | None:
    """A mixture file's definition as the chain's data pin records it, less each source's own identity: its weights
    and each source's names (what data/pin.py mixture_changed compares), read from the file alone. None: not a
    mixture."""
    if not is_mixture_file(src.dataset):
        return None
    mix = _mixture_file(src)
    return {"kind": "mixture", "weights": list(mix.weights), "sources": [ms.record() for ms in mix.sources]}


def _mixture_file(src: DataSource) -> Mixture:
    """The mixture file --dataset names; the flags that name one dataset's config, split or files belong in it."""
    for flag, value in (
        ("--dataset_config", src.config),
        ("--dataset_files", src.files),
        ("--dataset_split", None if src.split == DEFAULT_SPLIT else src.split),
    ):
        if value:
            raise DataError(
                f"{flag} {value}: not beside a mixture file (--dataset {src.dataset}): each source names "
                "its own (name, data_files, split) in the file"
            )
    return read_mixture(src.dataset)


@contextmanager
def _in_mixture(src: DataSource, n: int, source: DataSource) -> Iterator[None]:
    """A source's error, said of the mixture file and the source's place in it."""
    try:
        yield
    except DataError as exc:
        line = str(exc)
        if line.startswith(f"--dataset {source.dataset}: "):
            line = line[len(f"--dataset {source.dataset}: ") :]
        raise DataError(f"--dataset {src.dataset}: source {n} ({source.dataset}): {line}") from None


def _mixture(src: DataSource, pin: dict[str, Any] | None) -> MixtureTable:
    """Each source opened as it would be alone (a Hub source at the revision and from the index the chain recorded
    for it), then mixed by weight. Its identity: the integer weights, and each source's names and own identity."""
    mix = _mixture_file(src)
    recorded = (pin or {}).get("source") or {}
    before = recorded.get("sources", []) if recorded.get("kind") == "mixture" else []
    tables, sources, held = [], [], []
    for n, ms in enumerate(mix.sources, 1):
        sub = {"source": before[n - 1]["identity"]} if n <= len(before) else None
        source = DataSource(
            ms.source.dataset, ms.source.config, ms.source.split, ms.source.files, pinned_revision(sub, ms.source)
        )
        with _in_mixture(src, n, ms.source):
            table = open_source(source, sub)
            if ms.columns:
                missing = [c for c in ms.columns if c not in table.column_names]
                if missing:
                    raise DataError(f"it has no column {missing[0]} (its columns: {', '.join(table.column_names)})")
        tables.append(table)
        sources.append({**ms.record(), "identity": table.identity})
        held.append(source.with_split(ms.eval_split) if ms.eval_split else None)
    identity = {"kind": "mixture", "weights": list(mix.weights), "sources": sources}
    return MixtureTable(
        tables,
        mix.weights,
        identity,
        [ms.columns for ms in mix.sources],
        [ms.source.describe() for ms in mix.sources],
        [ms.data_format for ms in mix.sources],
        held,
    )


def held_out_mixture(src: DataSource, table: MixtureTable, end: int) -> MixtureTable:
    """The rows a mixture holds out after rows [0, end) when a source names an `eval_split`: the same weights over
    each source's eval split, or, for a source that names none, its rows after the ones rows [0, end) took. Its first
    --eval_rows rows are the held-out ones."""
    tables = []
    for n, (held, table_j, (_, taken)) in enumerate(
        zip(table.held, table.tables, source_ranges(0, end, table.weights)), 1
    ):
        if held is None:
            tables.append(After(table_j, taken))
            continue
        with _in_mixture(src, n, held):
            try:
                tables.append(open_source(held))
            except DataError as exc:
                raise DataError(f"eval_split {held.split}: {str(exc).split(': ', 1)[-1]}") from None
    return MixtureTable(tables, table.weights, None, table.kept, table.names, table.formats)


def _local_file(src: DataSource, path: Path) -> Table:
    if src.config or src.files:
        raise DataError(f"--dataset_{'config' if src.config else 'files'}: not for a single file ({src.dataset})")
    if src.split != DEFAULT_SPLIT:
        raise DataError(f"--dataset_split {src.split}: a single file ({src.dataset}) holds one split, train")
    fmt = LOCAL_FORMATS.get(path.suffix.lower())
    if fmt is None:
        known = ", ".join(sorted(LOCAL_FORMATS))
        raise DataError(f"--dataset {src.dataset}: unsupported file type {path.suffix!r} (use one of {known})")
    if fmt == "parquet":
        resolved = Resolved([str(path)], [path.name], None, None, "parquet")
        return _parquet(src, resolved, None, {"kind": "file", "path": src.dataset})
    return MemoryTable(
        _load(src, lambda d: d.load_dataset(fmt, data_files=str(path), split="train")), _hashed(src, "file", [path])
    )


def _local_folder(src: DataSource, path: Path) -> Table:
    if (path / "dataset_info.json").is_file() and (path / "state.json").is_file():
        if src.config or src.files or src.split != DEFAULT_SPLIT:
            raise DataError(
                f"--dataset {src.dataset}: a folder saved by save_to_disk holds one split; no "
                "--dataset_config, --dataset_split or --dataset_files"
            )
        return MemoryTable(_load(src, lambda d: d.load_from_disk(str(path))), _hashed(src, "folder", _files(path)))
    resolved = split_files(src)
    if resolved.module == "parquet":
        return _parquet(src, resolved, None, {"kind": "folder", "path": src.dataset})
    ds = _load(src, lambda d: d.load_dataset(str(path), name=src.config, split=src.split, data_files=_data_files(src)))
    return MemoryTable(ds, _hashed(src, "folder", [Path(u) for u in resolved.urls]))


NAMES = ("config", "split", "files")


def recorded_index(src: DataSource, pin: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chain's record of this Hub split with its parquet index, when it is this split at this revision."""
    recorded = (pin or {}).get("source") or {}
    if recorded.get("kind") != "hub" or not recorded.get("index") or recorded.get("revision") != src.revision:
        return None
    same = recorded.get("id") == src.dataset and all(recorded.get(k) == src.names().get(k) for k in NAMES)
    return recorded if same else None


def _hub(src: DataSource, pin: dict[str, Any] | None) -> Table:
    recorded = recorded_index(src, pin)
    if recorded is not None:
        return ParquetTable(
            SplitIndex.from_dict(recorded["index"]), ParquetReader(_hub_fs()), dict(recorded), src.describe()
        )
    resolved = split_files(src, src.revision)
    identity = {"kind": "hub", "id": src.dataset, **src.names()}
    if resolved.module == "parquet":  # its own files, or (a loading script's) the Hub's export
        return _parquet(src, resolved, src.dataset, identity | ({"export": True} if resolved.export else {}))
    exported = export_files(src)
    if exported is not None:
        print0(
            f"data: {src.describe()} is stored as {resolved.module}: reading its split {src.split} from the Hub's "
            "parquet export"
        )
        return _parquet(src, exported, src.dataset, identity | {"export": True})
    sizes, _ = listing(src.dataset, resolved.revision, resolved.names)
    print0(download_line(src, len(resolved.urls), resolved.module, sum(sizes)))
    ds = _load(
        src,
        lambda d: d.load_dataset(
            src.dataset, name=src.config, split=src.split, revision=resolved.revision, data_files=_data_files(src)
        ),
    )
    return MemoryTable(ds, identity | {"revision": resolved.revision})


def _parquet(src: DataSource, resolved: Resolved, hub_id: str | None, identity: dict[str, Any]) -> ParquetTable:
    reader = ParquetReader(_hub_fs() if hub_id else None)
    index = index_split(resolved, reader, hub_id)
    if hub_id:
        identity = identity | {"revision": resolved.revision, "index": index.to_dict()}
    else:  # a local file is known by its size and footer (row groups, offsets, statistics), not hashed whole
        identity = identity | {"bytes": index.bytes, "footers": _digest([f.key for f in index.files]), **src.names()}
    return ParquetTable(index, reader, identity, src.describe())


def _hub_fs():  # noqa: ANN202
    from huggingface_hub import HfFileSystem

    return HfFileSystem()


def _data_files(src: DataSource) -> dict[str, str] | None:
    return {src.split: src.files} if src.files else None


def _load(src: DataSource, load):  # noqa: ANN001, ANN202
    import datasets

    try:
        with quiet_hub_logs():
            return load(datasets)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged file is a user error: one line, no traceback
        raise DataError(f"--dataset {src.dataset}: cannot read it ({first_line(exc)})") from None


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def _digest(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _hashed(src: DataSource, kind: str, files: list[Path]) -> dict[str, Any]:
    """A local source read whole, known by its files' bytes."""
    if kind == "file":
        f = files[0]
        return {"kind": "file", "path": src.dataset, "bytes": f.stat().st_size, "sha256": file_sha256(f), **src.names()}
    root = Path(src.dataset).expanduser().resolve()  # the files may be named relative to it, or absolute
    digest = _digest([f"{Path(os.path.relpath(f.resolve(), root)).as_posix()}:{file_sha256(f)}" for f in files])
    return {
        "kind": "folder",
        "path": src.dataset,
        "bytes": sum(f.stat().st_size for f in files),
        "sha256": digest,
        **src.names(),
    }


def data_on_disk(src: DataSource) -> int:
    """What a session keeps of the split on disk: 0 when it reads rows by range (parquet, or the Hub's parquet export);
    a split read whole: its files and datasets' arrow copy of them, about twice their size."""
    if src.dataset in BUILTIN_DATASETS:
        return 0
    path = Path(src.dataset).expanduser()
    if path.is_file():
        return 0 if path.suffix.lower() == ".parquet" else 2 * path.stat().st_size
    resolved = split_files(src, src.revision)
    if resolved.module == "parquet" or (not path.exists() and export_files(src) is not None):
        return 0
    if path.is_dir():
        return 2 * sum(Path(u).stat().st_size for u in resolved.urls)
    return 2 * sum(listing(src.dataset, resolved.revision, resolved.names)[0])
