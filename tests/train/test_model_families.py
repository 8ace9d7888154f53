"""Each model family beyond OPT through the whole trainer with default flags: 2 ranks, FULL_SHARD, docs packing, the
attention kernel `auto` picks. Tiny random-weight models of Qwen3, Gemma 2, Gemma 3 (text), Mistral and Phi-3 are
built here offline, each with a sliding window (32 tokens) shorter than --max_length (128) where the family has one,
and a tokenizer that adds a BOS where the family's does. Each one:

- trains and learns (three epochs; the last epoch's mean loss well under the first's, held-out loss falling);
- resumes exactly: a second session from the epoch-2 checkpoint gives the straight run's losses, ==, in fp32;
- exports a folder that `from_pretrained` loads with the checkpoint's logits, and with the trainer's held-out loss;
- with a global batch that holds every row, has a first-step loss equal to the token mean of the rows run alone
  through transformers (BOS included where the tokenizer adds it), under LoRA, which then trains.

Per-row packed losses under every kernel each family has are in tests/model/test_families.py."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
from conftest import built_once, loss_alone, make_family_model, read_jsonl, run_cli
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from fsdp_opt.checkpoint.names import MODEL_KEY, checkpoint_name
from fsdp_opt.data.builtins import python_docs_texts
from fsdp_opt.model.families import family_of

WINDOW, LENGTH, ROWS, HELD_OUT, FIRST_STEP_ROWS = 32, 128, 24, 4, 8

# model_type -> (its tokenizer adds a BOS, config fields beyond the shared small shape)
FAMILIES = {
    "qwen3": (False, dict(head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "gemma2": (True, dict(head_dim=16, sliding_window=WINDOW)),
    "gemma3_text": (
        True,
        dict(head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    ),
    "mistral": (True, dict(sliding_window=WINDOW)),
    "phi3": (False, dict(sliding_window=WINDOW)),
}
COMMON = ["--dataset", "python-docs", "--max_length", str(LENGTH), "--seed", "5", "--device", "cpu"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def runs(request, tmp_path_factory) -> tuple[str, Path]:
    """For one family: the straight run (3 epochs, held-out rows, an fp32 export), a second session resumed from its
    epoch-2 checkpoint, and a LoRA run whose one step per epoch holds every row. Built once for both test workers."""
    model_type = request.param
    bos, fields = FAMILIES[model_type]

    def build(root: Path) -> None:
        model = make_family_model(root / "model", model_type, bos=bos, **fields)
        straight = [
            "--model",
            str(model),
            *COMMON,
            "--end_idx",
            str(ROWS),
            "--batch_size",
            "2",
            "--lr",
            "3e-3",
            "--output_dir",
        ]
        jobs = {
            "straight": straight
            + [
                "out",
                "--num_epochs",
                "3",
                "--eval_rows",
                str(HELD_OUT),
                "--export_hf",
                "export",
                "--export_dtype",
                "fp32",
            ],
            "resumed": straight
            + [
                "resumed",
                "--num_epochs",
                "1",
                "--resume_file",
                str(root / "out" / checkpoint_name("model", 0, ROWS, 2)),
            ],
            "lora": [
                "--model",
                str(model),
                *COMMON,
                "--end_idx",
                str(FIRST_STEP_ROWS),
                "--batch_size",
                "16",
                "--num_epochs",
                "4",
                "--lora_rank",
                "8",
                "--lr",
                "1e-2",
                "--output_dir",
                "lora",
            ],
        }
        for name, args in jobs.items():
            proc = run_cli(args, root, nproc=2)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            (root / f"{name}.txt").write_text(proc.stdout)

    return model_type, built_once(tmp_path_factory, f"family-{model_type}", build)


def test_trains_learns_and_resumes_exactly(runs):
    model_type, root = runs
    out = (root / "straight.txt").read_text()
    config = AutoConfig.from_pretrained(root / "model")
    assert family_of(config) is not None and "not one of the tested families" not in out
    if model_type == "gemma2":
        assert "attention: eager (gemma2 has no SDPA path)" in out
    steps = read_jsonl(root / "out" / "metrics.jsonl")
    per_epoch = len(steps) // 3
    first, last = (statistics.mean(r["loss"] for r in steps[i * per_epoch : (i + 1) * per_epoch]) for i in (0, 2))
    assert last < first - 1.0, (first, last)  # from about ln(4096) = 8.3
    evals = [r["loss"] for r in read_jsonl(root / "out" / "eval.jsonl")]
    assert len(evals) == 3 and evals[0] > evals[1] > evals[2]
    # the second session: epoch 3 from the epoch-2 checkpoint, step for step the straight run's numbers
    resumed = read_jsonl(root / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in steps[2 * per_epoch :]]
    assert [(r["loss"], r["tokens"]) for r in resumed] == [(r["loss"], r["tokens"]) for r in steps[2 * per_epoch :]]


def test_export_loads_with_the_checkpoints_logits_and_the_trainers_held_out_loss(runs):
    _, root = runs
    exported = AutoModelForCausalLM.from_pretrained(root / "export", dtype=torch.float32).eval()
    payload = torch.load(root / "out" / checkpoint_name("model", 0, ROWS, 3), weights_only=True)
    trained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(root / "export"), dtype=torch.float32).eval()
    trained.load_state_dict(payload[MODEL_KEY])
    tokenizer = AutoTokenizer.from_pretrained(root / "export")
    ids = torch.tensor([tokenizer(python_docs_texts()[ROWS])["input_ids"][:LENGTH]])
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, trained(input_ids=ids).logits)
    # the held-out loss the trainer logged after its last step, from the exported model on the rows alone
    total, count = loss_alone(exported, pieces(tokenizer, python_docs_texts()[ROWS : ROWS + HELD_OUT]))
    last = read_jsonl(root / "out" / "eval.jsonl")[-1]
    assert last["tokens"] == count and abs(last["loss"] - total / count) <= 1e-5, (last, total / count)


def pieces(tokenizer, texts) -> list[list[int]]:
    """Each row as the tokenizer makes it (its BOS where it adds one), EOS appended, cut every --max_length tokens."""
    rows = [ids + [tokenizer.eos_token_id] for ids in tokenizer(list(texts))["input_ids"]]
    return [r[i : i + LENGTH] for r in rows for i in range(0, len(r), LENGTH)]


def test_first_step_is_the_rows_alone_bos_included_and_lora_trains(runs):
    model_type, root = runs
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    texts = python_docs_texts()[:FIRST_STEP_ROWS]
    rows = pieces(tokenizer, texts)
    assert all(len(r) > WINDOW for r in rows[:2])  # the window shapes these rows' losses
    adds_bos = FAMILIES[model_type][0]
    assert all((r[0] == tokenizer.bos_token_id) == adds_bos for r in rows[:1])
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32).eval()
    total, count = loss_alone(model, rows)
    steps = read_jsonl(root / "lora" / "metrics.jsonl")
    assert len(steps) == 4  # one step per epoch: the global batch held every row
    assert steps[0]["tokens"] == count
    assert abs(steps[0]["loss"] - total / count) <= 1e-5, (steps[0]["loss"], total / count)
    losses = [r["loss"] for r in steps]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.05, losses
    assert "lora" in (root / "lora.txt").read_text()
