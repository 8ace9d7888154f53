"""LoRA (peft) under FSDP2: the same math as peft on one process, adapters-only checkpoints that resume exactly and
refuse another base, the adapter folder peft loads, and the merged export."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    ASSETS,
    HF_TOK,
    ROOT,
    assert_clean_failure,
    hub_env,
    kill_all_with,
    launch,
    losses_by_step,
    make_local_model,
    read_jsonl,
    run_cli,
    sandbox_env,
    saved_names,
    torchrun_cmd,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdp_opt.checkpoint.names import MODEL_KEY, checkpoint_name
from fsdp_opt.data.blocks import StepPlan, build_blocks
from fsdp_opt.data.formats import select_texts
from fsdp_opt.data.sources import load_rows
from fsdp_opt.model.sources import model_tag

END_IDX, MAX_LEN, LR, CLIP, SEED, GLOBAL_BATCH, RANK = 64, 64, 1e-2, 0.5, 3, 8, 4
COMMON = [
    "--dataset",
    "python-docs",
    "--end_idx",
    str(END_IDX),
    "--max_length",
    str(MAX_LEN),
    "--lr",
    str(LR),
    "--max_grad_norm",
    str(CLIP),
    "--seed",
    str(SEED),
    "--num_epochs",
    "1",
    "--precision",
    "fp32",
    "--lora_rank",
    str(RANK),
    "--lora_dropout",
    "0",
    "--packing",
    "concat",  # the references below join rows as concat does
]
LINEAR = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


def peft_model(det_model, targets=LINEAR):
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(det_model, dtype=torch.float32)
    torch.manual_seed(SEED)
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=list(targets), bias="none")
    return get_peft_model(model, config)


def step_batches(det_model, end_idx: int = END_IDX) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each optimizer step's global batch (ids, attention mask, labels), in the order the engine draws them."""
    tokenizer = AutoTokenizer.from_pretrained(det_model)
    texts, _ = select_texts(load_rows("python-docs"), "text", 0, end_idx)
    blocks = build_blocks(texts, tokenizer, MAX_LEN, packing="concat")
    order = StepPlan(blocks, batch_size=GLOBAL_BATCH, accum_steps=1, rank=0, world_size=1, seed=SEED).epoch_order(0)
    out = []
    for begin in range(0, len(order), GLOBAL_BATCH):
        idx = order[begin : begin + GLOBAL_BATCH]
        ids = blocks.input_ids[idx].long()
        valid = torch.arange(MAX_LEN)[None, :] < blocks.lengths[idx][:, None]
        out.append((ids, valid.long(), torch.where(valid, ids, -100)))
    return out


def reference_steps(det_model, batches, start=None, steps=None):
    """peft on one process, unsharded, each global batch at once; from the initial adapters, or from an engine
    checkpoint's adapters and AdamW state (`start`). Returns per-step losses and adapters (engine names)."""
    model = peft_model(det_model)
    model.train()
    named = {n[len("base_model.model.") :]: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(list(named.values()), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    if start is not None:
        with torch.no_grad():
            for name, p in named.items():
                p.copy_(start[MODEL_KEY][name])
        for name, state in start["optimizer"]["state"].items():
            opt.state[named[name]] = {k: v.clone() for k, v in state.items()}
    losses, snapshots = [], []
    for ids, mask, labels in batches[:steps]:
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(named.values()), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        snapshots.append({n: p.detach().clone() for n, p in named.items()})
    return losses, snapshots


@pytest.fixture(scope="module")
def batches(det_model):
    return step_batches(det_model)


@pytest.fixture(scope="module")
def reference(det_model, batches):
    return reference_steps(det_model, batches)


@pytest.mark.parametrize(
    "strategy,extra",
    [
        # activation checkpointing (the default), accumulation without sync, the loss 100 tokens at a time
        ("FULL_SHARD", ["--accum_steps", "2", "--loss_chunk_tokens", "100"]),
    ],
)
def test_two_rank_lora_matches_one_process_peft(tmp_path, det_model, batches, reference, strategy, extra):
    """The losses of the whole run within 1e-4 of peft's. The adapters step by step: peft takes each step from the
    engine's checkpoint of the step before (adapters and AdamW moments) and must land within 1e-4 of the engine's
    next checkpoint. (Over a whole run, two float orders of the same math part: Adam divides by the root of tiny
    second moments. peft's run against itself in micro-batches of 2 differs by 2e-5 at step 6, 2e-3 at step 16.)"""
    want_losses, want_first = reference
    out = tmp_path / "out"
    args = (
        COMMON
        + extra
        + [
            "--model",
            str(det_model),
            "--batch_size",
            "2",
            "--sharding_strategy",
            strategy,
            "--output_dir",
            str(out),
            "--save_every_steps",
            "1",
            "--keep_last",
            "0",
        ]
    )
    proc = run_cli(args, tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 4, alpha 8, dropout 0 on 24 layers" in proc.stdout
    got = [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]
    assert len(got) == len(want_losses) > 5
    for step, (g, w) in enumerate(zip(got, want_losses), 1):
        assert abs(g - w) <= 1e-4 * max(1.0, abs(w)), (step, g, w)
    tag = model_tag(str(det_model))
    saved = [
        torch.load(out / checkpoint_name(tag, 0, END_IDX, 1, step), weights_only=True) for step in range(1, len(got))
    ]
    for step, payload in enumerate(saved, 1):
        assert sorted(payload[MODEL_KEY]) == sorted(want_first[0])  # the adapters; nothing of the base
        want = want_first[0] if step == 1 else reference_steps(det_model, batches[step - 1 :], saved[step - 2], 1)[1][0]
        for name, value in want.items():
            torch.testing.assert_close(payload[MODEL_KEY][name], value, atol=1e-4, rtol=0, msg=f"step {step}: {name}")
    assert max(v.abs().max().item() for n, v in saved[-1][MODEL_KEY].items() if "lora_B" in n) > 1e-2  # they trained


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_base_unchanged_adapters_fp32_and_export_gives_the_training_logits(tmp_path, det_model, precision):
    """A worker trains on 2 ranks and compares the gathered base before and after, bit for bit; it saves the
    training model's logits on fixed ids. peft, loading the exported adapter on the base, gives the same logits."""
    out = tmp_path / "out"
    export = tmp_path / "adapter"
    args = COMMON + [
        "--model",
        str(det_model),
        "--batch_size",
        "2",
        "--accum_steps",
        "2",
        "--output_dir",
        str(out),
        "--end_idx",
        "40",
        "--precision",
        precision,
        "--export_hf",
        str(export),
        "--export_dtype",
        "fp32",
        "--wandb_mode",
        "disabled",
    ]
    worker = str(ROOT / "tests" / "workers" / "lora_base.py")
    proc = launch([worker], args, tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "lora_check.json").read_text())
    assert report["base_tensors"] > 30 and report["base_changed"] == []
    assert report["frozen_dtypes"] == [{"fp32": "float32", "fp16": "float16"}[precision]]
    assert report["trainable_dtypes"] == ["float32"]
    assert report["optimizer_params"] == report["trainable_params"] == 48
    assert report["adapters_moved"]
    assert sorted(p.name for p in export.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "fsdp_opt_base.json",
    ]
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(det_model, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(export)).eval()
    ids = torch.tensor(report["ids"])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    trained = torch.tensor(report["logits"])
    tol = 1e-4 if precision == "fp32" else 3e-2  # fp16 compute in training, fp32 in peft here
    assert (logits - trained).abs().max().item() <= tol * max(1.0, trained.abs().max().item())
    with torch.no_grad(), model.disable_adapter():
        without = model(input_ids=ids).logits
    assert (without - trained).abs().max().item() > 10 * tol  # the adapters changed the model


def test_lora_checkpoint_is_small_resumes_exactly_after_sigkill_and_merges(tmp_path):
    """tiny-opt with dropout (base and adapters): exactness needs every rank's RNG and the adapters' optimizer state."""
    args = [
        "--model",
        "tiny-opt",
        "--dataset",
        "python-docs",
        "--end_idx",
        "80",
        "--max_length",
        "64",
        "--batch_size",
        "2",
        "--accum_steps",
        "2",
        "--lr",
        "2e-3",
        "--precision",
        "fp32",
        "--seed",
        "11",
        "--lora_rank",
        "8",
        "--lora_targets",
        "q_proj,v_proj,fc2",
    ]
    straight = tmp_path / "straight"
    proc = run_cli(args + ["--output_dir", str(straight)], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = losses_by_step(straight / "metrics.jsonl")
    # A full checkpoint holds at least the fp32 weights and AdamW's two moments: 12 bytes per parameter.
    from transformers import AutoConfig

    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ASSETS)).parameters())
    lora_bytes = (straight / checkpoint_name("tiny_opt", 0, 80, 1)).stat().st_size
    assert lora_bytes * 10 < 12 * n_params, (lora_bytes, n_params)

    out = tmp_path / "out"
    run = subprocess.Popen(
        torchrun_cmd(2) + args + ["--save_every_steps", "3", "--keep_last", "0", "--output_dir", str(out)],
        cwd=tmp_path,
        env=sandbox_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    target = out / checkpoint_name("tiny_opt", 0, 80, 1, 6)
    deadline = time.time() + 240
    while not target.exists() and run.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    kill_all_with(str(out), signal.SIGKILL)
    run.wait()
    assert target.exists(), "the run ended before its second mid-epoch checkpoint"
    assert max(r["step"] for r in read_jsonl(out / "metrics.jsonl")) < max(want)
    resumed = run_cli(args + ["--resume_file", "latest", "--output_dir", str(out)], tmp_path, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = losses_by_step(out / "metrics.jsonl")
    assert sorted(got) == sorted(want)
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-6 * max(1.0, abs(loss)), (step, got[step], loss)

    # --merge: the base with the update in, a plain model folder; its logits are peft's on the adapter folder.
    final = straight / checkpoint_name("tiny_opt", 0, 80, 1)
    for dest, extra in ((tmp_path / "adapter", ["--adapter"]), (tmp_path / "merged", ["--merge"])):
        proc = launch(["-m", "fsdp_opt.export"], [str(final), str(dest), "--dtype", "fp32", *extra], tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
    from peft import PeftModel

    from fsdp_opt.model.adapters import load_base

    info = torch.load(final, weights_only=True)["lora"]
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = (
            PeftModel.from_pretrained(load_base(info, seed=11), str(tmp_path / "adapter")).eval()(input_ids=ids).logits
        )
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(input_ids=ids).logits
        base = load_base(info, seed=11)(input_ids=ids).logits
    torch.testing.assert_close(merged, adapted, atol=1e-4, rtol=1e-4)
    assert (merged - base).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--lora_alpha", "16"], "--lora_alpha: only with --lora_rank"),
        (["--lora_rank", "4", "--lora_targets", "gate_proj"], "--lora_targets gate_proj: matches no linear layer"),
        (["--base_bits", "4"], "--base_bits 4: only with LoRA"),
        (["--lora_rank", "4", "--export_merge"], "--export_merge: only for a LoRA run"),
    ],
)
def test_bad_lora_flags_get_one_line(tmp_path, extra, needle):
    proc = run_cli(
        ["--model", "tiny-opt", "--dataset", "python-docs", "--end_idx", "20", "--output_dir", str(tmp_path / "o")]
        + extra,
        tmp_path,
        nproc=0,
    )
    assert_clean_failure(proc, needle)
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").glob("*.pt"))


def test_resume_refuses_another_base_rank_or_a_full_checkpoint(tmp_path):
    base = [
        "--dataset",
        "python-docs",
        "--end_idx",
        "16",
        "--max_length",
        "32",
        "--batch_size",
        "2",
        "--precision",
        "fp32",
    ]
    first = make_local_model(tmp_path / "base-a", seed=1)
    other = make_local_model(tmp_path / "base-b", seed=2)  # the same shape, other weights
    out = tmp_path / "out"
    proc = run_cli(base + ["--model", str(first), "--lora_rank", "4", "--output_dir", str(out)], tmp_path, nproc=0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = checkpoint_name("base_a", 0, 16, 1)
    cases = [
        (["--model", str(other), "--lora_rank", "4"], "trained on another base model"),
        (["--model", str(first), "--lora_rank", "8"], "LoRA rank 4, this run has --lora_rank 8"),
        (["--model", str(first)], "a LoRA checkpoint (rank 4); resume it with --lora_rank 4"),
    ]
    for extra, needle in cases:
        proc = run_cli(base + extra + ["--output_dir", str(out), "--resume_file", name], tmp_path, nproc=0)
        assert_clean_failure(proc, needle)
    full = tmp_path / "full"
    proc = run_cli(base + ["--model", str(first), "--output_dir", str(full)], tmp_path, nproc=0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli(
        base + ["--model", str(first), "--lora_rank", "4", "--output_dir", str(full), "--resume_file", name],
        tmp_path,
        nproc=0,
    )
    assert_clean_failure(proc, "a full fine-tuning checkpoint; resume it without --lora_rank")


def test_lora_chain_of_three_slices_through_the_hub(tmp_path):
    """Three sessions on empty machines resume `latest` from the Hub stand-in: the checkpoints there hold adapters
    only, the older range keeps a weights file of its adapters, and the exported adapter lands at the repo root with a
    card that names its base. The third session, on one rank, continues the global step."""
    from hubserver import HubServer

    common = [
        "--model",
        "tiny-opt",
        "--dataset",
        "python-docs",
        "--max_length",
        "64",
        "--lr",
        "3e-3",
        "--num_epochs",
        "1",
        "--lora_rank",
        "4",
        "--hf_repo",
        "me/lora",
        "--wandb_mode",
        "disabled",
    ]
    slices = [(0, 40, 2, []), (40, 72, 2, ["--export_hf", "adapter"]), (72, 100, 0, [])]
    with HubServer(token=HF_TOK) as server:
        steps, previous = [], ""
        for i, (start, end, nproc, extra) in enumerate(slices):
            resume = ["--resume_file", "latest"] if i else []
            out = tmp_path / f"s{i}"
            proc = run_cli(
                common
                + resume
                + extra
                + [
                    "--start_idx",
                    str(start),
                    "--end_idx",
                    str(end),
                    "--batch_size",
                    "4" if nproc == 0 else "2",
                    "--output_dir",
                    str(out),
                ],
                tmp_path,
                nproc=nproc,
                env=hub_env(tmp_path, server, f"s{i}"),
            )
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
            if i:
                assert f"latest checkpoint is {previous} " in proc.stdout
                assert re.search(rf"^resumed \S*{re.escape(previous)} at global step {steps[-1]};", proc.stdout, re.M)
            previous = saved_names(proc.stdout)[-1]
            assert previous == f"tiny_opt_{start}-{end}-epoch-1.pt"
            rows = [r for r in read_jsonl(out / "metrics.jsonl") if r["slice"] == f"{start}-{end}"]
            if steps:
                assert rows[0]["step"] == steps[-1] + 1
            steps.append(rows[-1]["step"])
        repo = server.repos["me/lora"]
        ckpts = sorted(k for k in repo.files if k.startswith("checkpoints/"))
        assert ckpts == ["checkpoints/tiny_opt_72-100-epoch-1.pt"]  # --hub_keep_full 1: the newest stays whole
        import io

        payload = torch.load(io.BytesIO(repo.files[ckpts[0]]), weights_only=True)
        assert payload[MODEL_KEY] and all(".lora_" in k for k in payload[MODEL_KEY])
        assert payload["lora"]["rank"] == 4 and payload["GLOBAL_STEP"] == steps[-1]
        weights = sorted(k for k in repo.files if k.startswith("weights/"))
        assert len(weights) == 3
        from safetensors import safe_open

        (tmp_path / "w.safetensors").write_bytes(repo.files[weights[0]])
        with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
            assert all(".lora_" in k for k in f.keys())
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(repo.files)
        card = repo.files["README.md"].decode()
        assert "library_name: peft" in card and 'PeftModel.from_pretrained(base, "me/lora")' in card
        assert "--lora_rank 4" in card and "tiny-opt" in card


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """tiny-opt with hidden 256: every linear weight splits into 2 NF4 shards (multiples of 64 x 256 weights)."""
    return make_local_model(
        tmp_path_factory.mktemp("wide") / "wide-opt",
        dropout=0.0,
        hidden_size=256,
        ffn_dim=1024,
        word_embed_proj_dim=256,
        num_attention_heads=4,
    )


@pytest.mark.parametrize("nproc", [2])  # one process: the resume below
def test_4bit_base_matches_peft_on_a_whole_tensor_nf4_base(tmp_path, wide_model, nproc):
    """--base_bits 4 under FSDP2 (2 ranks) and on one process: the losses of peft on a base whose linear weights
    torchao quantized whole, within 1e-4. (Quantizing each rank's rows on their own would give other scales, from a
    per-shard mean: weights up to 2.5e-4 apart on a 256 x 256 matrix, so another base for each rank count.)"""
    from peft import LoraConfig, get_peft_model
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    batches = step_batches(wide_model, 40)
    model = AutoModelForCausalLM.from_pretrained(wide_model, dtype=torch.float32)
    torch.manual_seed(SEED)
    model = get_peft_model(
        model, LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=list(LINEAR))
    )
    for name, module in model.named_modules():
        if name.endswith("base_layer"):
            module.weight = torch.nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    want = []
    for ids, mask, labels in batches[:6]:
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()
        want.append(loss.item())

    out = tmp_path / "out"
    per_rank = ["--batch_size", "2", "--accum_steps", "2"] if nproc else ["--batch_size", "8"]
    args = (
        COMMON
        + per_rank
        + [
            "--model",
            str(wide_model),
            "--base_bits",
            "4",
            "--end_idx",
            "40",
            "--save_every_steps",
            "2",
            "--keep_last",
            "0",
        ]
    )
    # Written in the background, as a GPU run saves by default: the live-state copy reads the NF4 base's inner tensors.
    proc = run_cli(args + ["--output_dir", str(out), "--async_save", "true"], tmp_path, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Failed to load" not in proc.stdout + proc.stderr
    got = [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]
    assert len(got) >= 4
    for step, (g, w) in enumerate(zip(got, want), 1):
        assert abs(g - w) <= 1e-4 * max(1.0, abs(w)), (step, g, w)
    saved = torch.load(out / checkpoint_name(model_tag(str(wide_model)), 0, 40, 1), weights_only=True)
    assert saved["lora"]["base_bits"] == 4 and all(".lora_" in k for k in saved[MODEL_KEY])
    if nproc:  # resumed at step 2 on one process: the base quantized again, the same bytes, the same losses
        again = tmp_path / "again"
        again.mkdir()
        step2 = checkpoint_name(model_tag(str(wide_model)), 0, 40, 1, 2)
        (again / step2).write_bytes((out / step2).read_bytes())
        resumed = run_cli(
            COMMON
            + [
                "--batch_size",
                "8",
                "--model",
                str(wide_model),
                "--base_bits",
                "4",
                "--end_idx",
                "40",
                "--output_dir",
                str(again),
                "--resume_file",
                step2,
            ],
            tmp_path,
            nproc=0,
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        tail = [r["loss"] for r in read_jsonl(again / "metrics.jsonl")]
        assert len(tail) == len(got) - 2
        for g, w in zip(tail, got[2:]):
            assert abs(g - w) <= 1e-5 * max(1.0, abs(w)), (g, w)


def _local_model(dest: Path, config) -> Path:
    """A local model folder of another architecture, with the built-in tokenizer (its ids fit the vocabulary)."""
    import shutil

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(dest)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / name, dest / name)
    return dest


@pytest.mark.parametrize(
    "arch,layers_adapted,strategy", [("gpt2", 4 * 2, "SHARD_GRAD_OP"), ("llama", 7 * 2, "NO_SHARD")]
)
def test_lora_on_gpt2_and_llama_blocks(tmp_path, arch, layers_adapted, strategy):
    """The default targets are found inside the blocks the wrap policy finds (GPT-2's Conv1D layers, Llama's seven
    projections); 2 ranks train them (with the held-out evaluation at the save), and the exported adapter loads with
    peft on the base, changing its output."""
    from peft import PeftModel
    from transformers import GPT2Config, LlamaConfig

    vocab = AutoTokenizer.from_pretrained(ASSETS).vocab_size + 8
    config = (
        GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=vocab, n_positions=128)
        if arch == "gpt2"
        else LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=vocab,
            max_position_embeddings=128,
        )
    )
    base = _local_model(tmp_path / f"tiny-{arch}", config)
    out, export = tmp_path / "out", tmp_path / "adapter"
    proc = run_cli(
        [
            "--model",
            str(base),
            "--dataset",
            "python-docs",
            "--end_idx",
            "24",
            "--max_length",
            "64",
            "--batch_size",
            "2",
            "--lr",
            "1e-2",
            "--precision",
            "fp32",
            "--lora_rank",
            "4",
            "--output_dir",
            str(out),
            "--export_hf",
            str(export),
            "--export_dtype",
            "fp32",
            "--eval_rows",
            "8",
            "--sharding_strategy",
            strategy,
        ],
        tmp_path,
        nproc=2,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"on {layers_adapted} layers" in proc.stdout
    (evaluation,) = read_jsonl(out / "eval.jsonl")
    assert 0 < evaluation["loss"] < 20
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(export)).eval()
    ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
    assert (adapted - plain).abs().max().item() > 1e-4


@pytest.mark.parametrize("nproc,precision", [(1, "fp16"), (2, "fp32"), (2, "fp16")])
def test_generation_merges_the_adapters_into_the_gathered_copies_only(tmp_path, nproc, precision):
    """GRPO generates with each LoRA layer's adapters merged into the gathered copy of its weight (one matmul a layer:
    a decoding step is bound by its kernel launches). Inside, the logits are the unmerged model's within rounding and
    greedy completions are those generated on the shards (nothing merged), computed with FSDP's forward hooks off;
    after, every layer is unmerged, the hooks are back, and the logits and every sharded weight are what they were,
    bit for bit."""
    proc = launch([str(ROOT / "tests" / "workers" / "merged_generation.py"), precision], [], tmp_path, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["layers"] == 12 and r["merged"] == 12 and r["cleared"], r  # 2 blocks x 6 linear layers
    assert r["inside_max_diff"] <= (2e-3 if precision == "fp16" else 1e-5), r
    assert r["after_equal"] and r["weights_equal"] and r["same_completions"], r
    before, inside, after = r["hooks"]
    assert before == after and before >= 2 * 3 and inside == before - 2 * 3, r  # 3 units, FSDP's 2 hooks each: off
