"""A mixture's sources of different row formats, each source's held-out split, and what each source gave a step.

The references here are the tokenizer called directly (not data/tokens.py), the definition's recursive reading
(test_mixture.reference_source), and runs on plain files of the same rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_clean_failure, launch, read_jsonl, run_cli
from data.test_mixture import reference_source
from hub.test_hub import offline_runs, wandb_records

from fsdp_opt.data.blocks import rows_to_blocks
from fsdp_opt.data.builtins import builtin_split
from fsdp_opt.data.formats import mixed, resolve_spec, select_rows
from fsdp_opt.data.mixture import counts
from fsdp_opt.data.resolve import DataSource
from fsdp_opt.data.sources import held_out_mixture, open_source
from fsdp_opt.data.tokens import read_template
from fsdp_opt.model.sources import load_tokenizer, resolve_model


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def three_formats(folder: Path) -> Path:
    """Text, prompt/completion and messages sources, 2:1:1; the third a folder with a test split."""
    write_jsonl(folder / "t.jsonl", [{"text": f"text row {i}: " + "lorem ipsum " * (1 + i % 9)} for i in range(60)])
    write_jsonl(folder / "p.jsonl", [{"prompt": f"Question {i}?", "completion": f" Answer {i}."} for i in range(40)])
    (folder / "chat").mkdir()
    chat = lambda i, tag: {
        "messages": [
            {"role": "user", "content": f"{tag} {i}"},  # noqa: E731
            {"role": "assistant", "content": f"reply {i} " * (1 + i % 3)},
        ]
    }
    write_jsonl(folder / "chat" / "train.jsonl", [chat(i, "hello") for i in range(40)])
    write_jsonl(folder / "chat" / "test.jsonl", [chat(i, "held") for i in range(12)])
    mix = folder / "mix.yaml"
    mix.write_text(
        "datasets:\n  - path: t.jsonl\n    weight: 2\n  - path: p.jsonl\n  - path: chat\n    eval_split: test\n"
    )
    return mix


@pytest.fixture(scope="module")
def tokenizer():
    tok = load_tokenizer(resolve_model("tiny-opt"))
    tok.chat_template = read_template("chatml", tok)
    return tok


def by_hand(row: dict, tok) -> tuple[list[int], int]:  # noqa: ANN001
    """A row's token ids and its trained tokens, from the tokenizer itself: text, every token after the first;
    prompt/completion, the tokens past the prompt's; messages, the tokens past the generation prompt."""
    eos = [tok.eos_token_id]
    if "text" in row:
        ids = tok(row["text"])["input_ids"] + eos
        return ids, len(ids) - 1
    if "completion" in row:
        ids = tok(row["prompt"] + row["completion"])["input_ids"] + eos
        return ids, len(ids) - len(tok(row["prompt"])["input_ids"])
    render = lambda m, g: tok(
        tok.apply_chat_template(m, tokenize=False, add_generation_prompt=g),  # noqa: E731
        add_special_tokens=False,
    )["input_ids"]
    ids = render(row["messages"], False)
    return ids, len(ids) - len(render(row["messages"][:1], True))


def test_three_formats_in_one_mixture_tokenize_each_as_its_own_and_tally_by_source(tmp_path, tokenizer):
    mix = three_formats(tmp_path)
    table = open_source(DataSource(str(mix)))
    spec = mixed([resolve_spec(c, "auto") for c in table.source_columns])
    assert spec.format == "mixed" and [p.format for p in spec.parts] == ["text", "prompt_completion", "messages"]
    start, end = 20, 60
    rows = select_rows(table, spec, start, end)
    want_sources = [reference_source(i, (2, 1, 1))[0] for i in range(start, end)]
    assert rows.sources == want_sources
    files = [
        read_jsonl(tmp_path / "t.jsonl"),
        read_jsonl(tmp_path / "p.jsonl"),
        read_jsonl(tmp_path / "chat" / "train.jsonl"),
    ]
    expected = [files[j][r] for j, r in (reference_source(i, (2, 1, 1)) for i in range(start, end))]
    assert rows.rows == expected
    hand = [by_hand(r, tokenizer) for r in expected]
    for packing in ("pad", "docs", "concat"):
        blocks = rows_to_blocks(rows, spec, tokenizer, train_on="completion", max_length=96, packing=packing)
        totals = blocks.source_totals()
        assert totals["rows"] == [want_sources.count(j) for j in range(3)], packing
        assert sum(totals["tokens"]) == int(blocks.target_counts().sum()), packing
        if packing == "pad":  # one row a block, none cut: each row's own count, and its ids as the tokenizer makes them
            assert [blocks.input_ids[k, : blocks.lengths[k]].tolist() for k in range(len(blocks))] == [
                h[0] for h in hand
            ]
            assert blocks.target_counts().tolist() == [h[1] for h in hand]
            assert totals["tokens"] == [sum(h[1] for h, j in zip(hand, want_sources) if j == s) for s in range(3)]


def test_the_held_out_rows_of_a_source_with_an_eval_split_come_from_it(tmp_path):
    mix = three_formats(tmp_path)
    table = open_source(DataSource(str(mix)))
    end = 40
    held = held_out_mixture(DataSource(str(mix)), table, end)
    spec = mixed([resolve_spec(c, "auto") for c in table.source_columns])
    got = select_rows(held, spec, 0, 8).rows
    taken = counts(end, (2, 1, 1))  # the rows [0, 40) took of each source: the others go on after them
    files = [
        read_jsonl(tmp_path / "t.jsonl")[taken[0] :],
        read_jsonl(tmp_path / "p.jsonl")[taken[1] :],
        read_jsonl(tmp_path / "chat" / "test.jsonl"),
    ]
    assert got == [files[j][r] for j, r in (reference_source(i, (2, 1, 1)) for i in range(8))]
    assert all("held" in r["messages"][0]["content"] for r in got if "messages" in r)


TINY = [
    "--model",
    "tiny-opt",
    "--max_length",
    "96",
    "--batch_size",
    "4",
    "--precision",
    "fp32",
    "--num_epochs",
    "1",
    "--seed",
    "5",
    "--activation_checkpointing",
    "false",
    "--chat_template",
    "chatml",
]


def test_a_run_on_three_formats_says_what_each_source_gave_each_step_and_evaluates_on_the_eval_split(tmp_path):
    mix = three_formats(tmp_path)
    run = run_cli(
        TINY
        + [
            "--dataset",
            str(mix),
            "--start_idx",
            "0",
            "--end_idx",
            "40",
            "--eval_rows",
            "8",
            "--lr",
            "1e-3",
            "--packing",
            "pad",
            "--wandb_mode",
            "offline",
            "--output_dir",
            str(tmp_path / "out"),
        ],
        tmp_path,
        nproc=2,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "data: 40 rows of a mixture of text and prompt/completion pairs and conversations" in run.stdout
    assert "of the mixture of the sources' eval splits (a source with none: its rows after the slice's)" in run.stdout
    line = next(l for l in run.stdout.splitlines() if l.startswith("data: by source, "))
    steps = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert len(steps) == 5 and all(sum(r["source_tokens"]) == r["tokens"] for r in steps)  # 40 rows, 8 a step
    rows = [sum(r["source_rows"][j] for r in steps) for j in range(3)]
    assert rows == [20, 10, 10]  # 2:1:1 of 40 rows
    tokens = [sum(r["source_tokens"][j] for r in steps) for j in range(3)]
    names = (tmp_path / "t.jsonl", tmp_path / "p.jsonl", tmp_path / "chat")
    assert line == "data: by source, " + "; ".join(
        f"{name}: {n} rows, {t:,} tokens trained" for name, n, t in zip(names, rows, tokens)
    )
    (wandb_run,) = offline_runs(tmp_path / "out")  # W&B: one series per source, numbered as in the file
    records = wandb_records(wandb_run)
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    for r in steps:
        for j in range(3):
            assert history[r["step"]][f"train/source_tokens/{j + 1}"] == r["source_tokens"][j]
            assert history[r["step"]][f"train/source_rows/{j + 1}"] == r["source_rows"][j]
    # `evaluate` on the checkpoint takes the same held-out rows: the loss the run's eval line gave
    proc = launch(
        ["-m", "fsdp_opt.evaluate"],
        [
            "--checkpoints",
            "latest",
            "--output_dir",
            str(tmp_path / "out"),
            "--eval_rows",
            "8",
            "--num_prompts",
            "2",
            "--max_new_tokens",
            "4",
            "--json",
            "report.json",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["split"] == "the sources' eval splits" and report["rows"] == "[0, 8)"
    (evaluated,) = read_jsonl(tmp_path / "out" / "eval.jsonl")
    assert report["models"][-1]["loss"] == pytest.approx(evaluated["loss"], rel=1e-4)


def test_a_dpo_mixture_of_explicit_and_implicit_pairs_trains_as_a_file_of_its_rows(tmp_path):
    """python-docs-prefs (prompt, chosen, rejected) 3:1 with a file of whole conversations (no prompt column): rows
    [0, 32) train, step for step, as a file of those 32 rows in the defined order, written with explicit prompts."""
    prefs = builtin_split("python-docs-prefs", "train").rows(0, 200, ["prompt", "chosen", "rejected"])
    write_jsonl(
        tmp_path / "imp.jsonl",
        [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in prefs[100:200]],
    )
    mix = tmp_path / "dpo.yaml"
    mix.write_text("datasets:\n  - path: python-docs-prefs\n    weight: 3\n  - path: imp.jsonl\n")
    explicit = [prefs[r] if j == 0 else prefs[100 + r] for j, r in (reference_source(i, (3, 1)) for i in range(32))]
    write_jsonl(tmp_path / "rows.jsonl", explicit)
    common = TINY + [
        "--wandb_mode",
        "disabled",
        "--method",
        "dpo",
        "--max_length",
        "128",
        "--lr",
        "1e-3",
        "--start_idx",
        "0",
        "--end_idx",
        "32",
    ]
    ours = run_cli(common + ["--dataset", str(mix), "--output_dir", str(tmp_path / "mix")], tmp_path, nproc=2)
    assert ours.returncode == 0, ours.stdout[-2000:] + ours.stderr[-3000:]
    ref = run_cli(
        common + ["--dataset", str(tmp_path / "rows.jsonl"), "--output_dir", str(tmp_path / "ref")], tmp_path, nproc=2
    )
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-3000:]
    got, want = read_jsonl(tmp_path / "mix" / "metrics.jsonl"), read_jsonl(tmp_path / "ref" / "metrics.jsonl")
    assert [(r["step"], r["loss"], r["accuracy"]) for r in got] == [(r["step"], r["loss"], r["accuracy"]) for r in want]
    assert [sum(r["source_rows"][j] for r in got) for j in range(2)] == [24, 8]
    assert all(sum(r["source_rows"]) == r["pairs"] and sum(r["source_tokens"]) == r["tokens"] for r in got)


REWARD = '''
def solved(completions, solution, **kwargs):
    """1 where the completion holds the row's solution; None for a row without one (a source with no such column)."""
    return [None if s is None else float(s.lower() in str(c).lower()) for c, s in zip(completions, solution)]
'''


def test_a_grpo_mixture_of_prompt_sources_with_other_columns_gives_rewards_each_rows_columns(tmp_path):
    prompts = builtin_split("python-docs-prompts", "train").rows(0, 60, ["prompt", "solution"])
    write_jsonl(tmp_path / "bare.jsonl", [{"prompt": r["prompt"], "topic": "docs"} for r in prompts])
    mix = tmp_path / "grpo.yaml"
    mix.write_text("datasets:\n  - path: python-docs-prompts\n  - path: bare.jsonl\n")
    (tmp_path / "rewards.py").write_text(REWARD)
    run = run_cli(
        TINY
        + [
            "--wandb_mode",
            "disabled",
            "--dataset",
            str(mix),
            "--method",
            "grpo",
            "--reward",
            f"{tmp_path / 'rewards.py'}:solved",
            "--max_length",
            "128",
            "--max_completion_length",
            "8",
            "--num_generations",
            "4",
            "--start_idx",
            "0",
            "--end_idx",
            "16",
            "--output_dir",
            str(tmp_path / "out"),
        ],
        tmp_path,
        nproc=2,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    steps = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [sum(r["source_rows"][j] for r in steps) for j in range(2)] == [8, 8]
    assert all(sum(r["source_tokens"]) == r["tokens"] for r in steps)
    drawn = read_jsonl(tmp_path / "out" / "completions.jsonl")
    source = {d["row"]: reference_source(d["row"], (1, 1))[0] for d in drawn}  # 0: python-docs-prompts, 1: bare
    assert sorted(set(source.values())) == [0, 1]
    # the bare source's rows have no solution: the reward function got None for it and scored them None
    assert all((d["reward"] is None) == (source[d["row"]] == 1) for d in drawn)
    for r in steps:  # each source's tokens: its completions' tokens in completions.jsonl
        mine = [d for d in drawn if d["step"] == r["step"]]
        assert r["source_tokens"] == [
            sum(len(d["completion_ids"]) for d in mine if source[d["row"]] == j) for j in (0, 1)
        ]


@pytest.mark.parametrize(
    "text, needle",
    [
        (
            "datasets:\n  - path: t.jsonl\n  - path: p.jsonl\n    data_format: messages\n",
            "source 2 ({p}): --messages_column messages: no such column for --data_format messages",
        ),
        ("datasets:\n  - path: t.jsonl\n  - path: odd.jsonl\n", "source 2 ({odd}): --text_column text: no such column"),
        (
            "datasets:\n  - path: t.jsonl\n  - path: chat\n    eval_split: dev\n",
            "source 2 ({chat}): eval_split dev: {chat} has no such split (its splits: test, train)",
        ),
    ],
)
def test_a_source_whose_format_or_eval_split_cannot_be_found_is_one_line(tmp_path, text, needle):
    three_formats(tmp_path)
    write_jsonl(tmp_path / "odd.jsonl", [{"body": "x"}] * 10)
    (tmp_path / "bad.yaml").write_text(text)
    proc = run_cli(
        TINY
        + [
            "--wandb_mode",
            "disabled",
            "--dataset",
            str(tmp_path / "bad.yaml"),
            "--end_idx",
            "8",
            "--eval_rows",
            "4",
            "--output_dir",
            str(tmp_path / "out"),
        ],
        tmp_path,
    )
    assert_clean_failure(
        proc, needle.format(p=tmp_path / "p.jsonl", odd=tmp_path / "odd.jsonl", chat=tmp_path / "chat")
    )
    assert not list((tmp_path / "out").glob("*.pt"))
