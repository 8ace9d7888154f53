"""A reward function that raises in the middle of a GRPO run on 2 ranks loses nothing: the session ends non-zero
with a last line naming the row and the completion's place as completions.jsonl numbers it, after saving the last
whole step, locally and on the loopback Hub, with metrics.jsonl and completions.jsonl ending with it; with the
function fixed and --allow_changes, the next session resumes there, the change goes into the chain's record, and
its steps equal those of one straight run with the fixed function (which scores every other row as the failing one
did)."""

from __future__ import annotations

import json

import torch
from conftest import assert_clean_failure, hub_env, make_chat_llama, read_jsonl, run_cli
from hubserver import HubServer

from fsdp_opt.data.blocks import epoch_order

SEED, PROMPTS, STEPS = 5, 16, 8  # 2 prompts a step (4 completions: 2 ranks x a micro-batch of 2), one epoch
RULE = """
def overlap(completions, target, **kwargs):
    out = []
    for c, t in zip(completions, target):
        if t == "boom" and BROKEN:
            raise ValueError("cannot score " + t)
        out.append(len(set(c) & set(t)) / 3.0)
    return out
"""


def test_a_failing_reward_keeps_the_last_step_and_the_fixed_one_resumes_there(tmp_path):
    policy = make_chat_llama(tmp_path / "policy", seed=0)
    # the row that fails is trained in step 3: the 5th of the epoch's order
    boom = int(epoch_order(SEED, 0, PROMPTS)[4])
    rows = [{"prompt": f"Say word {k}:", "target": "boom" if k == boom else f"w{k}"} for k in range(PROMPTS)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rule = tmp_path / "rule.py"
    common = [
        "--model", str(policy), "--dataset", str(data), "--method", "grpo", "--reward", f"{rule}:overlap",
        "--num_generations", "2", "--max_completion_length", "6", "--max_length", "64", "--batch_size", "2",
        "--accum_steps", "1", "--precision", "fp32", "--seed", str(SEED), "--save_every_steps", "100",
    ]  # fmt: skip
    with HubServer() as server:
        rule.write_text("BROKEN = True\n" + RULE)
        env = hub_env(tmp_path, server, "a")
        failed = run_cli(common + ["--output_dir", str(tmp_path / "a"), "--hf_repo", "me/r"], tmp_path, 2, env=env)
        last = assert_clean_failure(failed, "--reward ", f"row {boom}, place 0 of its group")
        assert "in step 3" in last and "-step-2.pt" in last, last
        saved = next((tmp_path / "a").glob("*-step-2.pt"))
        assert f"checkpoints/{saved.name}" in server.repos["me/r"].files
        assert [r["step"] for r in read_jsonl(tmp_path / "a" / "metrics.jsonl")] == [1, 2]
        written = read_jsonl(tmp_path / "a" / "completions.jsonl")
        assert {r["step"] for r in written} == {1, 2} and boom not in {r["row"] for r in written}
        payload = torch.load(saved, weights_only=True)
        assert payload["train_state"]["global_step"] == 2
        # fixed: the same rule for every other row, the failing one scored; taken with --allow_changes
        rule.write_text("BROKEN = False\n" + RULE)
        refused = run_cli(common + ["--output_dir", str(tmp_path / "b"), "--hf_repo", "me/r", "--start_idx", "auto",
                                    "--range_size", str(PROMPTS)], tmp_path, 2, env=hub_env(tmp_path, server, "b"))  # fmt: skip
        assert_clean_failure(refused, "--reward ", "--allow_changes")
        resumed = run_cli(
            common
            + ["--output_dir", str(tmp_path / "c"), "--hf_repo", "me/r", "--start_idx", "auto", "--range_size"]
            + [str(PROMPTS), "--allow_changes"],
            tmp_path,
            2,
            env=hub_env(tmp_path, server, "c"),
        )
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    straight = run_cli(common + ["--output_dir", str(tmp_path / "d")], tmp_path, 2)
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-3000:]
    keys = ("step", "loss", "grad_norm", "reward")
    one = [tuple(r[k] for k in keys) for r in read_jsonl(tmp_path / "d" / "metrics.jsonl")]
    assert len(one) == STEPS
    assert [tuple(r[k] for k in keys) for r in read_jsonl(tmp_path / "a" / "metrics.jsonl")] == one[:2]
    # the chain's metrics.jsonl, fetched from the repo: the failed session's two steps, then this one's
    assert [tuple(r[k] for k in keys) for r in read_jsonl(tmp_path / "c" / "metrics.jsonl")] == one
    final = next((tmp_path / "c").glob("*-epoch-1.pt"))
    changes = torch.load(final, weights_only=True)["settings_changes"]
    taken = [c for c in changes if c["flag"] == "reward"]  # (and --range_size, a choice the auto chain adds)
    assert len(taken) == 1 and taken[0]["step"] == 2 and taken[0]["breaks"] == "another loss trains"


def test_a_reward_that_cannot_run_fails_on_the_first_generation_before_any_update(tmp_path):
    """Every reward function is called on the first generation, before the first update: one that cannot run at all
    ends the session there, in one line, with no checkpoint and no step recorded."""
    policy = make_chat_llama(tmp_path / "policy", seed=0)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say word {k}:", "target": f"w{k}"}) + "\n" for k in range(8)))
    rule = tmp_path / "rule.py"
    rule.write_text("def overlap(completions, **kwargs):\n    raise KeyError('no column named answer')\n")
    flags = [
        "--model", str(policy), "--dataset", str(data), "--method", "grpo", "--reward", f"{rule}:overlap",
        "--num_generations", "2", "--max_completion_length", "4", "--max_length", "64", "--batch_size", "2",
        "--precision", "fp32", "--output_dir", str(tmp_path / "out"), "--wandb_mode", "disabled",
    ]  # fmt: skip
    failed = run_cli(flags, tmp_path, 1)
    assert_clean_failure(failed, "--reward ", "place 0 of its group", "no column named answer")
    out = tmp_path / "out"
    assert not list(out.glob("*.pt"))  # (a folder never made globs nothing)
    assert not (out / "metrics.jsonl").exists() or read_jsonl(out / "metrics.jsonl") == []
