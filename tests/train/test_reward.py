"""--method reward (a reward model) against TRL 1.16's RewardTrainer: the pairs tokenized as TRL tokenizes them
(strings with the EOS appended as text, conversations through the chat template), and one step's loss and every
weight's gradient equal to TRL's on the same weights (the new score layer included), over 2 ranks and 2 micro-batches
each, with a margin column and --center_rewards_coefficient, packed a row per sequence and as documents; its held-out
accuracy rises in a short run; exported, it loads in AutoModelForSequenceClassification and scores as it was trained;
GRPO scores completions with it (TRL's reward model among the reward functions); a model that is not a one-label
sequence classifier is refused in one line before anything trains."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import (
    ROOT,
    as_flags,
    assert_clean_failure,
    assert_same_step,
    launch,
    make_chat_llama,
    read_jsonl,
    run_cli,
)
from test_dpo import chat_pairs, string_pairs, write
from transformers import AutoModelForSequenceClassification, AutoTokenizer

WORKER = str(ROOT / "tests" / "workers" / "reward_step.py")
PAIRS = 16


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("reward")
    policy = make_chat_llama(root / "policy", seed=0)
    draw = random.Random(3)
    strings = [{**r, "margin": round(draw.uniform(0, 1), 3)} for r in string_pairs(PAIRS)]
    return {
        "root": root,
        "policy": policy,
        "strings": write(root / "strings.jsonl", strings),
        "chat": write(root / "chat.jsonl", chat_pairs(PAIRS)),
        "rows": {"strings": strings, "chat": chat_pairs(PAIRS)},
    }


def trl_step(files: dict, report: dict, kind: str, coefficient: float | None) -> tuple[float, dict]:
    """TRL's RewardTrainer on the same weights and the step's pairs, one process, one batch: the loss (TRL's mean over
    the pairs) and each parameter's gradient; its tokenization held against ours on the way."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    tok = AutoTokenizer.from_pretrained(files["policy"])
    model = AutoModelForSequenceClassification.from_pretrained(files["policy"], num_labels=1, dtype=torch.float32)
    model.load_state_dict(torch.load(report["weights"], weights_only=True))
    rows = files["rows"][kind]
    args = RewardConfig(
        output_dir=str(files["root"] / "trl"),
        per_device_train_batch_size=PAIRS,
        center_rewards_coefficient=coefficient,
        max_length=None,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    data = trainer.train_dataset
    at = {row: k for k, row in enumerate(report["index"])}
    for k in range(len(data)):  # the same tokens in both
        assert report["sequences"][2 * at[k]] == data[k]["chosen_ids"]
        assert report["sequences"][2 * at[k] + 1] == data[k]["rejected_ids"]
    step = [row for rank in report["micro"] for micro in rank for row in micro]
    batch = trainer.data_collator([data[row] for row in step])
    model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


CASES = {  # (rows, flags beyond the common ones, TRL's center coefficient)
    "strings-margin-pad": ("strings", ["--packing", "pad"], None),
    "chat-centered-docs": ("chat", ["--packing", "docs", "--center_rewards_coefficient", "0.01"], 0.01),
}


def flags_of(files: dict, tmp_path, kind: str, *extra: str) -> list[str]:  # noqa: ANN001
    return [
        *as_flags(model=files["policy"], dataset=files[kind], method="reward", max_length=128, batch_size=4),
        *as_flags(accum_steps=2, precision="fp32", output_dir=tmp_path / "out", wandb_mode="disabled"),
        *extra,
    ]


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_is_trls_reward_loss_and_gradient_on_the_same_pairs(tmp_path, files, case):
    kind, extra, coefficient = CASES[case]
    out = tmp_path / "report.json"
    proc = launch([WORKER], [str(out), *flags_of(files, tmp_path, kind, *extra)], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ours = json.loads(out.read_text())
    ours["weights"] = str(out) + ".pt"
    if "pad" in extra:
        assert [len(rank) for rank in ours["micro"]] == [2, 2]  # 2 micro-batches of 4 pairs on each rank
    loss, grads = trl_step(files, ours, kind, coefficient)
    print(f"{case}: ours {ours['loss']:.8f}, TRL {loss:.8f}, accuracy {ours['record']['accuracy']:.3f}")
    assert "score.weight" in grads
    assert_same_step(ours, loss, grads, floor=1e-3)
    record = ours["record"]
    assert (
        record["pairs"] == sum(len(m) for rank in ours["micro"] for m in rank)
        and record["min_reward"] <= record["mean_reward"] <= record["max_reward"]
    )


def test_a_reward_model_learns_exports_and_scores_grpo_completions(tmp_path, files):
    """Trained on pairs whose chosen answer says good and whose rejected one says bad, its held-out pairs ranked right
    and their loss halved from the first epoch's; exported, transformers' AutoModelForSequenceClassification loads it and scores a pair as the run
    did; a GRPO run takes it as --reward_model, its completions.jsonl holding its scores, equal to the exported model's
    on the same texts; a causal LM given as --reward_model is refused in one line."""
    rows = [
        {"prompt": f"Pick {k}: ", "chosen": "good " * (1 + k % 3), "rejected": "bad " * (1 + k % 4)} for k in range(64)
    ]
    data = write(tmp_path / "pairs.jsonl", rows)
    flags = flags_of(files, tmp_path, "strings", "--dataset", str(data), "--end_idx", "48", "--eval_rows", "16")
    flags += ["--lr", "3e-3", "--num_epochs", "4", "--output_dir", str(tmp_path / "rm"), "--packing", "docs"]
    trained = run_cli(flags, tmp_path, nproc=2)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-3000:]
    evals = read_jsonl(tmp_path / "rm" / "eval.jsonl")
    print("held-out accuracy", [e["accuracy"] for e in evals], "loss", [round(e["loss"], 4) for e in evals])
    assert evals[-1]["accuracy"] >= 0.9 and evals[-1]["loss"] < 0.5 * evals[0]["loss"]
    assert evals[-1]["margin"] > evals[0]["margin"] > 0
    final = next((tmp_path / "rm").glob("*-epoch-4.pt"))
    export = tmp_path / "rm-folder"
    proc = launch(["-m", "fsdp_opt.export"], [str(final), str(export), "--dtype", "fp32"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    model = AutoModelForSequenceClassification.from_pretrained(export).eval()
    tok = AutoTokenizer.from_pretrained(export)
    assert model.config.num_labels == 1
    with torch.no_grad():
        good, bad = (
            model(**tok(rows[60]["prompt"] + rows[60][k] + tok.eos_token, return_tensors="pt")).logits[0, 0]
            for k in ("chosen", "rejected")
        )
    assert good > bad
    prompts = write(tmp_path / "prompts.jsonl", [{"prompt": f"Pick {k}: "} for k in range(8)])
    grpo = as_flags(
        model=files["policy"],
        dataset=prompts,
        method="grpo",
        reward_model=export,
        num_generations=4,
        max_completion_length=6,
        max_length=64,
        batch_size=4,
        accum_steps=1,
        precision="fp32",
        wandb_mode="disabled",
        output_dir=tmp_path / "grpo",
    )
    scored = run_cli(grpo, tmp_path, nproc=2)
    assert scored.returncode == 0, scored.stdout[-2000:] + scored.stderr[-3000:]
    label = export.name
    completions = read_jsonl(tmp_path / "grpo" / "completions.jsonl")
    assert completions and all(r["rewards"][label] is not None for r in completions)
    for r in completions[:4]:  # the exported model's score of the same text, tokenized as TRL tokenizes it
        given = tok(f"Pick {r['row']}: " + r["completion"], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            assert abs(model(**given).logits[0, 0].item() - r["rewards"][label]) <= 1e-4
    assert_clean_failure(
        run_cli([*grpo[:7], str(files["policy"]), *grpo[8:]], tmp_path), "not a sequence classifier of one label"
    )
