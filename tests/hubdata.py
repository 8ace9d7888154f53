"""Dataset repos laid out as the Hub lays them, for the loopback Hub (tests/hubserver.py) and the data benchmark:
parquet shards named `data/{split}-0000k-of-0000n.parquet` with many row groups each, and a README whose `configs:`
YAML names each config's files per split.

The rows are made here, independently of the package: conversations whose words come from Python's documentation
topics, each row numbered, so any row can be told apart and made again (`chat_row(i)`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def _paragraphs() -> list[str]:
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[key]):
            text = " ".join(para.split())
            if 80 <= len(text) <= 600:
                out.append(text)
    return out


PARAGRAPHS = _paragraphs()


def chat_row(i: int, split: str = "train_sft") -> dict:
    """Row i of a split: a user turn and an assistant turn, both numbered."""
    a, b = PARAGRAPHS[(7 * i) % len(PARAGRAPHS)], PARAGRAPHS[(13 * i + 5) % len(PARAGRAPHS)]
    return {
        "prompt_id": f"{split}-{i}",
        "messages": [
            {"role": "user", "content": f"[{split} {i}] {a[: 40 + i % 120]}"},
            {"role": "assistant", "content": b[: 60 + (i * 7) % 200]},
        ],
    }


def text_row(i: int, split: str = "train") -> dict:
    return {"text": f"[{split} {i}] " + PARAGRAPHS[(11 * i) % len(PARAGRAPHS)]}


def write_split(
    root: Path, split: str, rows: int, shards: int, row_group: int, make=chat_row, folder: str = "data"
) -> list[Path]:
    """`rows` rows in `shards` parquet files of row groups of `row_group` rows, named as the Hub names them."""
    out, per = [], -(-rows // shards)
    (root / folder).mkdir(parents=True, exist_ok=True)
    for k in range(shards):
        part = [make(i, split) for i in range(k * per, min(rows, (k + 1) * per))]
        path = root / folder / f"{split}-{k:05d}-of-{shards:05d}.parquet"
        pq.write_table(pa.Table.from_pylist(part), path, row_group_size=row_group)
        out.append(path)
    return out


def card(configs: dict[str, dict[str, str]], default: str | None = None) -> str:
    """A dataset card whose `configs:` YAML names each config's data files per split."""
    lines = ["---", "configs:"]
    for name, splits in configs.items():
        lines.append(f"- config_name: {name}")
        if name == default:
            lines.append("  default: true")
        lines.append("  data_files:")
        for split, pattern in splits.items():
            lines += [f"  - split: {split}", f"    path: {pattern}"]
    return "\n".join(lines + ["---", "", "A dataset made for the tests.", ""])


def repo_files(root: Path) -> dict[str, Path | bytes]:
    """A folder as commit_dataset takes it: parquet files by path (copied as LFS objects), the rest as bytes."""
    return {
        p.relative_to(root).as_posix(): (p if p.suffix == ".parquet" else p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def make_chat_repo(root: Path, train_rows: int, test_rows: int, shards: int, row_group: int) -> Path:
    """An UltraChat-like repo: splits train_sft and test_sft, no train split, one default config."""
    write_split(root, "train_sft", train_rows, shards, row_group)
    write_split(root, "test_sft", test_rows, 1, row_group)
    (root / "README.md").write_text(card({"default": {"train_sft": "data/train_sft-*", "test_sft": "data/test_sft-*"}}))
    return root


def make_two_config_repo(root: Path, rows: int) -> Path:
    """A repo with configs `alpha` and `beta` and no default (as HuggingFaceTB/smoltalk or openai/gsm8k)."""
    write_split(root, "train", rows, 1, 50, make=text_row, folder="alpha")
    write_split(root, "train", rows, 1, 50, make=lambda i, s: text_row(i + 100_000, s), folder="beta")
    (root / "README.md").write_text(card({"alpha": {"train": "alpha/train-*"}, "beta": {"train": "beta/train-*"}}))
    return root


def jsonl_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()
