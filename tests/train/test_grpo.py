"""--method grpo against TRL and plain transformers: one step's loss and every weight's gradient on given completions
equal TRL 1.16's GRPOTrainer loss (2 ranks, fp32, with and without a KL term to another model); greedy sampling makes
the completions transformers' generate makes; the first step's loss with a reference equals the loss computed from
completions.jsonl; the chain resumes bit for bit; bad input is one line."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from conftest import ROOT, assert_clean_failure, launch, make_chat_llama, read_jsonl, run_cli, run_cli_concurrently
from transformers import AutoModelForCausalLM, AutoTokenizer

G = 4  # completions per prompt
PROMPTS = 8
LENGTH = 8  # --max_completion_length
WORDS = ["alpha", "lambda", "red", "list", "dict", "set", "tuple", "file", "line", "name", "type", "class"]  # one token each
WORKER = str(ROOT / "tests" / "workers" / "grpo_step.py")
REWARDS = '''
def overlap(completions, target, **kwargs):
    """How many of the target's letters the completion holds, in thirds; None where the row has no target."""
    out = []
    for c, t in zip(completions, target):
        out.append(None if not t else len(set(c) & set(t)) / 3.0)
    return out


def short(completions, completion_ids, target, **kwargs):
    return [None if not t else 1.0 / (1 + len(ids)) for ids, t in zip(completion_ids, target)]
'''


def rows() -> list[dict]:
    # prompts of one length in tokens (no padding on either side: TRL's rows and ours see the same positions)
    return [{"prompt": f"Say {WORDS[k]} twice:", "target": "" if k == 5 else WORDS[k]} for k in range(PROMPTS)]


@pytest.fixture(scope="module")
def setup_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("grpo")
    policy, ref = make_chat_llama(root / "policy", seed=0), make_chat_llama(root / "reference", seed=1)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    (root / "rewards.py").write_text(REWARDS)
    tok = AutoTokenizer.from_pretrained(policy)
    lengths = {len(tok(r["prompt"])["input_ids"]) for r in rows()}
    assert len(lengths) == 1, lengths
    draw = random.Random(11)
    completions, ended = {}, {}
    for r in range(PROMPTS):
        for g in range(G):
            n = draw.randint(2, LENGTH)
            ids = [draw.randrange(3, 4096) for _ in range(n)]
            stops = draw.random() < 0.6 and n < LENGTH
            completions[f"{r}:{g}"] = ids + [tok.eos_token_id] if stops else ids + [draw.randrange(3, 4096)] * (LENGTH - n)
            ended[f"{r}:{g}"] = stops
    given = root / "given.json"
    given.write_text(json.dumps({"completions": completions, "ended": ended}))
    return {"policy": policy, "ref": ref, "data": data, "rewards": root / "rewards.py", "given": given, "root": root}


def trl_step(files: dict[str, Path], loss_type: str, beta: float, report: dict) -> tuple[float, dict, torch.Tensor]:
    """TRL's GRPOTrainer loss of the same prompts, completions and rewards (the advantages computed here from the
    rewards by TRL's rule), on one process and one batch: the loss and each parameter's gradient."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(files["policy"])
    model = AutoModelForCausalLM.from_pretrained(files["policy"], dtype=torch.float32)
    given = json.loads(files["given"].read_text())
    n = PROMPTS * G
    args = GRPOConfig(output_dir=str(files["root"] / "trl"), per_device_train_batch_size=n, num_generations=G,
                      max_completion_length=LENGTH, beta=beta, loss_type=loss_type, report_to=[], use_cpu=True,
                      bf16=False)  # fmt: skip (TRL defaults to bf16 autocast: its log-probabilities' gradient then in bf16)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list(rows()), processing_class=tok)  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1
    prompts = [tok(r["prompt"])["input_ids"] for r in rows() for _ in range(G)]  # ours: with the tokenizer's BOS
    keys = [f"{r}:{g}" for r in range(PROMPTS) for g in range(G)]
    comp = [given["completions"][k] for k in keys]
    width = max(map(len, comp))
    completion_ids = torch.tensor([c + [tok.pad_token_id] * (width - len(c)) for c in comp])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in comp])
    # the rewards as ours recorded them, the advantages by TRL's rule (sum_then_normalize, group std, NaN-aware)
    by_key = {(r["row"], i % G): r for i, r in enumerate(sorted(report["records"], key=lambda r: r["row"]))}
    reward = torch.tensor([math.nan if by_key[(r, g)]["reward"] is None else by_key[(r, g)]["reward"]
                           for r in range(PROMPTS) for g in range(G)])  # fmt: skip
    grouped = reward.view(-1, G)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    count = (~torch.isnan(grouped)).sum(1, keepdim=True)
    std = (torch.nanmean((grouped - mean) ** 2, dim=1, keepdim=True) * count / (count - 1)).sqrt()
    advantages = torch.nan_to_num((grouped - mean) / (std + 1e-4), nan=0.0).reshape(-1)
    inputs = {"prompt_ids": torch.tensor(prompts), "prompt_mask": torch.ones(n, len(prompts[0]), dtype=torch.long),
              "completion_ids": completion_ids, "completion_mask": completion_mask, "advantages": advantages,
              "num_items_in_batch": completion_mask.sum()}  # fmt: skip
    if beta:
        from trl.trainer.utils import add_fused_lm_head

        reference = AutoModelForCausalLM.from_pretrained(files["ref"], dtype=torch.float32).eval()
        add_fused_lm_head(reference, temperature=1.0)  # as TRL prepares its own reference model
        ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        with torch.no_grad():
            inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(reference, ids, mask, width)[0]
    model.train()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, advantages


@pytest.mark.parametrize("loss_type,beta,packing", [("dapo", 0.0, "pad"), ("grpo", 0.0, "docs"),
                                                    ("dapo", 0.04, "docs"), ("grpo", 0.04, "pad")])  # fmt: skip
def test_a_step_is_trls_loss_and_gradient_on_the_same_completions(tmp_path, setup_files, loss_type, beta, packing):
    f = setup_files
    flags = ["--model", str(f["policy"]), "--dataset", str(f["data"]), "--method", "grpo", "--reward",
             f"{f['rewards']}:overlap,{f['rewards']}:short", "--reward_weights", "1.0,0.5", "--num_generations", str(G),
             "--max_completion_length", str(LENGTH), "--max_length", "64", "--batch_size", "8", "--accum_steps", "2",
             "--precision", "fp32", "--loss_type", loss_type, "--beta", str(beta), "--packing", packing,
             "--output_dir", str(tmp_path / "out"), "--wandb_mode", "disabled", "--seed", "7"]  # fmt: skip
    if beta:
        flags += ["--ref_model", str(f["ref"])]
    out = tmp_path / "report.json"
    proc = launch([WORKER], [str(out), str(f["given"]), *flags], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ours = json.loads(out.read_text())
    if packing == "pad":
        assert ours["micro_batches"] == 2  # 16 completions a rank, 8 rows a micro-batch
    loss, grads, advantages = trl_step(f, loss_type, beta, ours)
    records = sorted(ours["records"], key=lambda r: (r["row"]))
    assert [round(r["advantage"], 5) for r in records] == [round(float(a), 5) for a in advantages]
    assert any(r["reward"] is None for r in records) and all(r["advantage"] == 0 for r in records if r["reward"] is None)
    print(f"{loss_type} beta {beta}: ours {ours['loss']:.8f}, TRL {loss:.8f}")
    assert abs(ours["loss"] - loss) <= 1e-5, (ours["loss"], loss)
    assert set(ours["grads"]) == set(grads)
    diffs = {n: (torch.tensor(ours["grads"][n]) - g).abs().max().item() for n, g in grads.items()}
    worst = max(diffs.values())
    assert worst <= 1e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:4]
    assert max(g.abs().max().item() for g in grads.values()) > 1e-3  # the gradients are not all zero
