"""Rows of text from a source: the built-in `python-docs`, a local file or folder, or a Hub dataset; the
[start_idx, end_idx) slice of them, and the held-out rows after it."""

from __future__ import annotations

import re
from pathlib import Path

from fsdp_opt.base import DataError, first_line, looks_like_path, quiet_hub_logs

BUILTIN_DATASET = "python-docs"

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def python_docs_texts(min_chars: int = 200) -> list[str]:
    """Paragraphs of Python's own documentation topics (pydoc_data): text with no download."""
    from pydoc_data.topics import topics

    rows = []
    for key in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[key]):
            text = " ".join(para.split())
            if len(text) >= min_chars:
                rows.append(text)
    return rows


def load_rows(spec: str):
    """The raw dataset as a `datasets.Dataset` (train split)."""
    import datasets

    datasets.disable_progress_bars()
    if spec == BUILTIN_DATASET:
        return datasets.Dataset.from_dict({"text": python_docs_texts()})
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
            return datasets.load_dataset(spec, split="train")
    except Exception as exc:  # noqa: BLE001
        raise DataError(
            f"--dataset {spec}: cannot load it from the Hugging Face Hub ({first_line(exc)}). "
            f"Check the id and the network, or use --dataset {BUILTIN_DATASET} or a local file."
        ) from None


def select_texts(ds, text_column: str, start_idx: int, end_idx: int | None) -> tuple[list[str], int]:
    """Rows [start_idx, end_idx) of the raw data, empty ones dropped. Returns (texts, resolved end_idx)."""
    if text_column not in ds.column_names:
        raise DataError(f"--text_column {text_column}: no such column (the dataset has: {', '.join(ds.column_names)})")
    total = len(ds)
    if total == 0:
        raise DataError("--dataset: the dataset has no rows")
    end = total if end_idx is None else end_idx
    if start_idx >= total:
        raise DataError(f"--start_idx {start_idx}: past the end of the dataset ({total} rows)")
    if end > total:
        raise DataError(f"--end_idx {end}: past the end of the dataset ({total} rows)")
    column = ds.select(range(start_idx, end))[text_column]
    texts = [t for t in column if isinstance(t, str) and t.strip()]
    if not texts:
        raise DataError(f"--start_idx {start_idx} --end_idx {end}: every row of this slice is empty")
    return texts, end


def held_out_texts(ds, text_column: str, end_idx: int, rows: int) -> tuple[list[str], int]:
    """--eval_rows: the rows right after the slice, [end_idx, end_idx + rows), cut at the end of the dataset.
    Returns the texts and where they end."""
    total = len(ds)
    if end_idx >= total:
        raise DataError(f"--eval_rows {rows}: no rows after --end_idx {end_idx} to evaluate on (the dataset has {total})")
    return select_texts(ds, text_column, end_idx, min(total, end_idx + rows))
