"""--method rloo against TRL 1.16's RLOOTrainer: on the same prompts and completions (injected, as GRPO's tests inject
them), one step's loss and every weight's gradient equal TRL's, over 2 ranks and 2 micro-batches each, with the KL
in the reward (another model as the reference), with --normalize_advantages, and on the second pass over a generation
where the clip binds; the advantages are TRL's leave-one-out rule of the raw rewards completions.jsonl records; then
a short run end to end, resumed bit for bit, and bad input in one line."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_clean_failure, assert_same_step, read_jsonl, run_cli
from test_grpo import (
    G,
    given_completions,
    group_flags,
    per_token_logps,
    setup_files,  # noqa: F401 - the module's fixture, shared
    step_report,
    trl_models,
    trl_trainer,
)


def leave_one_out(rewards: torch.Tensor, normalize: bool) -> torch.Tensor:
    """TRL 1.16's RLOO advantages (its rule, written out here): each reward less the mean of its group's other scorable
    ones, an unscorable completion's (NaN) 0; with normalize, standardized over the generation."""
    from trl.trainer.utils import nanstd

    grouped = rewards.view(-1, G)
    counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (counts - 1)
    advantages = rewards - baselines.view(-1)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def trl_rloo_step(files, report: dict, *, beta: float, normalize: bool = False, epsilon: float = 0.2):  # noqa: ANN001, ANN201
    """TRL's RLOOTrainer loss of the same prompts, completions and raw rewards, on one process: the loss, each
    parameter's gradient and the advantages. The old log-probabilities are the model the completions were sampled
    from (a second pass: the weights the first pass started from), the KL in the reward that model's to the
    reference's, summed over each completion."""
    from trl import RLOOConfig, RLOOTrainer

    tok, model, sampled = trl_models(files, report, sampled_always=True)
    trainer = trl_trainer(
        RLOOTrainer,
        RLOOConfig,
        files["root"] / "trl-rloo",
        report,
        tok,
        model,
        beta=beta,
        epsilon=epsilon,
        normalize_advantages=normalize,
    )
    given = given_completions(files, tok)
    keys, completion_mask = given["keys"], given["inputs"]["completion_mask"]
    old = per_token_logps(trainer, sampled, given)
    by_key = {(r["row"], r["place"]): r for r in report["records"]}
    rewards = torch.tensor([math.nan if by_key[k]["reward"] is None else by_key[k]["reward"] for k in keys])
    if beta:
        rewards = rewards - beta * ((old - per_token_logps(trainer, files["ref"], given)) * completion_mask).sum(-1)
    advantages = leave_one_out(rewards, normalize)
    model.train()
    inputs = {**given["inputs"], "advantages": advantages, "old_logps": (old * completion_mask).sum(1)}
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}, advantages


RLOO_CASES = {  # (flags beyond the common ones, TRL's settings)
    "kl-in-reward-pad": (["--beta", "0.05", "--packing", "pad"], {"beta": 0.05}),
    "normalized-docs": (
        ["--beta", "0", "--normalize_advantages", "true", "--packing", "docs"],
        {"beta": 0.0, "normalize": True},
    ),
    # the second pass over a generation: the policy has moved (a large step), the ratio is off 1 and the clip binds
    "second-pass-kl": (
        ["--num_iterations", "2", "--lr", "5e-3", "--epsilon", "0.05", "--beta", "0.05", "--packing", "pad"],
        {"beta": 0.05, "epsilon": 0.05},
    ),
}


@pytest.mark.parametrize("case", list(RLOO_CASES))
def test_a_step_is_trls_rloo_loss_and_gradient_on_the_same_completions(tmp_path, setup_files, case):  # noqa: F811
    f = setup_files
    extra, trl_settings = RLOO_CASES[case]
    flags = group_flags(f, tmp_path, "rloo", *extra)
    if trl_settings["beta"]:
        flags += ["--ref_model", str(f["ref"])]
    ours = step_report(f, tmp_path, flags)
    if "pad" in extra:
        assert ours["micro_batches"] == 2  # 16 completions a rank, 8 a micro-batch
    loss, grads, advantages = trl_rloo_step(f, ours, **trl_settings)
    records = sorted(ours["records"], key=lambda r: (r["row"], r["place"]))
    assert any(r["reward"] is None for r in records)
    assert max(abs(r["advantage"] - float(a)) for r, a in zip(records, advantages)) <= 1e-5
    if ours["iteration"] > 1:
        low, high, region, count = ours["clips"]
        print(f"{case}: clipped low {low:g}, high {high:g}, of {count:g} completions")
        assert 0 < region < count  # the clip binds on some completions, not all
    print(f"{case}: ours {ours['loss']:.8f}, TRL {loss:.8f}")
    assert_same_step(ours, loss, grads, floor=1e-3)


def test_a_short_rloo_run_resumes_bit_for_bit_and_refuses_a_flag_of_another_method(tmp_path, setup_files):  # noqa: F811
    """Sampled completions (no injection), 2 ranks, 4 steps of 2 prompts, saved after the second: resumed there, steps 3 and 4
    equal the straight run's, completions.jsonl too; metrics hold RLOO's fields with the raw rewards; a GRPO flag is
    refused in one line."""
    f = setup_files
    flags = group_flags(
        f, tmp_path, "rloo", "--beta", "0.05", "--ref_model", str(f["ref"]), "--batch_size", "4", "--accum_steps", "1"
    )
    flags = [x for x in flags if x not in ("--output_dir", str(tmp_path / "out"))]
    straight = run_cli(flags + ["--output_dir", str(tmp_path / "a"), "--save_every_steps", "2"], tmp_path, nproc=2)
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-3000:]
    one = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in one] == [1, 2, 3, 4]
    assert all(r["kl"] is not None and r["iteration"] == 1 and "reward_overlap" in r for r in one)
    mid = next((tmp_path / "a").glob("*-step-2.pt"))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / mid.name).write_bytes(mid.read_bytes())
    resumed = run_cli(flags + ["--output_dir", str(tmp_path / "b"), "--resume_file", mid.name], tmp_path, nproc=2)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    keys = ("step", "loss", "grad_norm", "reward", "kl")
    two = [tuple(r[k] for k in keys) for r in read_jsonl(tmp_path / "b" / "metrics.jsonl")]
    assert two == [tuple(r[k] for k in keys) for r in one if r["step"] > 2]
    sampled = read_jsonl(tmp_path / "a" / "completions.jsonl")
    assert read_jsonl(tmp_path / "b" / "completions.jsonl") == [r for r in sampled if r["step"] > 2]
    assert_clean_failure(
        run_cli(flags + ["--scale_rewards", "batch"], tmp_path), "--scale_rewards: only with --method grpo"
    )
