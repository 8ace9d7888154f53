"""Where rows come from: the built-in `python-docs` (text) and `python-docs-chat` (conversations), a local file or
folder, or a Hub dataset. data/formats.py reads the rows of a slice."""

from __future__ import annotations

import re
from pathlib import Path

from fsdp_opt.base import DataError, first_line, looks_like_path, quiet_hub_logs

BUILTIN_DATASET = "python-docs"
BUILTIN_CHAT_DATASET = "python-docs-chat"
BUILTIN_DATASETS = (BUILTIN_DATASET, BUILTIN_CHAT_DATASET)

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def _python_docs_paragraphs(min_chars: int) -> list[tuple[str, str]]:
    """(the topic's title, a paragraph) of Python's own documentation topics (pydoc_data), in a fixed order."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        title = topics[key].strip().splitlines()[0].strip()
        for para in re.split(r"\n\s*\n", topics[key]):
            text = " ".join(para.split())
            if len(text) >= min_chars:
                out.append((title, text))
    return out


def python_docs_texts(min_chars: int = 200) -> list[str]:
    """Paragraphs of Python's own documentation topics (pydoc_data): text with no download."""
    return [text for _, text in _python_docs_paragraphs(min_chars)]


CHAT_SYSTEM = "You answer questions about the Python documentation."
CHAT_OPENING_WORDS = 8


def python_docs_chat_rows(min_chars: int = 200) -> list[list[dict[str, str]]]:
    """Conversations made from the same paragraphs, offline. The user quotes a paragraph's opening words and asks
    where they come from (the answer: the topic's title). Every other conversation has a system message and a second
    turn, which asks how the paragraph goes on (the answer: its next sentence, at most 40 words)."""
    rows = []
    for k, (title, text) in enumerate(_python_docs_paragraphs(min_chars)):
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


def load_rows(spec: str, revision: str | None = None):
    """The raw dataset as a `datasets.Dataset` (train split); a Hub dataset at `revision` (None: main)."""
    import datasets

    datasets.disable_progress_bars()
    if revision and (spec in BUILTIN_DATASETS or Path(spec).expanduser().exists()):
        raise DataError(f"--dataset_revision {revision}: only for a Hub dataset id (--dataset {spec} is not one)")
    if spec == BUILTIN_DATASET:
        return datasets.Dataset.from_dict({"text": python_docs_texts()})
    if spec == BUILTIN_CHAT_DATASET:
        return datasets.Dataset.from_dict({"messages": python_docs_chat_rows()})
    path = Path(spec).expanduser()
    try:
        if path.is_file():
            fmt = LOCAL_FORMATS.get(path.suffix.lower())
            if fmt is None:
                known = ", ".join(sorted(LOCAL_FORMATS))
                raise DataError(f"--dataset {spec}: unsupported file type {path.suffix!r} (use one of {known})")
            return datasets.load_dataset(fmt, data_files=str(path), split="train")
        if path.is_dir():
            if (path / "dataset_info.json").is_file() and (path / "state.json").is_file():
                return datasets.load_from_disk(str(path))
            return datasets.load_dataset(str(path), split="train")
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged file is a user error: one line, no traceback
        raise DataError(f"--dataset {spec}: cannot read it ({first_line(exc)})") from None
    if looks_like_path(spec, tuple(LOCAL_FORMATS)):
        raise DataError(f"--dataset {spec}: no such file or folder")
    try:
        with quiet_hub_logs():
            return datasets.load_dataset(spec, split="train", revision=revision)
    except Exception as exc:  # noqa: BLE001
        if revision:
            raise DataError(f"--dataset {spec}: cannot load revision {revision} from the Hugging Face Hub "
                            f"({first_line(exc)}); --dataset_revision names another") from None  # fmt: skip
        raise DataError(
            f"--dataset {spec}: cannot load it from the Hugging Face Hub ({first_line(exc)}). "
            f"Check the id and the network, or use --dataset {BUILTIN_DATASET} ({BUILTIN_CHAT_DATASET}) or a local file."
        ) from None
