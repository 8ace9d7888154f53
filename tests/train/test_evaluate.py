"""`python -m fsdp_opt.evaluate`: base vs checkpoints under torchrun with FSDP, against Hugging Face references."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_clean_failure, launch, run_cli

TRAIN = [
    "--dataset",
    "python-docs",
    "--start_idx",
    "0",
    "--end_idx",
    "40",
    "--max_length",
    "64",
    "--batch_size",
    "2",
    "--lr",
    "3e-3",
    "--num_epochs",
    "2",
    "--precision",
    "fp32",
    "--output_dir",
    "out",
]


def evaluate(tmp, args, nproc=0, real=False):
    return launch(["-m", "fsdp_opt.evaluate"], args, tmp, nproc, timeout=600, real=real)


def hf_reference(model, tokenizer, texts, max_length, prompts, max_new_tokens):
    """One process, no FSDP: the model's own loss on each row alone (cut into max_length pieces, as --packing docs
    does), and greedy generate()."""
    from conftest import loss_alone, row_pieces

    total, tokens = loss_alone(model, row_pieces(tokenizer, texts, max_length))
    with torch.no_grad():
        outs = []
        for p in prompts:
            enc = tokenizer(p, return_tensors="pt")
            out = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            outs.append(tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    return total / tokens, tokens, outs


def test_base_vs_checkpoints_match_reference(tmp_path, det_model):
    train = run_cli(
        ["--model", str(det_model), *TRAIN, "--export_hf", "out/export", "--export_dtype", "fp32"], tmp_path, nproc=2
    )
    assert train.returncode == 0, train.stdout + train.stderr
    proc = evaluate(
        tmp_path,
        [
            "--checkpoints",
            "tiny_det_0-40-epoch-1.pt",
            "latest",
            "--output_dir",
            "out",
            "--eval_rows",
            "11",
            "--batch_size",
            "3",
            "--max_new_tokens",
            "8",
            "--num_prompts",
            "2",
            "--json",
            "report.json",
        ],
        nproc=2,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["rows"] == "[40, 51)" and report["world_size"] == 2
    names = [m["name"] for m in report["models"]]
    assert names == [f"base ({det_model})", "tiny_det_0-40-epoch-1.pt", "tiny_det_0-40-epoch-2.pt"]
    base, epoch1, epoch2 = report["models"]
    assert max(epoch1["loss"], epoch2["loss"]) < base["loss"]  # training on the slice helps on the next rows
    assert epoch1["loss"] != epoch2["loss"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_opt.data.formats import held_out_texts
    from fsdp_opt.data.sources import load_rows

    texts, end = held_out_texts(load_rows("python-docs"), "text", 40, 11)
    assert end == 51
    prompts = [s["prompt"] for s in report["samples"]]
    assert prompts == [" ".join(t.split()[:12]) for t in texts[:2]]
    tok = AutoTokenizer.from_pretrained(det_model)
    for entry, folder in ((base, det_model), (epoch2, tmp_path / "out" / "export")):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        loss, tokens, outs = hf_reference(model, tok, texts, 64, prompts, 8)
        assert entry["tokens"] == tokens
        assert entry["loss"] == pytest.approx(loss, rel=1e-5)
        assert [s["outputs"][entry["name"]] for s in report["samples"]] == outs
    # The table on stdout, as the notebook shows it.
    assert f"| tiny_det_0-40-epoch-2.pt | {epoch2['loss']:.4f} | {epoch2['perplexity']:.2f} |" in proc.stdout

    # One process, plain python, an exported folder as a candidate: the same numbers.
    single = evaluate(
        tmp_path,
        [
            "--checkpoints",
            "out/export",
            "--no_base",
            "--eval_rows",
            "11",
            "--model",
            str(det_model),
            "--start_idx",
            "40",
            "--max_length",
            "64",
            "--dataset",
            "python-docs",
            "--json",
            "single.json",
        ],
    )
    assert single.returncode == 0, single.stdout + single.stderr
    (only,) = json.loads((tmp_path / "single.json").read_text())["models"]
    assert only["name"] == "export" and only["loss"] == pytest.approx(epoch2["loss"], rel=1e-5)


def test_evaluate_bad_input(tmp_path):
    proc = evaluate(tmp_path, ["--checkpoints", "nope.pt", "--output_dir", "out"], nproc=2)
    assert_clean_failure(proc, "--checkpoints nope.pt", "not found")
    proc = evaluate(tmp_path, ["--checkpoints", "--model", "tiny-opt", "--dataset", "python-docs"])
    assert_clean_failure(proc, "--start_idx", "needed")
    proc = evaluate(tmp_path, ["--eval_rows", "0"])
    assert_clean_failure(proc, "--eval_rows 0")
    # a flag of another method than the one scored: the trainer's line, not a flag dropped unseen
    proc = evaluate(tmp_path, ["--checkpoints", "--model", "tiny-opt", "--method", "sft", "--beta", "0.2"])
    assert_clean_failure(proc, "--beta: only with --method")


def test_lora_checkpoint_evaluates_as_peft_on_its_base(tmp_path, det_model):
    """A LoRA checkpoint is evaluated as its adapters on the base (read again, checked by fingerprint): the loss,
    token count and greedy continuations of peft's model from the exported adapter folder."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_opt.data.formats import held_out_texts
    from fsdp_opt.data.sources import load_rows

    train = run_cli(
        [
            "--model",
            str(det_model),
            *TRAIN,
            "--lora_rank",
            "4",
            "--lr",
            "1e-2",
            "--num_epochs",
            "1",
            "--export_hf",
            "out/adapter",
            "--export_dtype",
            "fp32",
        ],
        tmp_path,
        nproc=2,
    )
    assert train.returncode == 0, train.stdout + train.stderr
    proc = evaluate(
        tmp_path,
        [
            "--checkpoints",
            "latest",
            "--output_dir",
            "out",
            "--eval_rows",
            "11",
            "--max_new_tokens",
            "6",
            "--num_prompts",
            "1",
            "--json",
            "report.json",
        ],
        nproc=2,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    base, adapted = json.loads((tmp_path / "report.json").read_text())["models"]
    texts, _ = held_out_texts(load_rows("python-docs"), "text", 40, 11)
    report = json.loads((tmp_path / "report.json").read_text())
    prompts = [s["prompt"] for s in report["samples"]]
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(det_model, dtype=torch.float32), str(tmp_path / "out" / "adapter")
    ).eval()
    loss, tokens, outs = hf_reference(peft, AutoTokenizer.from_pretrained(det_model), texts, 64, prompts, 6)
    assert adapted["tokens"] == tokens and adapted["loss"] == pytest.approx(loss, rel=1e-5)
    assert [s["outputs"][adapted["name"]] for s in report["samples"]] == outs
    assert adapted["loss"] < base["loss"]
