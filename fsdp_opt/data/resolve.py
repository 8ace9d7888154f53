"""Which files a dataset's config and split are, found the way `datasets` finds them, without downloading data.

`datasets.load_dataset_builder` reads the dataset card (its `configs:` YAML) and the repo's or folder's listing, and
gives each split's data files in the order `load_dataset` reads them. When they are parquet, a session reads its rows
from them by row group (data/parquet.py). When they are not (JSON, CSV, a loading script), a Hub dataset's parquet
export (the `refs/convert/parquet` revision, `{config}/{split}/NNNN.parquet`) is read instead; without a complete
export the split is downloaded whole, and one line says why and how much.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_opt.base import DataError, first_line, quiet_hub_logs, size_text
from fsdp_opt.config.choices import BUILTIN_DATASETS
from fsdp_opt.config.training import DataConfig
from fsdp_opt.data.parquet import ParquetReader, SplitIndex

EXPORT_REVISION = "refs/convert/parquet"
DEFAULT_SPLIT = "train"


@dataclass(frozen=True)
class DataSource:
    """What the flags name: --dataset, --dataset_config, --dataset_split, --dataset_files, --dataset_revision."""

    dataset: str
    config: str | None = None
    split: str = DEFAULT_SPLIT
    files: str | None = None
    revision: str | None = None

    @classmethod
    def of(cls, dc: DataConfig, revision: str | None = None) -> DataSource:
        """The source the data flags name, at `revision` (None: --dataset_revision, else main)."""
        return cls(dc.dataset, dc.dataset_config, dc.dataset_split, dc.dataset_files, revision or dc.dataset_revision)

    def with_split(self, split: str) -> DataSource:
        return DataSource(self.dataset, self.config, split, self.files, self.revision)

    def names(self) -> dict[str, str]:
        """The naming flags that differ from the defaults (what a pin records besides the dataset)."""
        out = {"config": self.config, "files": self.files} | (
            {"split": self.split} if self.split != DEFAULT_SPLIT else {}
        )
        return {k: v for k, v in out.items() if v}

    def describe(self) -> str:
        parts = [self.dataset] + [f"{k} {v}" for k, v in self.names().items()]
        return parts[0] + (f" ({', '.join(parts[1:])})" if len(parts) > 1 else "")


@dataclass
class Resolved:
    """A split's files as `datasets` orders them, and where they come from."""

    urls: list[str]  # hf://datasets/{id}@{commit}/{path}, or local paths
    names: list[str]  # paths in the repo or the folder
    revision: str | None  # the Hub commit they were read at
    features: dict[str, Any] | None  # what the card declares, as datasets' Features dict
    module: str  # datasets' builder for them: parquet, json, csv, text, ...
    export: bool = False  # read from the Hub's parquet export


def _configs_in(message: str) -> list[str]:
    m = re.search(r"(\[[^\]]*\])", message)
    try:
        return [str(c) for c in ast.literal_eval(m.group(1))] if m else []
    except (ValueError, SyntaxError):
        return []


def builder(src: DataSource, revision: str | None = None, data_files: Any = None):  # noqa: ANN201
    """datasets' builder for the source (no data is downloaded), its errors as one line naming the flag."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    where = src.dataset + (f" at revision {revision}" if revision else "")
    try:
        with quiet_hub_logs():
            return datasets.load_dataset_builder(src.dataset, name=src.config, revision=revision, data_files=data_files)
    except DatasetNotFoundError:
        raise DataError(
            f"--dataset {where}: no such dataset on the Hugging Face Hub (or it is private or gated: log in "
            "with HF_TOKEN)"
        ) from None
    except ValueError as exc:
        text = str(exc)
        if "Config name is missing" in text:
            configs = _configs_in(text)
            raise DataError(
                f"--dataset {src.dataset}: it has {len(configs)} configs and no default; name one with "
                f"--dataset_config ({', '.join(configs)})"
            ) from None
        if "BuilderConfig" in text and "not found" in text:
            raise DataError(
                f"--dataset_config {src.config}: {src.dataset} has no such config (its configs: "
                f"{', '.join(_configs_in(text))})"
            ) from None
        if "trust_remote_code" in text or "loading script" in text:
            raise ScriptDataset(text) from None
        raise DataError(f"--dataset {where}: cannot read it ({first_line(exc)})") from None
    except RuntimeError as exc:
        if "scripts are no longer supported" in str(exc):
            raise ScriptDataset(str(exc)) from None
        raise DataError(f"--dataset {where}: cannot read it ({first_line(exc)})") from None
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - the network, a damaged card: one line
        raise DataError(
            f"--dataset {where}: cannot load it from the Hugging Face Hub ({first_line(exc)}). Check the id "
            f"and the network, or use a local file or a built-in ({', '.join(BUILTIN_DATASETS)})"
        ) from None


class ScriptDataset(Exception):
    """The dataset is a loading script, which `datasets` no longer runs."""


def split_files(src: DataSource, revision: str | None = None) -> Resolved:
    """The split's files in `datasets`' order (a loading-script dataset: its parquet export)."""
    data_files = {src.split: src.files} if src.files else None
    try:
        b = builder(src, revision, data_files)
    except ScriptDataset:
        exported = export_files(src)
        if exported is None:
            raise DataError(
                f"--dataset {src.dataset}: it is a loading script, which `datasets` no longer runs, and the "
                "Hub has no parquet export of it to read instead"
            ) from None
        return exported
    files = b.config.data_files or {}
    if src.split not in files:
        named = _named_by_split(src)
        if named:  # a folder of split-named files that datasets' patterns do not take as that split
            return Resolved([str(p) for p in named], [p.name for p in named], None, None, _module_of(named))
        what = src.dataset + (f" (config {b.config.name})" if src.config else "")
        raise DataError(
            f"--dataset_split {src.split}: {what} has no such split (its splits: "
            f"{', '.join(sorted(map(str, files))) or 'none'})"
        )
    urls = [str(u) for u in files[src.split]]
    names = [_name_in_repo(u) for u in urls]
    features = b.info.features.to_dict() if b.info.features is not None else None
    return Resolved(urls, names, _commit_of(urls[0]) if urls else None, features, _module_of(names))


def _module_of(names: list) -> str:
    """parquet when every file is; else what the first file's suffix says (json, csv, ...)."""
    suffixes = [Path(str(n)).suffix.lower() for n in names]
    if suffixes and all(s == ".parquet" for s in suffixes):
        return "parquet"
    first = suffixes[0].lstrip(".") if suffixes else ""
    return {"jsonl": "json", "txt": "text"}.get(first, first) or "unknown"


def _named_by_split(src: DataSource) -> list[Path]:
    """A local folder's files named after the split (train_sft-00000-of-00002.parquet), at its top or under data/,
    in name order: what `datasets` would read for the pattern `{split}-*`."""
    root = Path(src.dataset).expanduser()
    if not root.is_dir():
        return []
    found = [
        p
        for folder in (root, root / "data")
        if folder.is_dir()
        for p in folder.iterdir()
        if p.is_file() and (p.name.startswith(src.split + "-") or p.stem == src.split)
    ]
    return sorted(found)


def _commit_of(url: str) -> str | None:
    m = re.match(r"hf://datasets/[^@]+@([^/]+)/", url)
    return m.group(1) if m else None


def _name_in_repo(url: str) -> str:
    m = re.match(r"hf://datasets/[^@]+@[^/]+/(.*)", url)
    return m.group(1) if m else url


def export_files(src: DataSource) -> Resolved | None:
    """The split in the Hub's parquet export (None: no export of it, or only a partial one)."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    api = HfApi()
    config = src.config or "default"
    try:
        with quiet_hub_logs():
            commit = api.dataset_info(src.dataset, revision=EXPORT_REVISION).sha
            listing = api.list_repo_tree(
                src.dataset, path_in_repo=config, revision=commit, repo_type="dataset", recursive=True
            )
            names = sorted(
                e.path for e in listing if e.path.endswith(".parquet") and getattr(e, "size", None) is not None
            )
    except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
        return None
    except Exception as exc:  # noqa: BLE001
        raise DataError(
            f"--dataset {src.dataset}: cannot read its parquet export from the Hub ({first_line(exc)})"
        ) from None
    whole = [n for n in names if n.startswith(f"{config}/{src.split}/")]
    if not whole:
        return None  # none, or `partial-{split}`: the export of a large dataset stops part way
    urls = [f"hf://datasets/{src.dataset}@{commit}/{n}" for n in whole]
    return Resolved(urls, whole, commit, None, "parquet", export=True)


def listing(dataset: str, commit: str, names: list[str]) -> tuple[list[int], list[str | None]]:
    """Sizes and content keys (LFS sha256, else git oid) of Hub files, from the Hub's listing: nothing is hashed here."""
    from huggingface_hub import HfApi

    with quiet_hub_logs():
        infos = {i.path: i for i in HfApi().get_paths_info(dataset, names, revision=commit, repo_type="dataset")}
    sizes, keys = [], []
    for n in names:
        info = infos.get(n)
        lfs = getattr(info, "lfs", None)
        sizes.append(int(getattr(info, "size", 0) or 0))
        keys.append((lfs.sha256 if lfs is not None else getattr(info, "blob_id", None)) if info is not None else None)
    return sizes, keys


def index_split(resolved: Resolved, reader: ParquetReader, hub_id: str | None) -> SplitIndex:
    """The split's index: every file's row groups from its footer."""
    if hub_id is not None:
        sizes, keys = listing(hub_id, resolved.revision, resolved.names)
    else:
        sizes, keys = [Path(u).stat().st_size for u in resolved.urls], [None] * len(resolved.urls)
    files = reader.index_files(resolved.names, resolved.urls, sizes, keys)
    columns = tuple(reader.schema(resolved.urls[0]).names) if resolved.urls else ()
    if resolved.features:
        columns = tuple(resolved.features)
    return SplitIndex(tuple(files), columns, resolved.features)


def download_line(src: DataSource, n_files: int, module: str, nbytes: int) -> str:
    """Why a split is downloaded whole, and how much that is."""
    return (
        f"data: {src.describe()} is stored as {module}, with no complete parquet export on the Hub to read ranges "
        f"from: its split {src.split} is downloaded whole ({n_files} file(s), {size_text(nbytes)})"
    )
