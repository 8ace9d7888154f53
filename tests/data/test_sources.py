"""Local sources opened as tables: parquet read by row group equals `datasets.load_dataset`'s rows; folders of
split-named files; the built-ins' held-out split; the index's arithmetic; the flags a source refuses."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hubdata import chat_row, text_row, write_split

from fsdp_opt.base import ConfigError, DataError
from fsdp_opt.config.training import DataConfig
from fsdp_opt.data.builtins import python_docs_texts
from fsdp_opt.data.parquet import ParquetFileIndex, SplitIndex
from fsdp_opt.data.resolve import DataSource
from fsdp_opt.data.sources import data_on_disk, open_source
from fsdp_opt.data.table import ParquetTable


def test_the_index_finds_the_row_groups_of_a_range():
    files = tuple(ParquetFileIndex(f"f{k}", f"/f{k}", 1, "k", (10, 10, 5)) for k in range(3))  # 25 rows each
    index = SplitIndex(files, ("text",))
    assert index.rows == 75 and index.starts == (0, 25, 50)
    assert index.pieces(0, 3) == [(0, [0], 0, 0)]
    assert index.pieces(12, 22) == [(0, [1, 2], 10, 2)]
    assert index.pieces(24, 27) == [(0, [2], 20, 4), (1, [0], 25, 0)]  # across a file boundary
    assert index.pieces(70, 75) == [(2, [2], 70, 0)]
    assert SplitIndex.from_dict(index.to_dict()) == index


def test_local_parquet_is_read_by_row_group_and_equals_load_dataset(tmp_path):
    import datasets

    files = write_split(tmp_path / "ds", "train", 3_000, 3, 100)
    table = open_source(DataSource(str(tmp_path / "ds")))
    assert isinstance(table, ParquetTable) and len(table) == 3_000
    assert table.identity["kind"] == "folder" and "footers" in table.identity and "sha256" not in table.identity
    theirs = datasets.load_dataset(str(tmp_path / "ds"), split="train")
    for a, b in ((0, 10), (995, 1005), (2_990, 3_000)):
        assert table.rows(a, b, ["messages"]) == list(theirs.select(range(a, b)).select_columns(["messages"]))
        assert table.rows(a, b, ["prompt_id"]) == [{"prompt_id": f"train-{i}"} for i in range(a, b)]
    one = open_source(DataSource(str(files[1])))
    assert len(one) == 1_000 and one.rows(0, 2, ["prompt_id"]) == [
        {"prompt_id": "train-1000"},
        {"prompt_id": "train-1001"},
    ]
    # The footer is the file's key: rewriting a row changes it, so the pin sees another source.
    rows = [chat_row(i, "train") for i in range(1_000, 2_000)]
    rows[5]["messages"][1]["content"] += " (edited)"
    pq.write_table(pa.Table.from_pylist(rows), files[1], row_group_size=100)
    assert open_source(DataSource(str(files[1]))).identity != one.identity


def test_folders_of_split_named_files_take_the_split_flag(tmp_path):
    # Under data/, as a Hub download lays them: datasets' own patterns find train_sft and test_sft.
    write_split(tmp_path / "hub", "train_sft", 40, 2, 10)
    write_split(tmp_path / "hub", "test_sft", 10, 1, 10)
    sft = open_source(DataSource(str(tmp_path / "hub"), split="train_sft"))
    assert len(sft) == 40 and sft.rows(39, 40, ["prompt_id"]) == [{"prompt_id": "train_sft-39"}]
    with pytest.raises(
        DataError, match=r"--dataset_split train: .* has no such split \(its splits: test_sft, train_sft\)"
    ):
        open_source(DataSource(str(tmp_path / "hub")))
    # At the folder's top, as a user copies them: the files named after the split.
    write_split(tmp_path / "top", "train_sft", 30, 2, 10, folder=".")
    write_split(tmp_path / "top", "test_sft", 10, 1, 10, folder=".")
    top = open_source(DataSource(str(tmp_path / "top"), split="train_sft"))
    assert len(top) == 30 and top.rows(0, 1, ["prompt_id"]) == [{"prompt_id": "train_sft-0"}]


def test_the_builtins_have_a_held_out_split_no_training_row_is_in():
    train, test = open_source(DataSource("python-docs")), open_source(DataSource("python-docs", split="test"))
    assert len(train) == len(python_docs_texts()) and len(test) > 400
    held = {r["text"] for r in test.rows(0, len(test), ["text"])}
    assert not held & set(python_docs_texts()) and all(120 <= len(t) < 200 for t in held)
    chat = open_source(DataSource("python-docs-chat", split="test"))
    assert len(chat) == len(test) and chat.column_names == ["messages"]
    with pytest.raises(
        DataError, match=r"--dataset_split valid: python-docs has no such split \(its splits: train, test\)"
    ):
        open_source(DataSource("python-docs", split="valid"))


def test_what_a_source_refuses_is_one_line_naming_the_flag(tmp_path):
    (tmp_path / "rows.jsonl").write_text("".join(f'{{"text": "{text_row(i)["text"][:40]}"}}\n' for i in range(5)))
    for src, needle in [
        (DataSource(str(tmp_path / "rows.jsonl"), split="test"), "--dataset_split test: a single file"),
        (DataSource(str(tmp_path / "rows.jsonl"), config="x"), "--dataset_config: not for a single file"),
        (DataSource("python-docs", config="x"), "--dataset_config: not for the built-in python-docs"),
        (DataSource("python-docs", revision="abc"), "--dataset_revision abc: only for a Hub dataset id"),
    ]:
        with pytest.raises(DataError, match=needle):
            open_source(src)
    for flags, needle in [
        ({"eval_split": "test"}, "--eval_split test: needs --eval_rows N"),
        ({"eval_split": "train", "eval_rows": 4}, "--eval_split train: the split trained on"),
        (
            {"eval_split": "test", "eval_rows": 4, "dataset_files": "a/*.parquet"},
            "--eval_split test: not with --dataset_files",
        ),
        ({"dataset_split": " "}, "--dataset_split: must not be empty"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            DataConfig(**flags)


def test_what_a_session_keeps_on_disk(tmp_path):
    write_split(tmp_path / "pq", "train", 20, 1, 10)
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n' * 100)
    assert data_on_disk(DataSource(str(tmp_path / "pq"))) == 0  # read by range
    assert data_on_disk(DataSource("python-docs")) == 0
    assert data_on_disk(DataSource(str(tmp_path / "rows.jsonl"))) == 2 * (tmp_path / "rows.jsonl").stat().st_size
