"""fp16 at real width for architectures trained in bf16: Gemma 2 and 3 (their embeddings scaled by sqrt(hidden), their
soft-caps) and Qwen2.5 (biased attention projections), at their published hidden, head and MLP sizes with random
weights, two layers and a small vocabulary. What this can show: the architecture's own fixed scalings do not overflow
fp16 at that width, and fp16 tracks fp32. What it cannot: a trained checkpoint's outlier activations (Qwen's are
known to be large), which random weights do not have; the fp16 probe at the start of a run watches for those."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import ASSETS, read_jsonl, run_cli
from transformers import AutoModelForCausalLM

from fsdp_opt.data.builtins import python_docs_texts
from fsdp_opt.model.catalog import SHAPES, catalog_config
from fsdp_opt.model.parallelize import fp32_products_on_cpu


@pytest.mark.parametrize("name", ["google/gemma-2-2b", "google/gemma-3-1b-pt", "Qwen/Qwen2.5-1.5B"])
def test_fp16_stays_finite_and_tracks_fp32_at_real_width(name):
    config = catalog_config(name)
    config.num_hidden_layers, config.vocab_size = 2, 4104
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[4:6] if "gemma-3" in name else config.layer_types[:2]
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(4, 4104, (1, 32))
    with torch.no_grad():
        full = model(input_ids=ids).logits.float()
        half = model.half()(input_ids=ids).logits.float()
    assert torch.isfinite(half).all()
    loss32 = F.cross_entropy(full[0, :-1], ids[0, 1:]).item()
    loss16 = F.cross_entropy(half[0, :-1], ids[0, 1:]).item()
    assert abs(loss16 - loss32) < 0.02 * loss32, (loss16, loss32)
    assert SHAPES[name][1]["hidden_size"] == config.hidden_size  # the real width, not a toy one


def bf16_model_at_real_width(dest: Path, name: str) -> Path:
    """One decoder layer of the catalogued shape at its real width, a 4096-token vocabulary (the built-in tokenizer's),
    random weights, its config saying bfloat16 as the published one does: a local folder the trainer loads."""
    config = catalog_config(name)
    config.num_hidden_layers, config.vocab_size = 1, 4096
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 0, 2, 1
    layer_types = getattr(config, "layer_types", None) or []
    config.layer_types = ["sliding_attention" if "sliding_attention" in layer_types else "full_attention"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(dest)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / file, dest / file)
    return dest


@pytest.mark.parametrize("name", ["google/gemma-2-2b", "Qwen/Qwen2.5-1.5B"])
def test_the_trainer_in_fp16_at_real_width_probes_then_trains_without_overflow(tmp_path, name):
    """The trainer's own fp16 path at real width: FSDP2 with fp16 compute, dynamic loss scaling, the overflow probe on
    the first batch (the config says bfloat16) and the skip watch. Gemma 2 is the hardest case (embedding scaled by
    sqrt(2304), attention and final soft-caps); Qwen2.5 has biased q/k/v projections. (One layer, 16-token blocks,
    four steps; on CPU the linear layers' products run in fp32 and round to fp16, as torch's half kernel rounds.)"""
    model = bf16_model_at_real_width(tmp_path / "model", name)
    texts = [t.split(".")[0][:60] for t in python_docs_texts()[:4]]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    proc = run_cli(
        [
            "--model",
            str(model),
            "--dataset",
            str(data),
            "--max_length",
            "16",
            "--packing",
            "pad",
            "--batch_size",
            "1",
            "--num_epochs",
            "1",
            "--lr",
            "1e-5",
            "--precision",
            "fp16",
            "--device",
            "cpu",
            "--save_optimizer",
            "false",
            "--output_dir",
            str(tmp_path / "out"),
        ],
        tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    probe = [l for l in proc.stdout.splitlines() if l.startswith("fp16 probe: ")]
    assert len(probe) == 1 and "pretrained in bfloat16; its first batch is finite in fp16" in probe[0], proc.stdout
    assert "warning" not in proc.stdout
    steps = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert len(steps) == 4 and all(math.isfinite(s["loss"]) for s in steps)
    # The loss scale starts at 65,536 and halves while the gradients overflow: only the first steps may be skipped,
    # and every step after the first one that goes through trains.
    skipped = [s["skipped"] for s in steps]
    calibration = skipped.index(False)
    assert calibration <= 2 and not any(skipped[calibration:]), steps


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_half_linears_round_as_torchs_half_kernel_at_fp32_speed(dtype):
    """model.parallelize.fp32_products_on_cpu: a CPU half run's nn.Linear layers compute in fp32 and round once, as
    torch's own CPU half kernel does (it accumulates in fp32 too): outputs and gradients agree with that kernel to its
    rounding, and are as close to a float64 reference as its are. fp32 inputs keep nn.Linear's own path."""
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(96, 40), torch.nn.Linear(40, 24, bias=False))
    theirs = torch.nn.Sequential(torch.nn.Linear(96, 40), torch.nn.Linear(40, 24, bias=False))
    theirs.load_state_dict(ours.state_dict())
    exact = torch.nn.Sequential(torch.nn.Linear(96, 40), torch.nn.Linear(40, 24, bias=False)).double()
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    exact.load_state_dict({k: v.double() for k, v in theirs.state_dict().items()})  # the half values, exactly
    assert fp32_products_on_cpu(ours, torch.device("cpu"), "fp32") == 0  # fp32 runs keep nn.Linear's path
    assert fp32_products_on_cpu(ours, torch.device("cpu"), "fp16" if dtype == torch.float16 else "bf16") == 2
    x = torch.randn(3, 7, 96).to(dtype)
    grads = {}
    for name, model in (("ours", ours), ("theirs", theirs), ("exact", exact)):
        inp = x.to(torch.float64 if name == "exact" else dtype).detach().clone().requires_grad_()
        out = model(inp)
        assert (type(out.grad_fn).__name__ == "_HalfLinearBackward") == (name == "ours")  # ours: the fp32 products
        out.float().square().sum().backward()
        grads[name] = [out.double(), inp.grad.double()] + [p.grad.double() for p in model.parameters()]
        assert out.dtype == inp.dtype and all(p.grad.dtype == p.dtype for p in model.parameters())
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    for o, t, e in zip(grads["ours"], grads["theirs"], grads["exact"]):
        scale = e.abs().max().item()
        assert (o - t).abs().max().item() <= 4 * ulp * scale  # the same rounding, up to summation order
        assert (o - e).abs().max().item() <= 1.5 * (t - e).abs().max().item() + ulp * scale
    plain = torch.nn.Linear(8, 4)
    fp32_products_on_cpu(plain, torch.device("cpu"), "fp16")
    y = torch.randn(2, 8)
    assert torch.equal(plain(y), torch.nn.functional.linear(y, plain.weight, plain.bias))
