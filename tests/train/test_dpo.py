"""--method dpo against the pairs alone: the first step's loss and rewards are what plain transformers gives, pair by
pair, for a Llama-architecture policy and a different reference model (2 ranks, fp32, docs packing, one step holding
every pair), for string and conversational pairs, in full fine-tuning and with LoRA. TRL's DPOTrainer on the same
pairs makes the same answer tokens and (on a well-conditioned model) the same loss. And the bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_clean_failure,
    hub_sessions,
    launch,
    make_chat_llama,
    read_jsonl,
    run_cli,
    run_cli_concurrently,
    run_demo,
    saved_names,
)
from hubdata import PARAGRAPHS
from transformers import AutoModelForCausalLM, AutoTokenizer

BETA = 0.2
PAIRS = 8
# 2 ranks x 2 micro-batches of 2 blocks of 64 tokens (a pair per block: string pairs) or 4 blocks of 128 (a
# sequence per block: conversations in the Llama-style template): every pair in the first step
STEP = [
    "--max_length",
    "64",
    "--batch_size",
    "2",
    "--accum_steps",
    "2",
    "--precision",
    "fp32",
    "--lr",
    "1e-3",
    "--num_epochs",
    "1",
    "--wandb_mode",
    "disabled",
    "--seed",
    "7",
    "--beta",
    str(BETA),
]
LONGER = ["--max_length", "128", "--batch_size", "4"]


def string_pairs(n: int = PAIRS) -> list[dict]:
    # prompts end on a newline: the answer's tokens start on a boundary, as in TRL's and this project's tokenization
    return [
        {
            "prompt": f'Question {k}: what follows "{PARAGRAPHS[k][:30]}"?\n',
            "chosen": PARAGRAPHS[k][30:60].strip(),
            "rejected": PARAGRAPHS[k + 50][:20].strip(),
        }
        for k in range(n)
    ]


def chat_pairs(n: int = PAIRS) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f'Which words follow "{PARAGRAPHS[k][:30]}"?'}],
            "chosen": [{"role": "assistant", "content": PARAGRAPHS[k][30:60].strip()}],
            "rejected": [{"role": "assistant", "content": PARAGRAPHS[k + 50][:20].strip()}],
        }
        for k in range(n)
    ]


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sequences(tok, row: dict) -> list[tuple[list[int], int]]:
    """(ids, first answer position) of prompt + chosen and prompt + rejected, made with the tokenizer directly."""
    out = []
    for answer in ("chosen", "rejected"):
        if isinstance(row["prompt"], str):
            ids = tok(row["prompt"] + row[answer])["input_ids"] + [tok.eos_token_id]
            start = len(tok(row["prompt"])["input_ids"])
        else:
            ids = list(tok.apply_chat_template(row["prompt"] + row[answer], tokenize=True)["input_ids"])
            start = len(tok.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True)["input_ids"])
        out.append((ids, start))
    return out


@torch.no_grad()
def summed_logp(model, ids: list[int], start: int) -> float:
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return float(logp[start - 1 :].sum())


def dpo_reference(policy_dir: Path, ref_dir: Path, rows: list[dict]) -> dict[str, float]:
    """The DPO loss and rewards of the pairs, each pair alone through plain transformers."""
    tok = AutoTokenizer.from_pretrained(policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    losses, chosen, rejected = [], [], []
    for row in rows:
        (c, cs), (r, rs) = sequences(tok, row)
        rc = BETA * (summed_logp(policy, c, cs) - summed_logp(ref, c, cs))
        rr = BETA * (summed_logp(policy, r, rs) - summed_logp(ref, r, rs))
        losses.append(-F.logsigmoid(torch.tensor(rc - rr)).item())
        chosen.append(rc)
        rejected.append(rr)
    n = len(rows)
    return {
        "loss": sum(losses) / n,
        "rewards_chosen": sum(chosen) / n,
        "rewards_rejected": sum(rejected) / n,
        "accuracy": sum((a > b) + 0.5 * (a == b) for a, b in zip(chosen, rejected)) / n,
    }


def dpo_grad_norm(policy_dir: Path, ref_dir: Path, rows: list[dict]) -> float:
    """The norm of the gradient of the pairs' mean DPO loss with respect to every weight of the policy, each pair's
    sequences alone through plain transformers, autograd in float64."""
    tok = AutoTokenizer.from_pretrained(policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float64).eval()
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float64).eval()

    def logp(model, ids: list[int], start: int) -> torch.Tensor:
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[start - 1 :, 0].sum()

    total = torch.zeros((), dtype=torch.float64)
    for row in rows:
        (c, cs), (r, rs) = sequences(tok, row)
        with torch.no_grad():
            ref_margin = logp(ref, c, cs) - logp(ref, r, rs)
        total = total - F.logsigmoid(BETA * (logp(policy, c, cs) - logp(policy, r, rs) - ref_margin))
    (total / len(rows)).backward()
    return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in policy.parameters() if p.grad is not None)))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dpo_models")
    return make_chat_llama(root / "policy", seed=0), make_chat_llama(root / "reference", seed=1)


@pytest.mark.parametrize("form", ["strings", "conversational"])
def test_the_first_step_is_the_dpo_loss_of_the_pairs_alone_full_and_lora(tmp_path, models, form):
    policy, ref = models
    rows = string_pairs() if form == "strings" else chat_pairs()
    data = write(tmp_path / "pairs.jsonl", rows)
    want = dpo_reference(policy, ref, rows)
    base = ["--model", str(policy), "--ref_model", str(ref), "--method", "dpo", "--dataset", str(data), *STEP]
    base += LONGER if form == "conversational" else []
    runs = {"full": [], "lora": ["--lora_rank", "8"]}
    procs = {}
    for name, extra in runs.items():
        (tmp_path / name).mkdir()
        procs[name] = run_cli(base + extra + ["--output_dir", str(tmp_path / name / "out")], tmp_path / name, nproc=2)
    for name, proc in procs.items():
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert f"dpo: reference {ref}: loaded sharded in fp32" in proc.stdout
        first = read_jsonl(tmp_path / name / "out" / "metrics.jsonl")[0]
        assert first["pairs"] == PAIRS, first  # one step holds every pair
        for key in ("loss", "rewards_chosen", "rewards_rejected"):
            assert abs(first[key] - want[key]) <= 1e-5, (name, key, first[key], want[key])
        assert first["accuracy"] == want["accuracy"] and first["margin"] == pytest.approx(
            want["rewards_chosen"] - want["rewards_rejected"], abs=1e-5
        )
        assert abs(want["loss"] - math.log(2)) > 1e-3  # the reference is another model: the loss is not log 2
    # The gradient of full fine-tuning's step (2 ranks x 2 micro-batches), divided over its pairs as the loss is: its
    # norm is autograd's on the pairs alone (a gradient scaled by the micro-batches or the ranks would not be).
    first = read_jsonl(tmp_path / "full" / "out" / "metrics.jsonl")[0]
    norm = dpo_grad_norm(policy, ref, rows)
    assert first["grad_norm"] == pytest.approx(norm, rel=1e-4), (first["grad_norm"], norm)


def test_trl_makes_the_same_answer_tokens_and_the_same_loss(tmp_path):
    """TRL's DPOTrainer: the answer tokens of string and conversational pairs are ours; on a well-conditioned model
    (transformers' default init) its loss of a padded batch agrees with the pairs' loss here within 1e-3."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from fsdp_opt.data.formats import resolve_spec, select_rows
    from fsdp_opt.data.pairs import pairs_from_rows
    from fsdp_opt.data.sequences import Packing

    policy = make_chat_llama(tmp_path / "policy", seed=0)
    ref = make_chat_llama(tmp_path / "reference", seed=1)
    tok = AutoTokenizer.from_pretrained(policy)
    for rows in (string_pairs(), chat_pairs()):
        ds = Dataset.from_list(rows)
        spec = resolve_spec(ds.column_names, "preference")
        ours = pairs_from_rows(select_rows(ds, spec, 0, None), spec, tok, Packing(tok.pad_token_id, 256, "docs"))
        args = DPOConfig(
            output_dir=str(tmp_path / "trl"),
            per_device_train_batch_size=PAIRS,
            beta=BETA,
            report_to=[],
            max_length=256,
            use_cpu=True,
            dataloader_drop_last=False,
            precompute_ref_log_probs=False,
        )
        trainer = DPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(policy),
            ref_model=AutoModelForCausalLM.from_pretrained(ref),
            args=args,
            train_dataset=ds,
            processing_class=tok,
        )
        theirs = trainer.train_dataset
        for k in range(PAIRS):
            for j, answer in enumerate(("chosen", "rejected")):
                seq = ours.ids[2 * k + j]
                mask = ours.targets[2 * k + j]
                assert [t for t, m in zip(seq, mask) if m] == theirs[k][f"{answer}_ids"], (k, answer)
        batch = next(iter(trainer.get_train_dataloader()))
        trainer.model.eval()
        with torch.no_grad():
            trl_loss = float(trainer.compute_loss(trainer.model, batch))
        want = dpo_reference(policy, ref, rows)["loss"]
        print(f"TRL's padded-batch loss {trl_loss:.6f}, pairs alone {want:.6f}: gap {abs(trl_loss - want):.2e}")
        assert abs(trl_loss - want) <= 1e-3


def test_bad_preference_input_is_one_line(tmp_path, models):
    policy, _ = models
    other = make_chat_llama(tmp_path / "other-vocab", seed=2)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<a-token-the-policy-lacks>"])
    tok.save_pretrained(other)
    rows = string_pairs(6)
    ok = write(tmp_path / "ok.jsonl", rows)
    no_rejected = write(tmp_path / "no_rejected.jsonl", [{k: v for k, v in r.items() if k != "rejected"} for r in rows])
    same = write(tmp_path / "same.jsonl", rows[:4] + [dict(r, rejected=r["chosen"]) for r in rows[4:]])
    base = ["--model", str(policy), *STEP]
    cases = [
        (
            ["--method", "dpo", "--dataset", str(no_rejected), "--data_format", "preference"],
            ["--rejected_column rejected", "no such column"],
        ),
        (["--method", "dpo", "--dataset", "python-docs"], ["--method dpo", "the rows are text", "--chosen_column"]),
        (
            ["--method", "dpo", "--dataset", str(ok), "--ref_model", str(other)],
            [f"--ref_model {other}", "tokenizer is not the policy's"],
        ),
        (["--dataset", str(ok)], ["--method sft", "preference pairs", "--method dpo"]),
        (
            ["--method", "dpo", "--dataset", str(ok), "--packing", "concat"],
            ["--packing concat", "not with --method dpo"],
        ),
    ]
    runs = []
    for i, (extra, _) in enumerate(cases):
        (tmp_path / f"c{i}").mkdir()
        # sft (no --method) takes no --beta: left out there, so that the line is the rows' own
        flags = base if "--method" in extra else base[: base.index("--beta")] + base[base.index("--beta") + 2 :]
        runs.append((flags + extra + ["--output_dir", str(tmp_path / f"c{i}" / "out")], tmp_path / f"c{i}", None))
    for (extra, needles), proc, (_, folder, _) in zip(cases, run_cli_concurrently(runs, timeout=180), runs):
        assert_clean_failure(proc, *needles)
        assert not (folder / "out").exists() or not list((folder / "out").glob("*.pt")), extra
    # A pair whose chosen answer is the rejected one is dropped and counted; the rest train.
    proc = run_cli(base + ["--method", "dpo", "--dataset", str(same), "--output_dir", str(tmp_path / "same")], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (
        "4 rows of preference pairs (column prompt, chosen, rejected), loss on the answers only; 2 whose chosen "
        "answer is the rejected one dropped" in proc.stdout
    )
    assert sum(r["pairs"] for r in read_jsonl(tmp_path / "same" / "metrics.jsonl")) == 4


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_resumed_session_is_scored_against_the_model_the_chain_started_from(tmp_path, models, kind):
    """Session 1 trains rows [0, 16) and exports its weights (LoRA: merged into the base); session 2 resumes on
    [16, 24): its first step (every pair of its range) is the DPO loss, through plain transformers, of the policy as
    session 1 left it against the original model (full: the model the chain started from; LoRA: the base with the
    trained adapters switched off), never against the checkpoint it resumed (which would give log 2)."""
    policy, _ = models
    rows = string_pairs(32)
    rows = rows[:16] + rows[24:]  # each of session 2's pairs fits a block: its first step holds them all
    data = write(tmp_path / "pairs.jsonl", rows)
    lora = ["--lora_rank", "8", "--lr", "5e-2"] if kind == "lora" else []
    base = [
        "--model",
        str(policy),
        "--method",
        "dpo",
        "--dataset",
        str(data),
        *STEP,
        *lora,
        "--output_dir",
        str(tmp_path / "out"),
    ]
    merge = ["--export_merge"] if kind == "lora" else []
    first = run_cli(
        base
        + [
            "--start_idx",
            "0",
            "--end_idx",
            "16",
            "--export_hf",
            str(tmp_path / "after1"),
            "--export_dtype",
            "fp32",
            *merge,
        ],
        tmp_path,
        nproc=2,
    )
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    second = run_cli(base + ["--start_idx", "16", "--end_idx", "24", "--resume_file", "latest"], tmp_path, nproc=2)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    said = (
        "dpo: reference: the base with the adapters switched off"
        if kind == "lora"
        else f"dpo: reference {policy}: loaded sharded"
    )
    assert said in first.stdout and said in second.stdout
    step = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if r["slice"] == "16-24"][0]
    want = dpo_reference(tmp_path / "after1", policy, rows[16:24])
    assert step["pairs"] == 8 and abs(step["loss"] - want["loss"]) <= 1e-5, (step["loss"], want["loss"])
    assert abs(want["loss"] - math.log(2)) > 1e-2, want  # session 1 moved the policy away from the reference
    # The checkpoint keeps the reference's log-probabilities of its range: a session resuming inside it reads them.
    payload = torch.load(next((tmp_path / "out").glob("*_16-24-epoch-1.pt")), weights_only=True)
    assert payload["dpo"]["reference"]["logps"].shape == (8, 2)
    if kind == "full":
        assert payload["dpo"]["ref_model"] == str(policy)


def test_a_lora_session_scores_its_next_range_against_the_base_with_the_trained_adapters_off(tmp_path, models):
    """--session_ranges 2: after range [0, 8) the same process scores range [8, 16) against the base with the adapters
    it has just trained switched off. Its first step (every pair of the range) is the DPO loss, through plain
    transformers, of range 1's checkpoint merged into the base against the base itself: adapters that stayed on
    would make the reference the policy (loss log 2)."""
    policy, _ = models
    rows = string_pairs(16)
    data = write(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "out"
    args = [
        "--model",
        str(policy),
        "--method",
        "dpo",
        "--dataset",
        str(data),
        *STEP,
        "--lora_rank",
        "8",
        "--lr",
        "5e-2",
        "--start_idx",
        "auto",
        "--range_size",
        "8",
        "--session_ranges",
        "2",
        "--output_dir",
        str(out),
    ]
    proc = run_cli(args, tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "next range in this session: rows [8, 16)" in proc.stdout
    merged = tmp_path / "after1"
    export = launch(
        ["-m", "fsdp_opt.export"],
        [str(out / "policy_0-8-epoch-1.pt"), str(merged), "--dtype", "fp32", "--merge", "--model", str(policy)],
        tmp_path,
    )
    assert export.returncode == 0, export.stdout[-2000:] + export.stderr[-3000:]
    step = [r for r in read_jsonl(out / "metrics.jsonl") if r["slice"] == "8-16"][0]
    want = dpo_reference(merged, policy, rows[8:16])
    print(f"range 2's first loss {step['loss']:.6f}; plain transformers {want['loss']:.6f}; log 2 {math.log(2):.6f}")
    assert step["pairs"] == 8 and abs(step["loss"] - want["loss"]) <= 1e-5, (step["loss"], want["loss"])
    assert abs(want["loss"] - math.log(2)) > 1e-2, want  # range 1 moved the adapters


def test_three_auto_sessions_through_the_hub_equal_one_straight_run(tmp_path):
    """LoRA DPO on the built-in preference pairs (its reference: the base, adapters off), --start_idx auto through
    the loopback Hub on three empty machines: the names and the losses of one session that trains the three ranges,
    bit for bit."""
    auto = [
        "--model",
        "tiny-opt",
        "--dataset",
        "python-docs-prefs",
        "--method",
        "dpo",
        "--chat_template",
        "chatml",
        "--lora_rank",
        "8",
        "--max_length",
        "128",
        "--batch_size",
        "4",
        "--lr",
        "3e-3",
        "--precision",
        "fp32",
        "--start_idx",
        "auto",
        "--range_size",
        "8",
        "--wandb_mode",
        "disabled",
        "--seed",
        "5",
    ]
    procs = hub_sessions(auto, tmp_path, "me/dpo")
    assert all("dpo: reference: the base with the adapters switched off" in proc.stdout for proc in procs)
    saved = [name for proc in procs for name in saved_names(proc.stdout)]
    one = run_cli(auto + ["--session_ranges", "3", "--output_dir", str(tmp_path / "one")], tmp_path, nproc=2)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-3000:]
    assert saved == saved_names(one.stdout) == [f"tiny_opt_{a}-{a + 8}-epoch-1.pt" for a in (0, 8, 16)]
    fields = ("step", "loss", "slice", "rewards_chosen", "rewards_rejected", "accuracy")
    got = [tuple(r[k] for k in fields) for r in read_jsonl(tmp_path / "m2" / "out" / "metrics.jsonl")]
    want = [tuple(r[k] for k in fields) for r in read_jsonl(tmp_path / "one" / "metrics.jsonl")]
    assert got == want and len(want) >= 6


def test_the_dpo_demo_learns_the_held_out_preferences(tmp_path, wheel_venv):
    """python -m fsdp_opt.demo --dpo: 80 steps of DPO on python-docs-prefs; python -m fsdp_opt.evaluate then scores
    the held-out pairs (the test split) for the base (its own reference: 50%, every pair a tie) and the checkpoint. Run
    as the installed package runs it: the wheel in a fresh virtualenv, from an empty folder."""
    proc = run_demo(wheel_venv, ["--dpo"], tmp_path)
    out = tmp_path / "outputs" / "demo-dpo"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "demo: checkpoints and metrics.jsonl are in outputs/demo-dpo/" in proc.stdout
    base, tuned = json.loads((out / "pairs.json").read_text())["models"]
    assert base["accuracy"] == 0.5 and abs(base["loss"] - math.log(2)) < 1e-6 and base["pairs"] == 100
    assert tuned["accuracy"] >= 0.9 and tuned["margin"] > 1.0, tuned
    assert (
        f"demo: held-out accuracy 50% before training (the model is its own reference), {tuned['accuracy']:.0%} "
        "after" in proc.stdout
    )
    rows = read_jsonl(out / "metrics.jsonl")
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and rows[0]["accuracy"] == 0.5
    evals = read_jsonl(out / "eval.jsonl")
    assert evals[-1]["accuracy"] >= 0.9 and evals[-1]["rows"] == "[0, 100) of split test"
