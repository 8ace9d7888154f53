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
from conftest import (
    ROOT,
    assert_clean_failure,
    hub_sessions,
    launch,
    make_chat_llama,
    read_jsonl,
    run_cli,
    run_cli_concurrently,
    saved_names,
)
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


def variety(completions, **kwargs):
    """Distinct characters, in tens: two random completions rarely tie."""
    return [len(set(c)) / 10.0 for c in completions]
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


def greedy_alone(model, tok, prompt: str) -> list[int]:  # noqa: ANN001
    """transformers' greedy `generate` of one prompt alone, up to and including its first EOS."""
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        made = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=LENGTH,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, ids.shape[1] :].tolist()  # fmt: skip
    return made[: made.index(tok.eos_token_id) + 1] if tok.eos_token_id in made else made


def test_greedy_completions_are_transformers_generate_and_the_first_loss_is_the_jsonl_recomputed(tmp_path, setup_files):
    """--top_k 1: every completion in completions.jsonl is what transformers' generate (greedy) makes from the same
    model for its prompt alone. Sampled, with a KL term to another model: the first step's loss is the one computed
    from completions.jsonl with plain transformers, each completion alone (rho is 1 in value)."""
    f = setup_files
    base = ["--model", str(f["policy"]), "--dataset", str(f["data"]), "--method", "grpo", "--reward",
            f"{f['rewards']}:overlap", "--num_generations", "2", "--max_completion_length", str(LENGTH), "--max_length",
            "64", "--batch_size", "4", "--accum_steps", "2", "--end_idx", str(PROMPTS), "--precision", "fp32",
            "--wandb_mode", "disabled", "--seed", "3", "--save_optimizer", "false"]  # fmt: skip
    runs = {"greedy": ["--top_k", "1"], "sampled": ["--beta", "0.04", "--ref_model", str(f["ref"]), "--temperature", "1.3"]}
    for name, extra in runs.items():
        (tmp_path / name).mkdir()
        proc = run_cli(base + extra + ["--output_dir", str(tmp_path / name / "out")], tmp_path / name, nproc=2)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(f["policy"])
    policy = AutoModelForCausalLM.from_pretrained(f["policy"], dtype=torch.float32).eval()
    by_row = {k: r for k, r in enumerate(rows())}
    greedy = read_jsonl(tmp_path / "greedy" / "out" / "completions.jsonl")
    assert len(greedy) == 2 * PROMPTS
    for line in greedy:
        made = greedy_alone(policy, tok, by_row[line["row"]]["prompt"])
        assert line["completion_ids"] == made, (line["row"], line["completion_ids"], made)

    # the first step, recomputed from what completions.jsonl says it trained on
    lines = [l for l in read_jsonl(tmp_path / "sampled" / "out" / "completions.jsonl") if l["step"] == 1]
    reference = AutoModelForCausalLM.from_pretrained(f["ref"], dtype=torch.float32).eval()
    rewards: dict[int, list[float]] = {}
    for l in lines:
        rewards.setdefault(l["row"], []).append(math.nan if l["reward"] is None else l["reward"])
    total, tokens = 0.0, 0
    for l in lines:
        group = torch.tensor(rewards[l["row"]])
        std = torch.tensor(float(group[~torch.isnan(group)].std())) if (~torch.isnan(group)).sum() > 1 else torch.tensor(math.nan)
        adv = float(torch.nan_to_num((torch.tensor(math.nan if l["reward"] is None else l["reward"]) -
                                      torch.nanmean(group)) / (std + 1e-4), nan=0.0))  # fmt: skip
        prompt = tok(by_row[l["row"]]["prompt"])["input_ids"]
        ids = torch.tensor([prompt + l["completion_ids"]])
        with torch.no_grad():
            logps = [torch.log_softmax(m(input_ids=ids).logits[0, :-1].float() / 1.3, -1)
                     .gather(1, ids[0, 1:, None])[len(prompt) - 1 :, 0] for m in (policy, reference)]  # fmt: skip
        d = logps[1] - logps[0]
        total += float((-adv + 0.04 * (torch.exp(d) - d - 1)).sum())
        tokens += len(l["completion_ids"])
        assert abs(l["advantage"] - adv) <= 1e-4, (l["advantage"], adv)
    first = read_jsonl(tmp_path / "sampled" / "out" / "metrics.jsonl")[0]
    assert first["completions"] == len(lines) == 16 and first["tokens"] == tokens  # batch 4 x 2 ranks x accum 2
    print(f"first step's loss {first['loss']:.8f}, from completions.jsonl {total / tokens:.8f}")
    assert abs(first["loss"] - total / tokens) <= 1e-5, (first["loss"], total / tokens)
    assert first["kl"] is not None and first["kl"] > 0


def test_generation_and_the_update_in_fp16_as_on_a_t4(tmp_path, setup_files):
    """--precision fp16 (a T4's compute dtype; CPU runs it too): the gathered model generates in fp16 and the steps
    train with the loss scaled. Sampled: every completion is within --max_completion_length and ends at its first
    EOS, the losses are finite, the weights move. Greedy (--top_k 1): the completions are, but for a near tie that
    fp16's rounding may flip, the ones transformers' generate makes from the model in fp32."""
    f = setup_files
    base = ["--model", str(f["policy"]), "--dataset", str(f["data"]), "--method", "grpo", "--reward",
            f"{f['rewards']}:variety", "--num_generations", "2", "--max_completion_length", str(LENGTH), "--max_length",
            "64", "--batch_size", "4", "--end_idx", str(PROMPTS), "--precision", "fp16", "--wandb_mode", "disabled",
            "--seed", "6", "--lr", "1e-2", "--save_optimizer", "false"]  # fmt: skip
    runs = []
    for name, extra in (("sampled", []), ("greedy", ["--top_k", "1"])):
        (tmp_path / name).mkdir()
        runs.append((base + extra + ["--output_dir", str(tmp_path / name / "out")], tmp_path / name, None))
    for proc in run_cli_concurrently(runs, timeout=300, nproc=2):
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert "fp16 compute" in proc.stdout and "generation on the model gathered once" in proc.stdout
    out = tmp_path / "sampled" / "out"
    steps = read_jsonl(out / "metrics.jsonl")
    assert len(steps) == 2 and all(math.isfinite(s["loss"]) and s["loss_scale"] > 1 for s in steps), steps
    assert all(not s["skipped"] and s["grad_norm"] > 0 for s in steps), steps  # the rewards differ within groups
    tok = AutoTokenizer.from_pretrained(f["policy"])
    lines = read_jsonl(out / "completions.jsonl")
    assert len(lines) == 2 * PROMPTS
    for line in lines:
        ids = line["completion_ids"]
        assert 0 < len(ids) <= LENGTH and tok.eos_token_id not in ids[:-1], ids
    policy = AutoModelForCausalLM.from_pretrained(f["policy"], dtype=torch.float32).eval()
    (saved,) = out.glob("*-epoch-1.pt")
    trained = torch.load(saved, weights_only=True)["MODEL_STATE"]
    assert any(not torch.equal(trained[k].float(), v) for k, v in policy.state_dict().items() if k in trained)

    by_row = dict(enumerate(rows()))
    same = 0
    first = [l for l in read_jsonl(tmp_path / "greedy" / "out" / "completions.jsonl") if l["step"] == 1]
    for line in first:
        same += line["completion_ids"] == greedy_alone(policy, tok, by_row[line["row"]]["prompt"])
    print(f"fp16 greedy completions equal to fp32 generate: {same} of {len(first)}")
    assert len(first) == 8 and same >= 6, same


def _steps(out: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["reward"], r["tokens"], r["slice"]) for r in read_jsonl(out / "metrics.jsonl")]


def _drawn(out: Path) -> list[tuple]:
    return [(l["step"], l["row"], tuple(l["completion_ids"]), l["reward"], l["advantage"])
            for l in read_jsonl(out / "completions.jsonl")]  # fmt: skip


def test_a_session_resumed_mid_range_draws_and_trains_what_the_straight_run_did(tmp_path, setup_files):
    """Rows [0, 8), four steps, a checkpoint after each: a second session resumed from the one after step 2 samples
    the same completions, gets the same rewards and the same losses for steps 3 and 4, bit for bit (CPU, fp32)."""
    f = setup_files
    args = ["--model", str(f["policy"]), "--dataset", str(f["data"]), "--method", "grpo", "--reward",
            f"{f['rewards']}:overlap", "--num_generations", "2", "--max_completion_length", str(LENGTH), "--max_length",
            "64", "--batch_size", "2", "--end_idx", str(PROMPTS), "--precision", "fp32", "--wandb_mode", "disabled",
            "--seed", "5", "--lr", "1e-2"]  # fmt: skip
    straight = run_cli(args + ["--save_every_steps", "1", "--keep_last", "0", "--output_dir", str(tmp_path / "a")],
                       tmp_path, nproc=2)  # fmt: skip
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-3000:]
    (tmp_path / "b").mkdir()
    (mid,) = (tmp_path / "a").glob("*-step-2.pt")
    (tmp_path / "b" / mid.name).write_bytes(mid.read_bytes())
    resumed = run_cli(args + ["--resume_file", mid.name, "--output_dir", str(tmp_path / "b")], tmp_path, nproc=2)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    want = [s for s in _steps(tmp_path / "a") if s[0] > 2]
    assert _steps(tmp_path / "b") == want and len(want) == 2
    assert _drawn(tmp_path / "b") == [d for d in _drawn(tmp_path / "a") if d[0] > 2]


def test_three_auto_sessions_through_the_hub_equal_one_straight_run(tmp_path, setup_files):
    """--start_idx auto, three sessions on empty machines through the loopback Hub: the same completions, rewards and
    losses as one session that trains the three ranges."""
    f = setup_files
    auto = ["--model", str(f["policy"]), "--dataset", str(f["data"]), "--method", "grpo", "--reward",
            f"{f['rewards']}:overlap", "--num_generations", "2", "--max_completion_length", str(LENGTH), "--max_length",
            "64", "--batch_size", "2", "--precision", "fp32", "--wandb_mode", "disabled", "--seed", "9",
            "--start_idx", "auto", "--range_size", "2", "--lr", "1e-2"]  # fmt: skip
    saved = [name for proc in hub_sessions(auto, tmp_path, "me/grpo") for name in saved_names(proc.stdout)]
    one = run_cli(auto + ["--session_ranges", "3", "--output_dir", str(tmp_path / "one")], tmp_path, nproc=2)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-3000:]
    assert saved == saved_names(one.stdout) == [f"policy_{a}-{a + 2}-epoch-1.pt" for a in (0, 2, 4)]
    assert _steps(tmp_path / "m2" / "out") == _steps(tmp_path / "one")
    drawn = [d for i in range(3) for d in _drawn(tmp_path / f"m{i}" / "out")]
    assert drawn == _drawn(tmp_path / "one") and len(drawn) == 3 * 2 * 2


BAD_REWARDS = '''
def boom(completions, **kwargs):
    raise ValueError("no rule for this one")


def too_few(completions, **kwargs):
    return [1.0]


def not_a_number(completions, **kwargs):
    return ["high"] * len(completions)
'''


def test_bad_grpo_input_is_one_line_and_writes_no_checkpoint(tmp_path, setup_files):
    f = setup_files
    bad = tmp_path / "bad.py"
    bad.write_text(BAD_REWARDS)
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"row {i} of text"}) + "\n" for i in range(8)))
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n" for _ in range(8)))
    base = ["--model", str(f["policy"]), "--method", "grpo", "--num_generations", "2", "--max_completion_length", "8",
            "--max_length", "64", "--batch_size", "2", "--end_idx", "8", "--precision", "fp32", "--wandb_mode", "disabled"]  # fmt: skip
    data = ["--dataset", str(f["data"])]
    cases = [
        (["--dataset", str(text), "--reward", "length"], ["--method grpo", "the rows are text", "--prompt_column"]),
        (["--dataset", str(prefs), "--reward", "length"], ["--method grpo", "preference pairs", "--prompt_column"]),
        (data + ["--reward", "nope"], ["--reward nope", "not a built-in"]),
        (data + ["--reward", f"{tmp_path / 'missing.py'}:f"], ["--reward", "no such file"]),
        (data + ["--reward", f"{bad}:absent"], ["--reward", "has no function absent"]),
        (data + ["--reward", f"{bad}:boom"], ["--reward", "boom: it raised on row", "no rule for this one"]),
        (data + ["--reward", f"{bad}:too_few"], ["--reward", "returned 1 reward(s) for"]),
        (data + ["--reward", f"{bad}:not_a_number"], ["--reward", "returned 'high' for row"]),
        (data + ["--reward", "length", "--num_generations", "1"], ["--num_generations 1", "2 or more"]),
        (data + ["--reward", "length", "--num_generations", "3"], ["--num_generations 3", "not a whole number of groups"]),
        (data + ["--reward", "length", "--max_completion_length", "64"], ["--max_completion_length 64", "below --max_length"]),
        (data + ["--reward", "length", "--reward_weights", "1,2"], ["--reward_weights 1,2", "2 weight(s) for 1"]),
        (data + ["--reward", "length", "--loss_type", "ppo"], ["--loss_type", "ppo"]),
    ]  # fmt: skip
    runs = []
    for i, (extra, _) in enumerate(cases):
        (tmp_path / f"c{i}").mkdir()
        runs.append((base + extra + ["--output_dir", str(tmp_path / f"c{i}" / "out")], tmp_path / f"c{i}", None))
    for (extra, needles), proc, (_, folder, _) in zip(cases, run_cli_concurrently(runs, timeout=180, nproc=2), runs):
        assert_clean_failure(proc, *needles)
        assert not list(folder.glob("**/*.pt")), extra


def test_lora_grpo_with_a_kl_term_references_the_base_with_the_adapters_off(tmp_path, setup_files):
    """LoRA (16-bit base, and the NF4 base) with beta > 0 and no --ref_model: the reference is the base with the
    adapters switched off. The adapters start at zero, so the first step's KL is 0; once they have moved it is not
    (on 2 ranks, FULL_SHARD: the NF4 base sharded, gathered for generation)."""
    f = setup_files
    # wide enough that each linear weight splits into 2 NF4 shards (multiples of 64 x 256 weights)
    wide = make_chat_llama(tmp_path / "wide", seed=2, hidden_size=256, intermediate_size=512)
    base = ["--model", str(wide), "--dataset", str(f["data"]), "--method", "grpo", "--reward",
            f"{f['rewards']}:variety", "--num_generations", "2", "--max_completion_length", str(LENGTH), "--max_length",
            "64", "--batch_size", "2", "--end_idx", str(PROMPTS), "--precision", "fp32", "--wandb_mode", "disabled",
            "--seed", "4", "--lr", "5e-2", "--lora_rank", "8", "--beta", "0.04", "--save_optimizer", "false"]  # fmt: skip
    runs = []
    for name, extra in (("fp16base", []), ("nf4", ["--base_bits", "4"])):
        (tmp_path / name).mkdir()
        runs.append((base + extra + ["--output_dir", str(tmp_path / name / "out")], tmp_path / name, None))
    for proc, (_, folder, _) in zip(run_cli_concurrently(runs, timeout=300, nproc=2), runs):
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert "reference: the base with the adapters switched off" in proc.stdout
        kl = [r["kl"] for r in read_jsonl(folder / "out" / "metrics.jsonl")]
        assert len(kl) == 4 and abs(kl[0]) <= 1e-7 and all(k > 1e-6 for k in kl[1:]), (folder.name, kl)
