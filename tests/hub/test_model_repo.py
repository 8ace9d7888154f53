"""The end of a chain as a model repo: a LoRA chain of two ranges on a tiny Llama through the loopback Hub, then
`fsdp-opt export CHECKPOINT --push_to_hub user/name` (merged, through a commit the Hub refuses once with a 503): the
repo loads by name with the real transformers client, its logits are the trained model's (base weights plus the
adapters' update, computed here by hand), and its card lists the ranges with their figures, data pins and the
benchmark scores an index entry holds. A push the token cannot make ends in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from conftest import HF_TOK, assert_clean_failure, hub_env, launch, make_family_model, read_jsonl, run_cli
from hubserver import HubServer

SCORES = {"arc_easy": {"acc,none": 0.3125, "acc_stderr,none": 0.0412, "acc_norm,none": 0.29}}


def test_a_lora_chain_pushed_as_a_model_repo_loads_by_name(tmp_path):
    base = make_family_model(tmp_path / "base", "llama", bos=True, tie_word_embeddings=True)
    common = ["--model", str(base), "--dataset", "python-docs", "--max_length", "64", "--lr", "1e-2"]
    common += ["--num_epochs", "1", "--lora_rank", "4", "--batch_size", "4", "--hf_repo", "me/chain"]
    common += ["--wandb_mode", "disabled", "--eval_rows", "8"]
    with HubServer(token=HF_TOK) as server:
        for i, (start, end) in enumerate(((0, 16), (16, 32))):
            resume = ["--resume_file", "latest"] if i else []
            args = common + resume + ["--start_idx", str(start), "--end_idx", str(end), "--output_dir", f"s{i}"]
            proc = run_cli(args, tmp_path, env=hub_env(tmp_path, server, f"s{i}"))
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        # lm-eval's scores, as issue 72 puts them in an index entry (written here by hand)
        repo = server.repos["me/chain"]
        index = json.loads(repo.files["fsdp_opt_index.json"])
        name = max(index["checkpoints"], key=lambda n: index["checkpoints"][n]["global_step"])
        index["checkpoints"][name]["benchmarks"] = SCORES
        env = hub_env(tmp_path, server, "export")
        edit = (
            "import sys; from huggingface_hub import HfApi, CommitOperationAdd as Add; "
            "HfApi().create_commit('me/chain', [Add('fsdp_opt_index.json', sys.stdin.buffer.read())], commit_message='scores')"
        )
        subprocess.run([sys.executable, "-c", edit], input=json.dumps(index).encode(), env=env, check=True, timeout=120)

        checkpoint = tmp_path / "s1" / name
        server.fail("commit", 1, 503)
        proc = launch(
            ["-m", "fsdp_opt.export"],
            [str(checkpoint), "--push_to_hub", "me/model", "--dtype", "fp32"],
            tmp_path,
            env=env,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert "retry 1/5" in proc.stdout and server.count("commit", 503) == 1
        model_repo = server.repos["me/model"]
        assert {"config.json", "tokenizer.json", "generation_config.json", "README.md"} <= set(model_repo.files)
        assert any(f.endswith(".safetensors") for f in model_repo.files)
        card = model_repo.files["README.md"].decode()
        ids = [[0, 17, 250, 1034, 77, 3000, 12, 5, 901, 44, 2]]
        load = (
            "import json, sys, torch; from transformers import AutoModelForCausalLM as M; "
            "m = M.from_pretrained('me/model').eval(); "
            f"print(json.dumps(m(input_ids=torch.tensor({ids})).logits.tolist()))"
        )
        got = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=300)
        assert got.returncode == 0, got.stderr[-3000:]
        # the private repo needs the token: no token, no model
        anonymous = {k: v for k, v in env.items() if k != "HF_TOKEN"}
        denied = subprocess.run(
            [sys.executable, "-c", load], env=anonymous, capture_output=True, text=True, timeout=300
        )
        assert denied.returncode != 0
        assert not any(HF_TOK in b.decode(errors="replace") for b in server.commit_bodies)
    assert HF_TOK not in proc.stdout + proc.stderr

    # The trained model, by hand: each adapted weight plus (alpha / r) * B @ A from the checkpoint.
    from transformers import AutoModelForCausalLM

    payload = torch.load(checkpoint, weights_only=True)
    lora = payload["lora"]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    state = payload["MODEL_STATE"]
    with torch.no_grad():
        for key in (k for k in state if ".lora_A." in k):
            layer = key.split(".lora_A.")[0]
            delta = state[key.replace("lora_A", "lora_B")] @ state[key]
            params[f"{layer}.weight"] += lora["alpha"] / lora["rank"] * delta
        want = model(input_ids=torch.tensor(ids)).logits
    assert (
        want - AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=torch.tensor(ids)).logits
    ).abs().max() > 1e-3
    torch.testing.assert_close(
        torch.tensor(json.loads(got.stdout.strip().splitlines()[-1])), want, atol=2e-5, rtol=1e-5
    )

    # The card: metadata the Hub reads, both ranges with their losses, held-out figures and pins, the scores, W&B, commands.
    meta = card.split("---")[1]
    assert "library_name: transformers" in meta and f"base_model: {base}" not in meta  # a local base: no Hub id
    assert "- fsdp-opt" in meta and "- lora" in meta and "- sft" in meta
    rows = [line for line in card.splitlines() if line.startswith("| [")]
    ranges = [r for r in rows if r.count("|") == 8]
    assert [r.split("|")[1].strip() for r in ranges] == ["[0, 16)", "[16, 32)"]
    for r, out in zip(ranges, ("s0", "s1")):
        last = read_jsonl(tmp_path / out / "metrics.jsonl")[-1]
        held_out = read_jsonl(tmp_path / out / "eval.jsonl")[-1]
        assert f"| {last['loss']:.4f} | {held_out['loss']:.4f} | rows `" in r, (r, last, held_out)
    assert "| [16, 32) | arc_easy | acc (none) | 0.3125 ± 0.0412 |" in card
    assert "| [16, 32) | arc_easy | acc_norm (none) | 0.2900 |" in card
    assert "method **sft**" in card and "LoRA rank 4 (merged into the base)" in card
    assert "fsdp-opt export" in card and "--push_to_hub me/model" in card and "--lora_rank 4" in card


def test_a_push_the_token_cannot_make_ends_in_one_line(tmp_path):
    """A token the Hub refuses: one line naming the flag, exit 2, no traceback, the token nowhere."""
    base = make_family_model(tmp_path / "base", "qwen2", bos=False)
    with HubServer(token=HF_TOK) as server:
        env = hub_env(tmp_path, server, "bad")
        env["HF_TOKEN"] = "hf_not-the-right-token-000000000000000"
        proc = launch(["-m", "fsdp_opt.export"], [str(base), "--push_to_hub", "me/model"], tmp_path, env=env)
        assert not server.repos
    line = assert_clean_failure(proc, "--push_to_hub me/model", "refused")
    assert env["HF_TOKEN"] not in proc.stdout + proc.stderr and "\n" not in line.strip()
