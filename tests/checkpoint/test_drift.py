"""Settings drift, rule by rule: which changed flags break a chain's exactness, which are choices, which are not
compared; the one-line refusal; and the model card's record of what changed."""

from __future__ import annotations

import pytest

from fsdp_opt.base import ConfigError
from fsdp_opt.checkpoint.drift import (
    BREAKING,
    CHANGES_KEY,
    compare,
    global_batch_change,
    line,
    listed,
    refuse_if_breaking,
    trained_with_other_settings,
)
from fsdp_opt.config.parse import parse_args
from fsdp_opt.hub.card import render_card

SAVED = parse_args(["--model", "tiny-opt", "--dataset", "python-docs", "--lr", "3e-4", "--max_length", "512"]).flat()


def changed(*argv: str) -> list[dict]:
    return compare(
        SAVED,
        parse_args(
            ["--model", "tiny-opt", "--dataset", "python-docs", "--lr", "3e-4", "--max_length", "512", *argv]
        ).flat(),
    )


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--model", "facebook/opt-125m"], "model"),
        (["--dataset", "someone/rows"], "dataset"),
        (["--max_length", "1024"], "max_length"),
        (["--packing", "pad"], "packing"),
        (["--seed", "7"], "seed"),
        (["--data_format", "text"], "data_format"),
        (["--train_on", "all"], "train_on"),
        (["--chat_template", "chatml"], "chat_template"),
        (["--text_column", "body"], "text_column"),
    ],
)
def test_changes_that_break_exactness(argv, flag):
    got = changed(*argv)
    assert [c["flag"] for c in got] == [flag] and got[0]["breaks"] == BREAKING[flag]


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--lr", "1e-4"], "lr"),
        (["--max_grad_norm", "0.5"], "max_grad_norm"),
        (["--time_limit", "11h"], "time_limit"),
        (["--eval_rows", "50"], "eval_rows"),
        (["--warmup_steps", "10"], "warmup_steps"),
        (["--weight_decay", "0.1"], "weight_decay"),
    ],
)
def test_changes_that_are_choices(argv, flag):
    got = changed(*argv)
    assert [c["flag"] for c in got] == [flag] and got[0]["breaks"] is None
    assert line(got[0]).endswith("(a choice: applied from this session on)")


def test_a_model_folder_or_data_file_at_another_path_is_the_same_one():
    moved = compare(
        {**SAVED, "model": "model", "dataset": "/kaggle/input/rows-v1/rows.jsonl"},
        {**SAVED, "model": "/tmp/work/model", "dataset": "/kaggle/input/rows-v2/rows.jsonl"},
    )
    assert [(c["flag"], c["breaks"]) for c in moved] == [("model", None), ("dataset", None)]
    other = compare({**SAVED, "model": "/data/model-a"}, {**SAVED, "model": "/data/model-b"})
    assert other[0]["breaks"] == BREAKING["model"]


def test_what_is_not_compared_and_values_read_back():
    # where the session is in the chain and how this machine lays a step out
    assert (
        changed(
            "--start_idx",
            "5000",
            "--end_idx",
            "10000",
            "--batch_size",
            "8",
            "--accum_steps",
            "2",
            "--precision",
            "fp32",
            "--num_epochs",
            "3",
            "--output_dir",
            "elsewhere",
        )
        == []
    )
    assert changed("--lr", "0.0003") == []  # the same value written another way
    assert compare(None, SAVED) == [] and compare({"lr": 1e-3}, {"lr": 1e-3, "new_flag": 1}) == []


def test_the_global_batch_counts_only_inside_a_range():
    assert global_batch_change(64, 32, mid_range=False) is None  # a new range starts at its first batch anyway
    assert global_batch_change(64, 64, mid_range=True) is None
    moved = global_batch_change(64, 32, mid_range=True)
    assert moved["flag"] == "global_batch" and "position" in moved["breaks"]


def test_a_finished_range_asked_again_compares_what_it_trains_with():
    """What a range trains: the drift's flags, the LoRA identity and the global batch; not how a session runs."""
    base = ["--model", "tiny-opt", "--dataset", "python-docs", "--lr", "3e-4", "--max_length", "512"]

    def again(*argv: str, saved_batch: int = 8, batch: int | None = 8) -> list[str]:
        return [
            c["flag"] for c in trained_with_other_settings(parse_args(base + list(argv)), SAVED, saved_batch, batch)
        ]

    assert again("--time_limit", "11h", "--eval_rows", "20", "--keep_last", "1", "--hf_repo", "me/x") == []
    assert again("--batch_size", "8", "--accum_steps", "2", "--overwrite") == []
    assert again("--lr", "1e-4", "--seed", "3") == ["seed", "lr"]
    assert again("--lora_rank", "16") == ["lora_rank"]
    assert again(saved_batch=8, batch=16) == ["global_batch"] and again(batch=None) == []
    assert listed(trained_with_other_settings(parse_args(base + ["--lr", "1e-4"]), SAVED, None, None)) == (
        "--lr 0.0003 -> 0.0001"
    )


def test_breaking_changes_are_refused_in_one_line_unless_allowed():
    changes = changed("--max_length", "1024", "--packing", "pad", "--lr", "1e-4")
    assert [c["flag"] for c in changes] == ["max_length", "packing", "lr"]  # breaking first
    with pytest.raises(ConfigError) as err:
        refuse_if_breaking(changes, False, "opt_1.3B_0-5000-epoch-1.pt")
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        "--resume_file opt_1.3B_0-5000-epoch-1.pt: --max_length 512 -> 1024"
    )
    assert "--packing docs -> pad" in message and "--lr" not in message and "--allow_changes" in message
    refuse_if_breaking(changes, True, "opt_1.3B_0-5000-epoch-1.pt")  # allowed: no error
    assert line(changes[0]) == "settings: --max_length 512 -> 1024 (breaks exactness: the blocks change)"


def test_the_model_card_lists_the_changes_along_the_chain():
    changes = [{**c, "step": 40} for c in changed("--lr", "1e-4")]
    index = {
        "checkpoints": {
            "tiny_opt_0-10-epoch-1.pt": {"global_step": 80, "start_idx": 0, "end_idx": 10, CHANGES_KEY: changes}
        }
    }
    card = render_card("me/run", index)
    assert "## Settings changed along the chain" in card
    assert "| 40 | `--lr` | 0.0003 | 0.0001 | kept (a choice) |" in card
