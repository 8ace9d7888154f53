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
    as_flags,
    assert_clean_failure,
    assert_same_step,
    hub_sessions,
    launch,
    make_chat_llama,
    read_jsonl,
    run_cli,
    run_cli_concurrently,
    saved_names,
)
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

G = 4  # completions per prompt
PROMPTS = 8
LENGTH = 8  # --max_completion_length
WORDS = [
    "alpha",
    "lambda",
    "red",
    "list",
    "dict",
    "set",
    "tuple",
    "file",
    "line",
    "name",
    "type",
    "class",
]  # one token each
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


def same(completions, **kwargs):
    """Every completion the same reward: every advantage 0."""
    return [1.0] * len(completions)


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
            completions[f"{r}:{g}"] = (
                ids + [tok.eos_token_id] if stops else ids + [draw.randrange(3, 4096)] * (LENGTH - n)
            )
            ended[f"{r}:{g}"] = stops
    given = root / "given.json"
    given.write_text(json.dumps({"completions": completions, "ended": ended}))
    return {"policy": policy, "ref": ref, "data": data, "rewards": root / "rewards.py", "given": given, "root": root}


def group_flags(f: dict, tmp_path: Path, method: str, *extra: str, rewards: tuple = ("overlap", "short")) -> list[str]:
    """A group method's flags on the module's prompts (`setup_files`): the reward functions of rewards.py given
    (overlap at 1.0 and short at 0.5 by default), G completions of up to LENGTH tokens, 2 micro-batches of 8, fp32."""
    weights = ["--reward_weights", "1.0,0.5"] if rewards == ("overlap", "short") else []
    return [
        *as_flags(model=f["policy"], dataset=f["data"], method=method),
        *as_flags(reward=",".join(f"{f['rewards']}:{r}" for r in rewards)),
        *weights,
        *as_flags(num_generations=G, max_completion_length=LENGTH, max_length=64, batch_size=8, accum_steps=2),
        *as_flags(precision="fp32", output_dir=tmp_path / "out", wandb_mode="disabled", seed=7),
        *extra,
    ]


def step_report(files: dict, tmp_path, flags: list[str]) -> dict:  # noqa: ANN001
    """Our step on 2 ranks over the given completions (tests/workers/grpo_step.py): its report, and where the weights
    it started from are (`weights`)."""
    out = tmp_path / "report.json"
    proc = launch([WORKER], [str(out), str(files["given"]), *flags], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    report["weights"] = str(out) + ".pt"
    return report


def trl_trainer(trainer_class, config_class, output_dir, report: dict, tok, model, **settings):  # noqa: ANN001, ANN201
    """TRL's trainer of a one-process step over the whole group batch (PROMPTS x G completions of LENGTH tokens), on
    the CPU in fp32 (TRL defaults to bf16 autocast), for a report's pass, with the method's own `settings`; the reward
    function is never called (the completions and their rewards are given)."""
    args = config_class(
        output_dir=str(output_dir),
        per_device_train_batch_size=PROMPTS * G,
        num_generations=G,
        max_completion_length=LENGTH,
        num_iterations=report["iteration"],
        report_to=[],
        use_cpu=True,
        bf16=False,
        **settings,
    )
    return trainer_class(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list(rows()),
        processing_class=tok,
    )


def trl_models(files: dict, report: dict, sampled_always: bool = False):  # noqa: ANN201
    """The tokenizer, the model TRL trains (a second pass's: the weights that pass started from, REPORT.pt) and the
    model the completions were sampled from (None where a first pass needs none apart)."""
    tok = AutoTokenizer.from_pretrained(files["policy"])
    model = AutoModelForCausalLM.from_pretrained(files["policy"], dtype=torch.float32)
    sampled = None
    if sampled_always or report["iteration"] > 1:
        sampled = AutoModelForCausalLM.from_pretrained(files["policy"], dtype=torch.float32).eval()
    if report["iteration"] > 1:
        model.load_state_dict(torch.load(report["weights"], weights_only=True))
    return tok, model, sampled


def given_completions(files: dict, tok, mask_truncated: bool = False) -> dict:  # noqa: ANN001
    """The injected completions as TRL's trainers take them, in (row, place) order: the (row, place) keys, the
    trainer's inputs (prompt and completion ids and masks, a never-ended completion masked as TRL masks it where
    asked) and the whole sequences with their mask and completion width, for per-token log-probabilities."""
    given = json.loads(files["given"].read_text())
    keys = [(r, g) for r in range(PROMPTS) for g in range(G)]
    prompt_ids = torch.tensor([tok(rows()[r]["prompt"])["input_ids"] for r, _ in keys])  # ours: with the BOS
    comp = [given["completions"][f"{r}:{g}"] for r, g in keys]
    width = max(map(len, comp))
    completion_ids = torch.tensor([c + [tok.pad_token_id] * (width - len(c)) for c in comp])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in comp])
    if mask_truncated:
        truncated = torch.tensor([not given["ended"][f"{r}:{g}"] for r, g in keys])
        completion_mask = completion_mask * (~truncated).unsqueeze(1).int()
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([torch.ones_like(prompt_ids), completion_mask], dim=1)
    return {"keys": keys, "inputs": inputs, "ids": ids, "mask": mask, "width": width}


def per_token_logps(trainer, other, given: dict) -> torch.Tensor:  # noqa: ANN001
    """TRL's per-token log-probabilities of the given completions under another model (a path, or a model), prepared
    as TRL prepares its reference model."""
    from trl.trainer.utils import add_fused_lm_head

    if not isinstance(other, torch.nn.Module):
        other = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    add_fused_lm_head(other, temperature=1.0)
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(other, given["ids"], given["mask"], given["width"])[0]


def trl_advantages(records: list[dict], scale: str) -> torch.Tensor:
    """The advantages by TRL 1.16's rule (sum_then_normalize, NaN-aware: an unscorable completion's is 0), from the
    rewards our run recorded, in (row, place) order."""
    from trl.trainer.utils import nanstd

    by_key = {(r["row"], r["place"]): r for r in records}
    reward = torch.tensor(
        [
            math.nan if by_key[(r, g)]["reward"] is None else by_key[(r, g)]["reward"]
            for r in range(PROMPTS)
            for g in range(G)
        ]
    )
    grouped = reward.view(-1, G)
    adv = reward - torch.nanmean(grouped, dim=1).repeat_interleave(G)
    if scale == "group":
        adv = adv / (nanstd(grouped, dim=1).repeat_interleave(G) + 1e-4)
    elif scale == "batch":
        adv = adv / (nanstd(reward) + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


def trl_step(
    files: dict[str, Path],
    report: dict,
    *,
    loss_type: str = "dapo",
    beta: float = 0.0,
    scale: str = "group",
    mask_truncated: bool = False,
    level: str = "token",
    delta: float | None = None,
    epsilon: float = 0.2,
    bias_kl: bool = True,
) -> tuple[float, dict, torch.Tensor]:
    """TRL's GRPOTrainer loss of the same prompts, completions and rewards (the advantages by TRL's rule from the
    rewards our run recorded), on one process: the loss and each parameter's gradient. A report of a second pass
    (--num_iterations 2) is held against TRL's loss of the weights that pass started from (REPORT.pt), with the old
    log-probabilities of the model the completions were sampled from. --loss_type bnpo runs TRL once per micro-batch
    of ours (each rank's, with TRL's accumulation over them) and averages over the ranks, as DDP would."""
    from trl import GRPOConfig, GRPOTrainer

    tok, model, sampled = trl_models(files, report)
    trainer = trl_trainer(
        GRPOTrainer,
        GRPOConfig,
        files["root"] / "trl",
        report,
        tok,
        model,
        beta=beta,
        loss_type=loss_type,
        importance_sampling_level=level,
        delta=delta,
        epsilon=epsilon,
        use_bias_correction_kl=bias_kl,
        scale_rewards=scale,
        mask_truncated_completions=mask_truncated,
    )
    given = given_completions(files, tok, mask_truncated)
    keys, advantages = given["keys"], trl_advantages(report["records"], scale)
    extra = {}
    for key, other in (("ref_per_token_logps", files["ref"] if beta else None), ("old_per_token_logps", sampled)):
        if other is not None:
            extra[key] = per_token_logps(trainer, other, given)
    model.train()
    everything = {
        **given["inputs"],
        "advantages": advantages,
        "num_items_in_batch": given["inputs"]["completion_mask"].sum(),
        **extra,
    }
    if loss_type != "bnpo":
        trainer.current_gradient_accumulation_steps = 1
        loss = trainer._compute_loss(model, everything)
        loss.backward()
        total = float(loss)
    else:  # each rank's micro-batches in turn, accumulated as TRL accumulates them, then DDP's mean over the ranks
        ranks = report["micro"]
        trainer.current_gradient_accumulation_steps = len(ranks[0])
        total = 0.0
        for micro in (m for rank in ranks for m in rank):
            pick = torch.tensor([keys.index((r, g)) for r, g in micro])
            part = {k: v[pick] if k != "num_items_in_batch" else v for k, v in everything.items()}
            loss = trainer._compute_loss(model, part)
            loss.backward()
            total += float(loss) / len(ranks)
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= len(ranks)
    return total, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, advantages


GRPO_CASES = {  # (flags beyond the common ones, TRL's settings): loss types, reward scales, masks, a second pass
    "dapo-pad": (["--packing", "pad"], {}),
    "grpo-docs": (["--loss_type", "grpo", "--packing", "docs"], {"loss_type": "grpo"}),
    "dapo-kl-docs": (["--beta", "0.04", "--packing", "docs"], {"beta": 0.04}),
    "grpo-kl-pad": (["--loss_type", "grpo", "--beta", "0.04", "--packing", "pad"], {"loss_type": "grpo", "beta": 0.04}),
    "dr_grpo-batch-masked": (
        [
            "--loss_type",
            "dr_grpo",
            "--scale_rewards",
            "batch",
            "--mask_truncated_completions",
            "true",
            "--packing",
            "docs",
        ],
        {"loss_type": "dr_grpo", "scale": "batch", "mask_truncated": True},
    ),
    "bnpo-none": (
        ["--loss_type", "bnpo", "--scale_rewards", "none", "--packing", "pad"],
        {"loss_type": "bnpo", "scale": "none"},
    ),
    # the second pass over a generation: the policy has moved (a large step), the ratio is off 1 and the clip binds
    "second-token-delta-kl": (
        [
            "--num_iterations",
            "2",
            "--lr",
            "2e-2",
            "--epsilon",
            "0.1",
            "--delta",
            "1.3",
            "--beta",
            "0.04",
            "--packing",
            "pad",
        ],
        {"epsilon": 0.1, "delta": 1.3, "beta": 0.04},
    ),
    "second-sequence": (
        [
            "--num_iterations",
            "2",
            "--lr",
            "2e-2",
            "--epsilon",
            "0.02",
            "--importance_sampling_level",
            "sequence",
            "--loss_type",
            "grpo",
            "--packing",
            "docs",
        ],
        {"epsilon": 0.02, "level": "sequence", "loss_type": "grpo"},
    ),
}


@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_a_step_is_trls_loss_and_gradient_on_the_same_completions(tmp_path, setup_files, case):
    f = setup_files
    extra, trl_settings = GRPO_CASES[case]
    flags = group_flags(f, tmp_path, "grpo", *extra)
    if "--beta" in extra:
        flags += ["--ref_model", str(f["ref"])]
    ours = step_report(f, tmp_path, flags)
    if "pad" in extra:
        assert ours["micro_batches"] == 2  # 16 completions a rank, 8 rows a micro-batch
    loss, grads, advantages = trl_step(f, ours, **trl_settings)
    records = sorted(ours["records"], key=lambda r: (r["row"], r["place"]))
    assert [round(r["advantage"], 5) for r in records] == [round(float(a), 5) for a in advantages]
    assert any(r["reward"] is None for r in records) and all(
        r["advantage"] == 0 for r in records if r["reward"] is None
    )
    if ours["iteration"] > 1:
        low, high, region, count = ours["clips"]
        print(f"{case}: clipped low {low:g}, high {high:g}, of {count:g}")
        assert 0 < region < count  # the clip binds on some tokens (completions), not all
    print(f"{case}: ours {ours['loss']:.8f}, TRL {loss:.8f}")
    assert_same_step(ours, loss, grads, floor=1e-3)


def test_the_kl_terms_factor_rho_shows_where_every_advantage_is_zero(tmp_path, setup_files):
    """Every reward the same (A = 0) and beta 1: the loss is the KL term alone, beta rho k3. rho is 1 in value, but
    its gradient is grad logp: the step's gradients equal TRL's with use_bias_correction_kl=True (set, not its
    default), within a relative 1e-5, and not TRL's with it False (k3 alone)."""
    f = setup_files
    flags = group_flags(f, tmp_path, "grpo", "--beta", "1.0", "--ref_model", str(f["ref"]), rewards=("same",))
    out = tmp_path / "report.json"
    proc = launch([WORKER], [str(out), str(f["given"]), *flags], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ours = json.loads(out.read_text())
    assert all(r["advantage"] == 0 for r in ours["records"])
    relative = {}
    for bias in (True, False):
        loss, grads, _ = trl_step(f, ours, beta=1.0, bias_kl=bias)
        scale = max(g.abs().max().item() for g in grads.values())
        relative[bias] = max((torch.tensor(ours["grads"][n]) - g).abs().max().item() for n, g in grads.items()) / scale
        print(
            f"use_bias_correction_kl={bias}: ours {ours['loss']:.8f}, TRL {loss:.8f}, gradients {relative[bias]:.2e} "
            "apart (relative)"
        )
        assert abs(ours["loss"] - loss) <= 1e-5 * abs(loss), (ours["loss"], loss)  # rho is 1: the same value
    assert relative[True] <= 1e-5 and relative[False] > 1e-2, relative


def greedy_alone(model, tok, prompt: str | list[dict]) -> list[int]:  # noqa: ANN001
    """transformers' greedy `generate` of one prompt alone, up to and including its first EOS: a string with the
    tokenizer's special tokens, messages through the chat template with its generation prompt."""
    if isinstance(prompt, str):
        ids = tok(prompt)["input_ids"]
    else:
        ids = tok(
            tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )["input_ids"]
    ids = torch.tensor([ids])
    with torch.no_grad():
        made = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=LENGTH,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )[0, ids.shape[1] :].tolist()
    return made[: made.index(tok.eos_token_id) + 1] if tok.eos_token_id in made else made


def varied_prompts(chat: bool) -> list[dict]:
    """Prompts of different lengths (left-padded beside each other when decoded as one batch)."""
    asks = [f"Say {' and '.join(WORDS[k : k + 1 + k % 4])} twice:" for k in range(PROMPTS)]
    return [{"prompt": [{"role": "user", "content": a}] if chat else a, "target": WORDS[k]} for k, a in enumerate(asks)]


def test_greedy_completions_are_transformers_generate_and_the_first_loss_is_the_jsonl_recomputed(tmp_path, setup_files):
    """--top_k 1, prompts of different lengths, as strings and as messages: every completion in completions.jsonl is
    what transformers' generate (greedy) makes from the same model for its prompt alone (the static-cache path decodes
    all of a rank's completions as one left-padded batch). Sampled, with two weighted reward functions and a KL term
    to another model: the rewards are the functions' own, called again here on the decoded completions, and the first
    step's loss is the one computed from completions.jsonl with plain transformers, each completion alone (rho is 1
    in value)."""
    f = setup_files
    # larger weights than the fixture's policy: its greedy completions depend on the prompt (the fixture's are one
    # token repeated whatever it is asked)
    sharp = make_chat_llama(tmp_path / "sharp", seed=4, initializer_range=0.1)
    base = [
        "--model",
        str(sharp),
        "--method",
        "grpo",
        "--num_generations",
        "2",
        "--max_completion_length",
        str(LENGTH),
        "--max_length",
        "128",
        "--batch_size",
        "4",
        "--accum_steps",
        "2",
        "--end_idx",
        str(PROMPTS),
        "--precision",
        "fp32",
        "--wandb_mode",
        "disabled",
        "--seed",
        "3",
        "--save_optimizer",
        "false",
    ]
    data = {}
    for kind in ("strings", "chat"):
        data[kind] = tmp_path / f"{kind}.jsonl"
        data[kind].write_text("".join(json.dumps(r) + "\n" for r in varied_prompts(kind == "chat")))
    greedy = ["--top_k", "1", "--reward", "length"]
    runs = {
        "strings": ["--dataset", str(data["strings"]), *greedy],
        "chat": ["--dataset", str(data["chat"]), *greedy],
        "sampled": [
            "--dataset",
            str(f["data"]),
            "--reward",
            f"{f['rewards']}:overlap,{f['rewards']}:short",
            "--reward_weights",
            "1,0.5",
            "--beta",
            "0.04",
            "--ref_model",
            str(f["ref"]),
            "--temperature",
            "1.3",
        ],
    }
    launched = []
    for name, extra in runs.items():
        (tmp_path / name).mkdir()
        launched.append((base + extra + ["--output_dir", str(tmp_path / name / "out")], tmp_path / name, None))
    for proc in run_cli_concurrently(launched, nproc=2):
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert "decoded with a static KV cache" in proc.stdout
    tok = AutoTokenizer.from_pretrained(sharp)
    policy = AutoModelForCausalLM.from_pretrained(sharp, dtype=torch.float32).eval()
    for kind in ("strings", "chat"):
        by_row = dict(enumerate(varied_prompts(kind == "chat")))
        lines = read_jsonl(tmp_path / kind / "out" / "completions.jsonl")
        assert len(lines) == 2 * PROMPTS
        lengths = {len(tok(l["prompt"], add_special_tokens=False)["input_ids"]) for l in lines}
        assert len(lengths) >= 3, lengths  # the batch was left-padded
        assert len({tuple(l["completion_ids"]) for l in lines}) >= 4  # not one completion for every prompt
        for line in lines:
            made = greedy_alone(policy, tok, by_row[line["row"]]["prompt"])
            assert line["completion_ids"] == made, (kind, line["row"], line["completion_ids"], made)

    # the rewards, recomputed apart from the run: the user's functions called on the decoded completions
    namespace: dict = {}
    exec(REWARDS, namespace)  # noqa: S102 - the test's own reward functions, as the run loaded them from the file
    by_row = dict(enumerate(rows()))
    for l in read_jsonl(tmp_path / "sampled" / "out" / "completions.jsonl"):
        text = tok.decode(l["completion_ids"], skip_special_tokens=True)
        target = [by_row[l["row"]]["target"]]
        want = {
            "overlap": namespace["overlap"]([text], target)[0],
            "short": namespace["short"]([text], [l["completion_ids"]], target)[0],
        }
        assert l["completion"] == text and l["rewards"].keys() == want.keys(), (l["completion"], text, l["rewards"])
        for name, value in want.items():  # the run keeps rewards in float32, as TRL does
            got = l["rewards"][name]
            assert (got is None) == (value is None) and (value is None or abs(got - value) <= 1e-6), (name, got, value)
        weighted = [w * v for w, v in ((1.0, want["overlap"]), (0.5, want["short"])) if v is not None]
        assert (l["reward"] is None) == (not weighted), (l["reward"], weighted)
        assert not weighted or abs(l["reward"] - sum(weighted)) <= 1e-6, (l["reward"], weighted)

    # the first step, recomputed from what completions.jsonl says it trained on
    lines = [l for l in read_jsonl(tmp_path / "sampled" / "out" / "completions.jsonl") if l["step"] == 1]
    reference = AutoModelForCausalLM.from_pretrained(f["ref"], dtype=torch.float32).eval()
    rewards: dict[int, list[float]] = {}
    for l in lines:
        rewards.setdefault(l["row"], []).append(math.nan if l["reward"] is None else l["reward"])
    total, tokens = 0.0, 0
    for l in lines:
        group = torch.tensor(rewards[l["row"]])
        std = (
            torch.tensor(float(group[~torch.isnan(group)].std()))
            if (~torch.isnan(group)).sum() > 1
            else torch.tensor(math.nan)
        )
        adv = float(
            torch.nan_to_num(
                (torch.tensor(math.nan if l["reward"] is None else l["reward"]) - torch.nanmean(group)) / (std + 1e-4),
                nan=0.0,
            )
        )
        prompt = tok(by_row[l["row"]]["prompt"])["input_ids"]
        ids = torch.tensor([prompt + l["completion_ids"]])
        with torch.no_grad():
            logps = [
                torch.log_softmax(m(input_ids=ids).logits[0, :-1].float() / 1.3, -1).gather(1, ids[0, 1:, None])[
                    len(prompt) - 1 :, 0
                ]
                for m in (policy, reference)
            ]
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
    fp16's rounding may flip, the ones transformers' generate makes from the model in fp32 (weights large enough that
    the completions depend on the prompt)."""
    f = setup_files
    sharp = make_chat_llama(tmp_path / "sharp", seed=4, initializer_range=0.1)
    base = [
        "--model",
        str(sharp),
        "--dataset",
        str(f["data"]),
        "--method",
        "grpo",
        "--reward",
        f"{f['rewards']}:variety",
        "--num_generations",
        "2",
        "--max_completion_length",
        str(LENGTH),
        "--max_length",
        "64",
        "--batch_size",
        "4",
        "--end_idx",
        str(PROMPTS),
        "--precision",
        "fp16",
        "--wandb_mode",
        "disabled",
        "--seed",
        "6",
        "--lr",
        "1e-2",
        "--save_optimizer",
        "false",
    ]
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
    tok = AutoTokenizer.from_pretrained(sharp)
    lines = read_jsonl(out / "completions.jsonl")
    assert len(lines) == 2 * PROMPTS
    for line in lines:
        ids = line["completion_ids"]
        assert 0 < len(ids) <= LENGTH and tok.eos_token_id not in ids[:-1], ids
    policy = AutoModelForCausalLM.from_pretrained(sharp, dtype=torch.float32).eval()
    (saved,) = out.glob("*-epoch-1.pt")
    trained = torch.load(saved, weights_only=True)["MODEL_STATE"]
    assert any(not torch.equal(trained[k].float(), v) for k, v in policy.state_dict().items() if k in trained)

    by_row = dict(enumerate(rows()))
    same, gaps = 0, []
    first = [l for l in read_jsonl(tmp_path / "greedy" / "out" / "completions.jsonl") if l["step"] == 1]
    for line in first:
        made, want = line["completion_ids"], greedy_alone(policy, tok, by_row[line["row"]]["prompt"])
        same += made == want
        if made != want:  # where they part, fp32's two likeliest tokens must be a near tie that fp16 could flip
            at = next(i for i, (a, b) in enumerate(zip(made + [-1], want + [-1])) if a != b)
            ids = torch.tensor([tok(by_row[line["row"]]["prompt"])["input_ids"] + want[:at]])
            with torch.no_grad():
                top = policy(input_ids=ids).logits[0, -1].float().topk(2).values
            gaps.append(float(top[0] - top[1]))
    print(
        f"fp16 greedy completions equal to fp32 generate: {same} of {len(first)}; fp32's top-two gaps where they "
        f"part: {gaps}"
    )
    assert len(first) == 8 and all(g < 0.02 for g in gaps), gaps


def _steps(out: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["reward"], r["tokens"], r["slice"]) for r in read_jsonl(out / "metrics.jsonl")]


def _drawn(out: Path) -> list[tuple]:
    return [
        (l["step"], l["row"], l["place"], tuple(l["completion_ids"]), l["reward"], l["advantage"])
        for l in read_jsonl(out / "completions.jsonl")
    ]


@pytest.mark.parametrize("reuse", ["once", "reused"])
def test_a_session_resumed_mid_range_draws_and_trains_what_the_straight_run_did(tmp_path, setup_files, reuse):
    """Rows [0, 8), a checkpoint after each step: a second session resumed from the one after step 2 samples the same
    completions, gets the same rewards and the same losses for the steps after it, bit for bit (CPU, fp32). reused:
    each generation takes two steps' prompts and is trained on twice (--num_iterations 2 --steps_per_generation 2
    --accum_steps 1: four steps a generation), so the checkpoint after step 2 lies inside the first generation: the
    resumed session trains on the generation and the old log-probabilities the checkpoint kept, and samples nothing
    until the next generation."""
    f = setup_files
    args = [
        "--model",
        str(f["policy"]),
        "--dataset",
        str(f["data"]),
        "--method",
        "grpo",
        "--reward",
        f"{f['rewards']}:overlap",
        "--num_generations",
        "2",
        "--max_completion_length",
        str(LENGTH),
        "--max_length",
        "64",
        "--batch_size",
        "2",
        "--end_idx",
        str(PROMPTS),
        "--precision",
        "fp32",
        "--wandb_mode",
        "disabled",
        "--seed",
        "5",
        "--lr",
        "1e-2",
    ]
    if reuse == "reused":
        args += ["--num_iterations", "2", "--steps_per_generation", "2", "--accum_steps", "1", "--epsilon", "0.05"]
    straight = run_cli(
        args + ["--save_every_steps", "1", "--keep_last", "0", "--output_dir", str(tmp_path / "a")], tmp_path, nproc=2
    )
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-3000:]
    (tmp_path / "b").mkdir()
    (mid,) = (tmp_path / "a").glob("*-step-2.pt")
    (tmp_path / "b" / mid.name).write_bytes(mid.read_bytes())
    resumed = run_cli(args + ["--resume_file", mid.name, "--output_dir", str(tmp_path / "b")], tmp_path, nproc=2)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    want = [s for s in _steps(tmp_path / "a") if s[0] > 2]
    assert _steps(tmp_path / "b") == want and len(want) == (2 if reuse == "once" else 6)
    assert _drawn(tmp_path / "b") == [d for d in _drawn(tmp_path / "a") if d[0] > 2]
    if reuse == "reused":
        saved = torch.load(mid, weights_only=True)
        assert saved["train_state"]["within"] == 2 and len(saved["grpo"]["generation"]["ranks"]) == 2
        assert "step 3 of the generation there" in resumed.stdout
        a = read_jsonl(tmp_path / "a" / "metrics.jsonl")
        assert [r["iteration"] for r in a] == [1, 1, 2, 2] * 2
        assert [r["generation_share"] > 0 for r in a] == [True, False, False, False] * 2
        # the second pass trains a moved policy against the log-probabilities the completions were sampled with
        assert any(r["clip_ratio/region_mean"] > 0 for r in a if r["iteration"] == 2), a
        assert all(r["clip_ratio/region_mean"] == 0 for r in a if r["step"] in (1, 5)), a


def test_three_auto_sessions_through_the_hub_equal_one_straight_run(tmp_path, setup_files):
    """--start_idx auto, three sessions on empty machines through the loopback Hub: the same completions, rewards and
    losses as one session that trains the three ranges."""
    f = setup_files
    auto = [
        "--model",
        str(f["policy"]),
        "--dataset",
        str(f["data"]),
        "--method",
        "grpo",
        "--reward",
        f"{f['rewards']}:overlap",
        "--num_generations",
        "2",
        "--max_completion_length",
        str(LENGTH),
        "--max_length",
        "64",
        "--batch_size",
        "2",
        "--precision",
        "fp32",
        "--wandb_mode",
        "disabled",
        "--seed",
        "9",
        "--start_idx",
        "auto",
        "--range_size",
        "2",
        "--lr",
        "1e-2",
    ]
    saved = [name for proc in hub_sessions(auto, tmp_path, "me/grpo") for name in saved_names(proc.stdout)]
    one = run_cli(auto + ["--session_ranges", "3", "--output_dir", str(tmp_path / "one")], tmp_path, nproc=2)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-3000:]
    assert saved == saved_names(one.stdout) == [f"policy_{a}-{a + 2}-epoch-1.pt" for a in (0, 2, 4)]
    assert _steps(tmp_path / "m2" / "out") == _steps(tmp_path / "one")
    drawn = [d for i in range(3) for d in _drawn(tmp_path / f"m{i}" / "out")]
    assert drawn == _drawn(tmp_path / "one") and len(drawn) == 3 * 2 * 2


BAD_REWARDS = """
def boom(completions, **kwargs):
    raise ValueError("no rule for this one")


def too_few(completions, **kwargs):
    return [1.0]


def not_a_number(completions, **kwargs):
    return ["high"] * len(completions)
"""


def test_bad_grpo_input_is_one_line_and_writes_no_checkpoint(tmp_path, setup_files):
    f = setup_files
    bad = tmp_path / "bad.py"
    bad.write_text(BAD_REWARDS)
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"row {i} of text"}) + "\n" for i in range(8)))
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n" for _ in range(8)))
    base = [
        "--model",
        str(f["policy"]),
        "--method",
        "grpo",
        "--num_generations",
        "2",
        "--max_completion_length",
        "8",
        "--max_length",
        "64",
        "--batch_size",
        "2",
        "--end_idx",
        "8",
        "--precision",
        "fp32",
        "--wandb_mode",
        "disabled",
    ]
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
        (
            data + ["--reward", "length", "--num_generations", "3"],
            ["--num_generations 3", "not a whole number of groups"],
        ),
        (
            data + ["--reward", "length", "--max_completion_length", "64"],
            ["--max_completion_length 64", "below --max_length"],
        ),
        (data + ["--reward", "length", "--reward_weights", "1,2"], ["--reward_weights 1,2", "2 weight(s) for 1"]),
        (data + ["--reward", "length", "--loss_type", "ppo"], ["--loss_type", "ppo"]),
    ]
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
    base = [
        "--model",
        str(wide),
        "--dataset",
        str(f["data"]),
        "--method",
        "grpo",
        "--reward",
        f"{f['rewards']}:variety",
        "--num_generations",
        "2",
        "--max_completion_length",
        str(LENGTH),
        "--max_length",
        "64",
        "--batch_size",
        "2",
        "--end_idx",
        str(PROMPTS),
        "--precision",
        "fp32",
        "--wandb_mode",
        "disabled",
        "--seed",
        "4",
        "--lr",
        "5e-2",
        "--lora_rank",
        "8",
        "--beta",
        "0.04",
        "--save_optimizer",
        "false",
    ]
    runs = []
    for name, extra in (("fp16base", ["--save_every_steps", "1", "--keep_last", "0"]), ("nf4", ["--base_bits", "4"])):
        (tmp_path / name).mkdir()
        runs.append((base + extra + ["--output_dir", str(tmp_path / name / "out")], tmp_path / name, None))
    for proc, (_, folder, _) in zip(run_cli_concurrently(runs, timeout=300, nproc=2), runs):
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert "reference: the base with the adapters switched off" in proc.stdout
        kl = [r["kl"] for r in read_jsonl(folder / "out" / "metrics.jsonl")]
        assert len(kl) == 4 and abs(kl[0]) <= 1e-7 and all(k > 1e-6 for k in kl[1:]), (folder.name, kl)

    from peft import PeftModel

    out = tmp_path / "fp16base" / "out"
    (first,) = out.glob("*-step-1.pt")
    proc = launch(
        ["-m", "fsdp_opt.export"], [str(first), str(tmp_path / "adapter"), "--dtype", "fp32", "--adapter"], tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(wide)
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(wide, dtype=torch.float32), str(tmp_path / "adapter")
    ).eval()
    by_row, total, tokens = dict(enumerate(rows())), 0.0, 0
    for line in (l for l in read_jsonl(out / "completions.jsonl") if l["step"] == 2):
        prompt = tok(by_row[line["row"]]["prompt"])["input_ids"]
        ids = torch.tensor([prompt + line["completion_ids"]])
        with torch.no_grad():
            policy = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            with model.disable_adapter():
                ref = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        pick = lambda lp: lp.gather(1, ids[0, 1:, None])[len(prompt) - 1 :, 0]  # noqa: E731
        d = pick(ref) - pick(policy)
        total += float((torch.exp(d) - d - 1).sum())
        tokens += len(line["completion_ids"])
    second = read_jsonl(out / "metrics.jsonl")[1]["kl"]
    print(f"the second step's KL: the run's {second:.6e}, peft's adapters on and off {total / tokens:.6e}")
    assert abs(second - total / tokens) <= 1e-4 * abs(second), (second, total / tokens)


def test_evaluate_reports_the_reward_training_reported_and_shows_the_completions_it_scored(tmp_path):
    """A model whose generation config ends a completion at a second token too (eos_token_id [2, X], X a token its
    greedy completions reach): training's held-out reward at its save and `python -m fsdp_opt.evaluate --reward`'s for
    that checkpoint are the same number, and the completions evaluate shows for the base are transformers' greedy
    generate with the same ends and length, decoded: the ones it scored."""
    sharp = make_chat_llama(tmp_path / "sharp", seed=4, initializer_range=0.1)
    tok = AutoTokenizer.from_pretrained(sharp)
    asks = [
        f"Say {' and '.join(WORDS[k % 12 : k % 12 + 1 + k % 3])} {'twice' if k % 2 else 'once'}:" for k in range(16)
    ]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": a}) + "\n" for a in asks))
    base = AutoModelForCausalLM.from_pretrained(sharp, dtype=torch.float32).eval()
    firsts = [greedy_alone(base, tok, a) for a in asks[8:]]
    x = next(c[1] for c in firsts if len(c) > 2 and c[1] != tok.eos_token_id)  # a token greedy decoding reaches
    config = json.loads((sharp / "config.json").read_text())
    (sharp / "config.json").write_text(json.dumps({**config, "eos_token_id": [tok.eos_token_id, x]}))
    flags = [
        "--model",
        str(sharp),
        "--dataset",
        str(tmp_path / "prompts.jsonl"),
        "--method",
        "grpo",
        "--reward",
        "length",
        "--num_generations",
        "2",
        "--max_completion_length",
        str(LENGTH),
        "--max_length",
        "64",
        "--batch_size",
        "4",
        "--end_idx",
        "8",
        "--eval_rows",
        "8",
        "--precision",
        "fp32",
        "--wandb_mode",
        "disabled",
        "--seed",
        "3",
        "--output_dir",
        str(tmp_path / "out"),
    ]
    proc = run_cli(flags, tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    trained = read_jsonl(tmp_path / "out" / "eval.jsonl")[-1]["reward"]
    report_path = tmp_path / "report.json"
    proc = launch(
        ["-m", "fsdp_opt.evaluate"],
        [
            "--checkpoints",
            "latest",
            "--output_dir",
            str(tmp_path / "out"),
            "--reward",
            "length",
            "--eval_rows",
            "8",
            "--num_prompts",
            "4",
            "--device",
            "cpu",
            "--json",
            str(report_path),
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    base_row, tuned_row = report["models"]
    print(f"held-out reward: training {trained}, evaluate {tuned_row['reward']} (base {base_row['reward']})")
    assert tuned_row["reward"] == trained
    assert "one greedy completion each of up to 8 tokens, scored by length" in proc.stdout
    assert "loss on" not in proc.stdout.split("evaluating", 1)[1].splitlines()[0]
    ends = [tok.eos_token_id, x]
    for sample, ask in zip(report["samples"], asks[8:12]):
        ids = torch.tensor([tok(ask)["input_ids"]])
        with torch.no_grad():
            made = base.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=LENGTH,
                eos_token_id=ends,
                pad_token_id=tok.pad_token_id,
            )[0, ids.shape[1] :]
        made = made.tolist()
        cut = next((i + 1 for i, t in enumerate(made) if t in ends), len(made))
        shown = next(v for k, v in sample["outputs"].items() if k.startswith("base"))
        assert shown == tok.decode(made[:cut], skip_special_tokens=True), (ask, shown, made)
    assert any(x in greedy for greedy in firsts)  # the second end matters to at least one completion


def test_a_changed_reward_rule_stops_the_chain_and_a_reformatted_one_does_not(tmp_path, setup_files):
    """A session resumed with its reward file's rule changed is refused in one line (--allow_changes goes on); with the
    file only reformatted (comments, layout), it resumes."""
    f = setup_files
    rules = tmp_path / "rules.py"
    rules.write_text("def short(completions, **kwargs):\n    return [1.0 / (1 + len(c)) for c in completions]\n")
    args = [
        "--model",
        str(f["policy"]),
        "--dataset",
        str(f["data"]),
        "--method",
        "grpo",
        "--reward",
        f"{rules}:short",
        "--num_generations",
        "2",
        "--max_completion_length",
        "4",
        "--max_length",
        "64",
        "--batch_size",
        "2",
        "--precision",
        "fp32",
        "--wandb_mode",
        "disabled",
        "--output_dir",
        str(tmp_path / "out"),
        "--save_optimizer",
        "false",
    ]
    first = run_cli(args + ["--end_idx", "4"], tmp_path, nproc=2)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    (saved,) = saved_names(first.stdout)
    more = args + ["--start_idx", "4", "--end_idx", "8", "--resume_file", saved]
    rules.write_text("def short(completions, **kwargs):\n    return [1.0 / (2 + len(c)) for c in completions]\n")
    changed = run_cli(more, tmp_path, nproc=2)
    assert_clean_failure(changed, f"--reward {rules}:short: its source changed since the checkpoint")
    rules.write_text(
        "# shorter is better\n\n\ndef short(\n    completions,\n    **kwargs,\n):\n"
        "    return [1.0 / (1 + len(c)) for c in completions]  # one over the length\n"
    )
    reformatted = run_cli(more, tmp_path, nproc=2)
    assert reformatted.returncode == 0, reformatted.stdout[-2000:] + reformatted.stderr[-3000:]


def test_a_resumed_session_keeps_the_reference_its_chain_recorded(tmp_path, setup_files):
    """The KL term's reference is the chain's: --ref_model, else what the checkpoint recorded (the model the first
    session started from), not a later session's --model; a LoRA run's base with its adapters off likewise."""
    from fsdp_opt.config.parse import parse_args
    from fsdp_opt.train.reference import ADAPTERS_OFF, reference_name

    f = setup_files
    flags = ["--dataset", str(f["data"]), "--method", "grpo", "--reward", f"{f['rewards']}:overlap", "--beta", "0.1"]

    def ref(model: str, saved: dict | None, *more: str) -> str:
        config = parse_args(["--model", model, *flags, *more])
        return reference_name(config.method.settings.ref_model, saved, config.model.model, config.lora.enabled)

    assert ref("first", None) == "first"
    assert ref("copy-of-first", {"ref_model": "first", "rewards": []}) == "first"
    assert ref("copy-of-first", {"ref_model": "first", "rewards": []}, "--ref_model", "other") == "other"
    assert ref("first", None, "--lora_rank", "4") == ADAPTERS_OFF
