"""Data: built-in rows, slicing, tokenization, packing and padding, and the rank-independent order."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ASSETS
from transformers import AutoTokenizer

from fsdp_opt.base import DataError
from fsdp_opt.data.blocks import IGNORE_INDEX, StepPlan, build_blocks, pack, pad_rows, tokenize
from fsdp_opt.data.builtins import python_docs_texts
from fsdp_opt.data.formats import select_texts
from fsdp_opt.data.sources import load_rows


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS)


def test_python_docs_rows_are_paragraphs_of_pydoc_topics():
    from pydoc_data.topics import topics

    rows = python_docs_texts()
    assert len(rows) > 500
    assert all(len(r) >= 200 for r in rows)
    corpus = " ".join(" ".join(t.split()) for t in topics.values())
    assert all(r in corpus for r in rows[:50])


def test_local_files_load_in_every_format(tmp_path):
    rows = [{"text": f"row {i} " * 5, "other": i} for i in range(7)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "d.csv").write_text("text,other\n" + "\n".join(f"{r['text']},{r['other']}" for r in rows))
    (tmp_path / "d.txt").write_text("\n".join(r["text"] for r in rows))
    import pandas as pd

    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    for name in ("d.jsonl", "d.csv", "d.txt", "d.parquet"):
        ds = load_rows(str(tmp_path / name))
        assert len(ds) == 7, name
        assert ds.rows(3, 4, ["text"])[0]["text"].strip() == rows[3]["text"].strip(), name


def test_slice_selects_raw_rows_then_drops_empty(tmp_path):
    rows = ["a" * 10, "", "b" * 10, "   ", "c" * 10, "d" * 10]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in rows))
    ds = load_rows(str(tmp_path / "d.jsonl"))
    texts, end = select_texts(ds, "text", 1, 5)
    assert texts == ["b" * 10, "c" * 10] and end == 5
    texts, end = select_texts(ds, "text", 0, None)
    assert end == 6 and len(texts) == 4


@pytest.mark.parametrize(
    "start,end,column,needle",
    [(0, 99, "text", "--end_idx 99"), (50, None, "text", "--start_idx 50"), (0, 3, "body", "--text_column body")],
)
def test_bad_slices_name_the_flag(tmp_path, start, end, column, needle):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": f"row {i}"}) for i in range(10)))
    with pytest.raises(DataError, match=needle):
        select_texts(load_rows(str(tmp_path / "d.jsonl")), column, start, end)


def test_missing_and_unknown_datasets(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_rows(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.xml").write_text("<a/>")
    with pytest.raises(DataError, match="unsupported file type"):
        load_rows(str(tmp_path / "x.xml"))


def test_packing_loses_no_token_and_keeps_eos_as_target(tokenizer):
    texts = python_docs_texts()[:40]
    rows = tokenize(texts, tokenizer)
    # Independent expectation: each row's own tokens followed by EOS, all rows in order.
    expected = []
    for t in texts:
        expected += tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    blocks = pack(rows, 64, tokenizer.pad_token_id)
    got = torch.cat([blocks.input_ids[i, : blocks.lengths[i]] for i in range(len(blocks))]).tolist()
    assert got == expected
    assert (blocks.lengths[:-1] == 64).all() and 0 < blocks.lengths[-1] <= 64
    batch = blocks.batch(torch.arange(len(blocks)), torch.device("cpu"))
    labels = batch["labels"]
    # Labels are -100 exactly on padding; every EOS is a target.
    assert int((labels == IGNORE_INDEX).sum()) == 64 - int(blocks.lengths[-1])
    assert int((labels == tokenizer.eos_token_id).sum()) == len(texts)


def test_padding_mode_truncates_and_masks_only_padding(tokenizer):
    texts = ["short text.", "a much longer text " * 30]
    blocks = pad_rows(tokenize(texts, tokenizer), 32, tokenizer.pad_token_id)
    assert len(blocks) == 2
    n0 = len(tokenizer(texts[0], add_special_tokens=False)["input_ids"]) + 1
    assert blocks.lengths.tolist() == [n0, 32]
    batch = blocks.batch(torch.tensor([0, 1]), torch.device("cpu"))
    assert batch["labels"][0, n0 - 1].item() == tokenizer.eos_token_id
    assert (batch["labels"][0, n0:] == IGNORE_INDEX).all()
    assert batch["attention_mask"][0].tolist() == [1] * n0 + [0] * (32 - n0)
    assert (batch["labels"][1] != IGNORE_INDEX).all()


def test_filler_rows_have_no_targets(tokenizer):
    blocks = pack(tokenize(["x " * 100], tokenizer), 16, tokenizer.pad_token_id)
    batch = blocks.batch(torch.tensor([0, -1]), torch.device("cpu"))
    assert (batch["labels"][1] == IGNORE_INDEX).all()
    assert (batch["attention_mask"][1] == 1).all()


def _steps(blocks, batch, accum, world, seed=0, epoch=0):
    """Per step: the set of samples over all ranks, and the micro-batch count."""
    plans = [
        StepPlan(blocks, batch_size=batch, accum_steps=accum, rank=r, world_size=world, seed=seed) for r in range(world)
    ]
    per_rank = [list(p.steps(epoch)) for p in plans]
    out = []
    for steps in zip(*per_rank):
        samples = sorted(int(i) for s in steps for mb in s.micro_batches for i in mb if i >= 0)
        assert len({s.target_tokens for s in steps}) == 1  # every rank knows the same denominator
        assert len({len(s.micro_batches) for s in steps}) == 1  # and runs the same number of passes
        out.append((samples, steps[0].target_tokens))
    return out


def test_global_batches_do_not_depend_on_rank_count(tokenizer):
    blocks = build_blocks(python_docs_texts()[:60], tokenizer, 32, packing="concat")
    one = _steps(blocks, batch=8, accum=2, world=1)
    two = _steps(blocks, batch=4, accum=2, world=2)
    four = _steps(blocks, batch=1, accum=4, world=4)
    assert one == two == four
    # Every sample once per epoch, the last step holding the remainder.
    assert sorted(i for s, _ in one for i in s) == list(range(len(blocks)))
    assert sum(t for _, t in one) == int(blocks.target_counts().sum())


def test_order_depends_on_seed_and_epoch(tokenizer):
    blocks = build_blocks(python_docs_texts()[:60], tokenizer, 32, packing="concat")
    plan = StepPlan(blocks, batch_size=4, accum_steps=1, rank=0, world_size=1, seed=1)
    again = StepPlan(blocks, batch_size=2, accum_steps=3, rank=1, world_size=2, seed=1)
    assert torch.equal(plan.epoch_order(0), again.epoch_order(0))
    assert not torch.equal(plan.epoch_order(0), plan.epoch_order(1))
    other_seed = StepPlan(blocks, batch_size=4, accum_steps=1, rank=0, world_size=1, seed=2)
    assert not torch.equal(plan.epoch_order(0), other_seed.epoch_order(0))


def test_resume_offset_continues_the_same_sequence(tokenizer):
    blocks = build_blocks(python_docs_texts()[:60], tokenizer, 32, packing="concat")
    plan = StepPlan(blocks, batch_size=4, accum_steps=1, rank=0, world_size=1, seed=5)
    full = list(plan.steps(2))
    tail = list(plan.steps(2, start_offset=full[2].end_offset))
    assert [s.step_in_epoch for s in tail] == [s.step_in_epoch for s in full[3:]]
    assert all(torch.equal(a.micro_batches[0], b.micro_batches[0]) for a, b in zip(tail, full[3:]))
