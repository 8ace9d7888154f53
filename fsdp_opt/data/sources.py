"""Where rows come from: the built-in `python-docs` (text) and `python-docs-chat` (conversations), a local file or
folder, or a Hub dataset, each opened as a Table (data/table.py) of one split; or a weighted mixture of them
(data/mixture.py), whose range reads a range of each. data/formats.py reads a slice's rows.

A Hub dataset or local folder stored as parquet is read by row group: a session fetches the rows of its range (and
its held-out rows), not the dataset. Anything else is read whole, as `datasets.load_dataset` reads it."""

from __future__ import annotations

import hashlib
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from fsdp_opt.base import DataError, first_line, looks_like_path, quiet_hub_logs
from fsdp_opt.config.choices import BUILTIN_DATASETS
from fsdp_opt.data.mixture import Mixture, MixtureTable, is_mixture_file, read_mixture
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
from fsdp_opt.data.table import MemoryTable, ParquetTable, RowsTable, Table
from fsdp_opt.runtime.distributed import print0

BUILTIN_DATASET, BUILTIN_CHAT_DATASET, BUILTIN_PREFERENCE_DATASET, BUILTIN_PROMPT_DATASET = BUILTIN_DATASETS

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


# The built-ins' splits: train, paragraphs of at least 200 characters; test, the shorter ones of 120 to 199
# characters, which no training row holds (held-out rows for --eval_split test).
BUILTIN_SPLITS = {"train": (200, None), "test": (120, 200)}


def _python_docs_paragraphs(min_chars: int, max_chars: int | None = None) -> list[tuple[str, str]]:
    """(the topic's title, a paragraph) of Python's own documentation topics (pydoc_data), in a fixed order."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        title = topics[key].strip().splitlines()[0].strip()
        for para in re.split(r"\n\s*\n", topics[key]):
            text = " ".join(para.split())
            if len(text) >= min_chars and (max_chars is None or len(text) < max_chars):
                out.append((title, text))
    return out


def python_docs_texts(min_chars: int = 200, max_chars: int | None = None) -> list[str]:
    """Paragraphs of Python's own documentation topics (pydoc_data): text with no download."""
    return [text for _, text in _python_docs_paragraphs(min_chars, max_chars)]


CHAT_SYSTEM = "You answer questions about the Python documentation."
CHAT_OPENING_WORDS = 8


def python_docs_chat_rows(min_chars: int = 200, max_chars: int | None = None) -> list[list[dict[str, str]]]:
    """Conversations made from the same paragraphs, offline. The user quotes a paragraph's opening words and asks
    where they come from (the answer: the topic's title). Every other conversation has a system message and a second
    turn, which asks how the paragraph goes on (the answer: its next sentence, at most 40 words)."""
    rows = []
    for k, (title, text) in enumerate(_python_docs_paragraphs(min_chars, max_chars)):
        words = text.split(" ")
        opening, rest = " ".join(words[:CHAT_OPENING_WORDS]), " ".join(words[CHAT_OPENING_WORDS:])
        sentence = re.match(r"(.+?[.:;?!])(\s|$)", rest)
        sentence = " ".join((sentence.group(1) if sentence else rest).split(" ")[:40])
        ask = {"role": "user", "content": f'Which part of the Python documentation begins a paragraph with "{opening}"?'}
        if k % 2:
            rows.append([ask, {"role": "assistant", "content": title}])
            continue
        rows.append([
            {"role": "system", "content": CHAT_SYSTEM}, ask, {"role": "assistant", "content": title},
            {"role": "user", "content": "How does that paragraph go on?"}, {"role": "assistant", "content": sentence},
        ])  # fmt: skip
    return rows


def python_docs_preference_rows(min_chars: int = 200, max_chars: int | None = None) -> list[dict[str, list]]:
    """Preference pairs made from python-docs-chat's first question: the prompt is the question (with the system
    message where the conversation has one), the chosen answer the right title, the rejected one a wrong title: that
    of a documentation topic with no paragraph long enough to be a training row (paragraphs of 200 characters or
    more), so the preference is one a small model can learn in a minute (which titles are never the answer) and hold
    on the held-out rows. A held-out row whose right title is itself one of those is left out: its pair would set one
    never-answer title against another, a preference nothing in training teaches."""
    trained = {t for t, _ in _python_docs_paragraphs(BUILTIN_SPLITS["train"][0])}
    titles = sorted({t for t, _ in _python_docs_paragraphs(1)})
    wrong = [t for t in titles if t not in trained]
    rows = []
    for k, conversation in enumerate(python_docs_chat_rows(min_chars, max_chars)):
        first = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
        title = conversation[first]["content"]
        if title in wrong:
            continue
        rejected = next(w for j in range(len(wrong)) if (w := wrong[(k + j) % len(wrong)]) != title)
        rows.append({"prompt": conversation[:first], "chosen": [{"role": "assistant", "content": title}],
                     "rejected": [{"role": "assistant", "content": rejected}]})  # fmt: skip
    return rows


ONE_WORD = "Answer in one word."


def python_docs_prompt_rows(min_chars: int = 200, max_chars: int | None = None) -> list[dict[str, Any]]:
    """Prompt rows (--method grpo) made from python-docs-chat's first question, asked to be answered in one word:
    {"prompt": [the user's message], "solution": the topic's title, "choices": the documentation's one-word titles,
    "max_words": 1}. The built-in `length` reward checks the form (an answer that ends, in one word), `choice` that
    it is one of the one-word titles; the title is there for a reward of your own."""
    titles = sorted({t for t, _ in _python_docs_paragraphs(1) if len(t.split()) == 1})
    rows = []
    for conversation in python_docs_chat_rows(min_chars, max_chars):
        ask = next(m for m in conversation if m["role"] == "user")
        title = next(m for m in conversation if m["role"] == "assistant")["content"]
        rows.append({"prompt": [{"role": "user", "content": f"{ask['content']} {ONE_WORD}"}], "solution": title,
                     "choices": titles, "max_words": 1})  # fmt: skip
    return rows


def builtin_split(name: str, split: str) -> RowsTable:
    """A built-in dataset's split (python-docs: text; python-docs-chat: conversations; python-docs-prefs: preference
    pairs; python-docs-prompts: prompts), built here from Python's own documentation."""
    if split not in BUILTIN_SPLITS:
        raise DataError(f"--dataset_split {split}: {name} has no such split (its splits: {', '.join(BUILTIN_SPLITS)})")
    low, high = BUILTIN_SPLITS[split]
    if name == BUILTIN_DATASET:
        rows = [{"text": t} for t in python_docs_texts(low, high)]
    elif name == BUILTIN_PREFERENCE_DATASET:
        rows = python_docs_preference_rows(low, high)
    elif name == BUILTIN_PROMPT_DATASET:
        rows = python_docs_prompt_rows(low, high)
    else:
        rows = [{"messages": m} for m in python_docs_chat_rows(low, high)]
    return RowsTable(rows, {"kind": "builtin", "name": name, **({"split": split} if split != DEFAULT_SPLIT else {})})


def check_exists(src: DataSource, eval_split: str | None = None) -> None:
    """That the dataset the flags name is there: a built-in, a local file or folder, or a Hub dataset (one metadata
    request, no card or file read). Run before anything is taken or built: the chain's lease, the model. A mixture
    file: each of its sources."""
    if is_mixture_file(src.dataset):
        mix = _mixture_file(src)
        if eval_split:
            raise DataError(f"--eval_split {eval_split}: not with a mixture file (--dataset {src.dataset}): its "
                            "held-out rows are the mixture's rows right after the slice (--eval_rows alone)")  # fmt: skip
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
        raise DataError(f"--dataset {where}: no such dataset on the Hugging Face Hub (or it is private or gated: log "
                        "in with HF_TOKEN); the built-ins are " + ", ".join(BUILTIN_DATASETS)) from None  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the network: one line
        raise DataError(f"--dataset {where}: cannot load it from the Hugging Face Hub ({first_line(exc)}). Check the id "
                        f"and the network, or use a local file or a built-in ({', '.join(BUILTIN_DATASETS)})") from None  # fmt: skip


def load_rows(spec: str, revision: str | None = None, split: str = DEFAULT_SPLIT) -> Table:
    """A dataset's split, as --dataset (and --dataset_split) name it: open_source without the other flags."""
    return open_source(DataSource(spec, split=split, revision=revision))


def open_source(src: DataSource, pin: dict[str, Any] | None = None) -> Table:
    """The split the flags name, as a Table. `pin`: the chain's record of the source (data/pin.py); a Hub dataset
    recorded with its parquet index at this revision is opened from it, without reading any footer or card."""
    import datasets

    datasets.disable_progress_bars()
    if src.revision and (src.dataset in BUILTIN_DATASETS or Path(src.dataset).expanduser().exists()):
        raise DataError(f"--dataset_revision {src.revision}: only for a Hub dataset id (--dataset {src.dataset} is not one)")
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


def _mixture_file(src: DataSource) -> Mixture:
    """The mixture file --dataset names; the flags that name one dataset's config, split or files belong in it."""
    for flag, value in (("--dataset_config", src.config), ("--dataset_files", src.files),
                        ("--dataset_split", None if src.split == DEFAULT_SPLIT else src.split)):  # fmt: skip
        if value:
            raise DataError(f"{flag} {value}: not beside a mixture file (--dataset {src.dataset}): each source names "
                            "its own (name, data_files, split) in the file")  # fmt: skip
    return read_mixture(src.dataset)


@contextmanager
def _in_mixture(src: DataSource, n: int, source: DataSource) -> Iterator[None]:
    """A source's error, said of the mixture file and the source's place in it."""
    try:
        yield
    except DataError as exc:
        line = str(exc)
        if line.startswith(f"--dataset {source.dataset}: "):
            line = line[len(f"--dataset {source.dataset}: "):]
        raise DataError(f"--dataset {src.dataset}: source {n} ({source.dataset}): {line}") from None


def _mixture(src: DataSource, pin: dict[str, Any] | None) -> MixtureTable:
    """Each source opened as it would be alone (a Hub source at the revision and from the index the chain recorded
    for it), then mixed by weight. Its identity: the integer weights, and each source's names and own identity."""
    mix = _mixture_file(src)
    recorded = (pin or {}).get("source") or {}
    before = recorded.get("sources", []) if recorded.get("kind") == "mixture" else []
    tables, sources = [], []
    for n, ms in enumerate(mix.sources, 1):
        sub = {"source": before[n - 1]["identity"]} if n <= len(before) else None
        source = DataSource(ms.source.dataset, ms.source.config, ms.source.split, ms.source.files,
                            pinned_revision(sub, ms.source))  # fmt: skip
        with _in_mixture(src, n, ms.source):
            table = open_source(source, sub)
            if ms.columns:
                missing = [c for c in ms.columns if c not in table.column_names]
                if missing:
                    raise DataError(f"it has no column {missing[0]} (its columns: {', '.join(table.column_names)})")
        tables.append(table)
        sources.append({**ms.record(), "identity": table.identity})
    identity = {"kind": "mixture", "weights": list(mix.weights), "sources": sources}
    return MixtureTable(tables, mix.weights, identity, [ms.columns for ms in mix.sources],
                        [ms.source.describe() for ms in mix.sources])  # fmt: skip


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
    return MemoryTable(_load(src, lambda d: d.load_dataset(fmt, data_files=str(path), split="train")),
                       _hashed(src, "file", [path]))  # fmt: skip


def _local_folder(src: DataSource, path: Path) -> Table:
    if (path / "dataset_info.json").is_file() and (path / "state.json").is_file():
        if src.config or src.files or src.split != DEFAULT_SPLIT:
            raise DataError(f"--dataset {src.dataset}: a folder saved by save_to_disk holds one split; no "
                            "--dataset_config, --dataset_split or --dataset_files")  # fmt: skip
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
        return ParquetTable(SplitIndex.from_dict(recorded["index"]), ParquetReader(_hub_fs()), dict(recorded),
                            src.describe())  # fmt: skip
    resolved = split_files(src, src.revision)
    identity = {"kind": "hub", "id": src.dataset, **src.names()}
    if resolved.module == "parquet":  # its own files, or (a loading script's) the Hub's export
        return _parquet(src, resolved, src.dataset, identity | ({"export": True} if resolved.export else {}))
    exported = export_files(src)
    if exported is not None:
        print0(f"data: {src.describe()} is stored as {resolved.module}: reading its split {src.split} from the Hub's "
               "parquet export")  # fmt: skip
        return _parquet(src, exported, src.dataset, identity | {"export": True})
    sizes, _ = listing(src.dataset, resolved.revision, resolved.names)
    print0(download_line(src, len(resolved.urls), resolved.module, sum(sizes)))
    ds = _load(src, lambda d: d.load_dataset(src.dataset, name=src.config, split=src.split, revision=resolved.revision,
                                             data_files=_data_files(src)))  # fmt: skip
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
    root = Path(src.dataset).expanduser()
    digest = _digest([f"{f.relative_to(root).as_posix()}:{file_sha256(f)}" for f in files])
    return {"kind": "folder", "path": src.dataset, "bytes": sum(f.stat().st_size for f in files), "sha256": digest,
            **src.names()}  # fmt: skip


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
