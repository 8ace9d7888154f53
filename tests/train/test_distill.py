"""--method distill against TRL 1.16's DistillationTrainer: one step's loss and every gradient on the same completions
(sampled by our step on 2 ranks, 2 micro-batches each), at beta 0 (forward KL), 0.5 (the generalized JSD) and 1
(reverse KL), at a temperature below 1. Then the chain (a session resumed mid-range trains what one straight run
trains), the plan and the bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    assert_clean_failure,
    assert_same_step,
    hub_sessions,
    launch,
    make_local_model,
    read_jsonl,
    run_cli,
    saved_names,
)
from hubdata import PARAGRAPHS
from transformers import AutoModelForCausalLM, AutoTokenizer

WORKER = str(ROOT / "tests" / "workers" / "distill_step.py")
TEMPERATURE = 0.9


def prompt_rows(n: int) -> list[dict]:
    return [
        {"prompt": f"Paragraph {k} begins: {PARAGRAPHS[k % len(PARAGRAPHS)][: 10 + 5 * (k % 5)]}"} for k in range(n)
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distill")
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows(24)))
    return {
        "root": root,
        "student": make_local_model(root / "student", seed=0),
        "teacher": make_local_model(root / "teacher", seed=1),
        # wider than the student (hidden 256: every block's linear weight splits into 2 NF4 shards), the same vocabulary
        "wide": make_local_model(
            root / "wide", seed=2, hidden_size=256, ffn_dim=1024, word_embed_proj_dim=256, num_attention_heads=4
        ),
        "data": data,
    }


def common(f: dict[str, Path], out: Path) -> list[str]:
    return [
        "--model",
        str(f["student"]),
        "--dataset",
        str(f["data"]),
        "--method",
        "distill",
        "--teacher_model",
        str(f["teacher"]),
        "--temperature",
        str(TEMPERATURE),
        "--max_length",
        "64",
        "--max_completion_length",
        "12",
        "--precision",
        "fp32",
        "--output_dir",
        str(out),
        "--wandb_mode",
        "disabled",
        "--seed",
        "7",
    ]


def nf4_teacher(path: Path) -> torch.nn.Module:
    """The teacher with each of its blocks' linear weights quantized whole by torchao (NF4), as a 4-bit teacher's."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    done = 0
    for name, module in model.named_modules():
        if ".layers." in name and name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"):
            module.weight = torch.nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)
            done += 1
    assert done == 6 * model.config.num_hidden_layers
    return model


def trl_step(
    f: dict[str, Path], report: dict, beta: float, teacher: torch.nn.Module | None = None
) -> tuple[float, dict]:
    """TRL's DistillationTrainer's loss of each of our micro-batches (its inputs as its generation lays them out: the
    prompts left-padded, the completions right-padded with their mask), each divided by the step's completion tokens
    on all ranks (its num_items_in_batch, DDP's mean undone as TRL undoes it), the backward of each: the loss and
    every parameter's gradient."""
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    tok = AutoTokenizer.from_pretrained(f["student"])
    args = DistillationConfig(
        output_dir=str(f["root"] / "trl"),
        per_device_train_batch_size=2,
        beta=beta,
        temperature=TEMPERATURE,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    trainer = DistillationTrainer(
        model=AutoModelForCausalLM.from_pretrained(f["student"], dtype=torch.float32),
        teacher_model=teacher or AutoModelForCausalLM.from_pretrained(f["teacher"], dtype=torch.float32),
        args=args,
        train_dataset=Dataset.from_list(prompt_rows(8)),
        processing_class=tok,
    )
    model = trainer.model
    # ours runs without dropout (the model's config has it off); OPT's dropout is functional, which TRL's
    # disable_dropout does not reach: eval mode is TRL's forward without it (the gradients are the same otherwise)
    model.eval()
    pad = tok.pad_token_id
    completions = [c for rank in report["micro"] for m in rank for c in m]
    items = float(sum(len(c["completion"]) for c in completions))

    def inputs(members: list[dict]) -> dict:
        p = max(len(c["prompt"]) for c in members)
        q = max(len(c["completion"]) for c in members)
        return {
            "prompt_ids": torch.tensor([[pad] * (p - len(c["prompt"])) + c["prompt"] for c in members]),
            "prompt_mask": torch.tensor([[0] * (p - len(c["prompt"])) + [1] * len(c["prompt"]) for c in members]),
            "completion_ids": torch.tensor([c["completion"] + [pad] * (q - len(c["completion"])) for c in members]),
            "completion_mask": torch.tensor(
                [[1] * len(c["completion"]) + [0] * (q - len(c["completion"])) for c in members]
            ),
        }

    total = 0.0
    for rank in report["micro"]:
        for members in rank:
            if members:
                loss, _, _ = trainer._compute_loss(model, inputs(members), torch.tensor(items))
                loss.backward()
                total += float(loss.detach())
    return total, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_a_step_is_trls_distillation_loss_and_gradient(tmp_path, files, beta):
    flags = common(files, tmp_path / "out") + [
        "--beta",
        str(beta),
        "--packing",
        "pad",
        "--batch_size",
        "2",
        "--accum_steps",
        "2",
        "--end_idx",
        "8",
    ]
    out = tmp_path / "report.json"
    proc = launch([WORKER], [str(out), *flags], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ours = json.loads(out.read_text())
    # 2 ranks x 2 micro-batches x 2 completions, each completion a sample of its own length
    assert [len(m) for rank in ours["micro"] for m in rank] == [2, 2, 2, 2]
    lengths = {len(c["completion"]) for rank in ours["micro"] for m in rank for c in m}
    assert min(lengths) >= 1
    loss, grads = trl_step(files, ours, beta)
    print(f"beta {beta}: ours {ours['loss']:.8f}, TRL {loss:.8f}; lengths {sorted(lengths)}; record {ours['record']}")
    assert loss > 1e-3  # the teacher is another model: the divergence is not 0
    assert_same_step(ours, loss, grads)
    record = ours["record"]
    assert record["completions"] == 8 and record["tokens"] == sum(
        len(c["completion"]) for rank in ours["micro"] for m in rank for c in m
    )


def test_a_4bit_teacher_is_trls_loss_on_the_nf4_teacher(tmp_path, files):
    """--teacher_bits 4 with a teacher wider than the student, on 2 ranks (its NF4 weights split between them): the
    step's loss and gradients are TRL's with a teacher whose same weights torchao quantized whole, within 1e-5, and
    not those of the 16-bit teacher."""
    i = common(files, tmp_path / "out").index("--teacher_model")
    flags = common(files, tmp_path / "out")
    flags[i + 1] = str(files["wide"])
    flags += ["--teacher_bits", "4", "--beta", "0.5", "--packing", "pad", "--batch_size", "2", "--accum_steps", "2"]
    out = tmp_path / "report.json"
    proc = launch([WORKER], [str(out), *flags, "--end_idx", "8"], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "its blocks' linear weights in NF4" in proc.stdout
    ours = json.loads(out.read_text())
    loss, grads = trl_step(files, ours, 0.5, nf4_teacher(files["wide"]))
    full, _ = trl_step(files, ours, 0.5, AutoModelForCausalLM.from_pretrained(files["wide"], dtype=torch.float32))
    print(f"4-bit teacher: ours {ours['loss']:.8f}, TRL on the NF4 teacher {loss:.8f}, on the 16-bit one {full:.8f}")
    assert abs(ours["loss"] - loss) <= 1e-5, (ours["loss"], loss)
    assert abs(ours["loss"] - full) > 1e-5  # the quantization is there to see
    diffs = {n: (torch.tensor(ours["grads"][n]) - g).abs().max().item() for n, g in grads.items()}
    assert max(diffs.values()) <= 1e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:4]


def test_a_session_resumed_mid_range_trains_what_one_straight_run_trains(tmp_path, files):
    """Rows [0, 8), three epochs of two steps, a checkpoint after each step: a session resumed from the one after step 1 samples
    the same completions and trains the same steps as the straight run, bit for bit (CPU, fp32); the divergence from
    the teacher falls; completions.jsonl has every step's completions."""
    flags = common(files, tmp_path / "x") + ["--batch_size", "2", "--accum_steps", "1", "--end_idx", "8"]
    flags += ["--num_epochs", "3", "--lr", "3e-3", "--eval_rows", "4", "--save_every_steps", "1", "--keep_last", "0"]
    straight = run_cli(flags + ["--output_dir", str(tmp_path / "a")], tmp_path, nproc=2)
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-3000:]
    assert f"distill: teacher {files['teacher']}: loaded sharded in fp32" in straight.stdout
    (tmp_path / "b").mkdir()
    (mid,) = (tmp_path / "a").glob("*-step-1.pt")
    (tmp_path / "b" / mid.name).write_bytes(mid.read_bytes())
    resumed = run_cli(flags + ["--resume_file", mid.name, "--output_dir", str(tmp_path / "b")], tmp_path, nproc=2)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    keys = ("step", "loss", "grad_norm", "tokens", "entropy", "completion_length")
    one = [tuple(r[k] for k in keys) for r in read_jsonl(tmp_path / "a" / "metrics.jsonl")]
    two = [tuple(r[k] for k in keys) for r in read_jsonl(tmp_path / "b" / "metrics.jsonl")]
    assert two == [s for s in one if s[0] > 1] and len(one) == 6
    sampled = read_jsonl(tmp_path / "a" / "completions.jsonl")
    again = read_jsonl(tmp_path / "b" / "completions.jsonl")
    assert len(sampled) == 24 and again == [r for r in sampled if r["step"] > 1]
    evals = read_jsonl(tmp_path / "a" / "eval.jsonl")
    print("losses", [s[1] for s in one], "held-out", [e["divergence"] for e in evals])
    assert len(evals) == 6 and evals[-1]["divergence"] < 0.7 * evals[0]["divergence"]


def test_a_changed_teacher_is_drift_the_chain_refuses(tmp_path, files):
    flags = common(files, tmp_path / "out") + ["--batch_size", "2", "--accum_steps", "2", "--end_idx", "8"]
    first = run_cli(flags, tmp_path, nproc=2)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    (ckpt,) = (tmp_path / "out").glob("*-epoch-1.pt")
    other = make_local_model(tmp_path / "other", seed=2)
    i = flags.index("--teacher_model")
    changed = flags[: i + 1] + [str(other)] + flags[i + 2 :] + ["--resume_file", ckpt.name, "--num_epochs", "2"]
    proc = run_cli(changed, tmp_path, nproc=2)
    assert_clean_failure(proc, "--teacher_model")
    # python -m fsdp_opt.evaluate loads no teacher: one line, not a loss of the wrong kind
    args = ["--checkpoints", "latest", "--output_dir", str(tmp_path / "out"), "--device", "cpu", "--num_prompts", "0"]
    assert_clean_failure(launch(["-m", "fsdp_opt.evaluate"], args, tmp_path), "does not load a teacher")


def test_bad_distill_input_is_one_line(tmp_path, files):
    f = files
    base = common(f, tmp_path / "out") + ["--batch_size", "2", "--end_idx", "8"]
    no_teacher = [a for a in base if a not in ("--teacher_model", str(f["teacher"]))]
    assert_clean_failure(run_cli(no_teacher, tmp_path), "--teacher_model: --method distill needs the teacher")
    wide = make_local_model(tmp_path / "wide", seed=1, vocab_size=4200)
    i = base.index("--teacher_model")
    other_vocab = base[: i + 1] + [str(wide)] + base[i + 2 :]
    assert_clean_failure(run_cli(other_vocab, tmp_path), f"--teacher_model {wide}: its vocabulary has 4200 entries")
    assert_clean_failure(run_cli(base + ["--beta", "1.5"], tmp_path), "--beta 1.5: must be in [0, 1]")
    assert_clean_failure(run_cli(base + ["--reward", "length"], tmp_path), "--reward: only with --method grpo or rloo")
    sft = [a for a in base if a not in ("distill",)]
    sft[sft.index("--method") + 1 : sft.index("--method") + 1] = ["sft"]
    for shared in ("--temperature", "--max_completion_length"):  # flags of the sampling methods: the teacher's alone
        at = sft.index(shared)
        del sft[at : at + 2]
    assert_clean_failure(run_cli(sft, tmp_path), "--teacher_model: only with --method distill")


def test_lora_distillation_through_the_hub_equals_one_session_of_three_ranges(tmp_path, files):
    """LoRA distillation of tiny-opt on the built-in prompts, --start_idx auto through the loopback Hub on three empty
    machines: the names, the steps and the completions of one session that trains the three ranges, bit for bit."""
    auto = [
        "--model",
        "tiny-opt",
        "--dataset",
        "python-docs-prompts",
        "--method",
        "distill",
        "--teacher_model",
        str(files["teacher"]),
        "--chat_template",
        "chatml",
        "--lora_rank",
        "8",
        "--max_length",
        "96",
        "--max_completion_length",
        "8",
        "--batch_size",
        "2",
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
    procs = hub_sessions(auto, tmp_path, "me/distill")
    saved = [name for proc in procs for name in saved_names(proc.stdout)]
    one = run_cli(auto + ["--session_ranges", "3", "--output_dir", str(tmp_path / "one")], tmp_path, nproc=2)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-3000:]
    assert saved == saved_names(one.stdout) == [f"tiny_opt_{a}-{a + 8}-epoch-1.pt" for a in (0, 8, 16)]
    fields = ("step", "loss", "slice", "entropy", "completion_length")
    got = [tuple(r[k] for k in fields) for r in read_jsonl(tmp_path / "m2" / "out" / "metrics.jsonl")]
    want = [tuple(r[k] for k in fields) for r in read_jsonl(tmp_path / "one" / "metrics.jsonl")]
    assert got == want and len(want) >= 3
    last = read_jsonl(tmp_path / "m2" / "out" / "completions.jsonl")
    assert last and last == [
        r for r in read_jsonl(tmp_path / "one" / "completions.jsonl") if r["step"] >= last[0]["step"]
    ]
