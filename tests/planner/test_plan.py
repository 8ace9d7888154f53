"""`python -m fsdp_opt.plan`: exact parameter counts from configs, the memory and disk arithmetic, bad input."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time

import pytest
from conftest import ROOT, make_local_model, plan_cli

from fsdp_opt.base import GIB, parse_size
from fsdp_opt.model.shapes import Shape, model_config
from fsdp_opt.model.sources import OPT_FAMILY
from fsdp_opt.planner.generation import (
    CAPTURE_S,
    GRAPH_S_PER_BLOCK,
    HOST_S_PER_ADAPTER,
    HOST_S_PER_BLOCK,
    HOST_S_PER_NF4,
    SAMPLER_S,
    Phase,
    generation_time,
    grpo_plan,
)
from fsdp_opt.planner.inputs import Inputs
from fsdp_opt.planner.memory import memory, peak_bytes, reduce_every_microbatch_needed


def test_opt_family_parameter_counts():
    # Published sizes; 1.3b's exact count is the figure the memory math starts from.
    assert Shape.of(model_config("facebook/opt-1.3b")).params == 1_315_758_080
    approx = {
        "facebook/opt-125m": 125e6,
        "facebook/opt-350m": 331e6,
        "facebook/opt-2.7b": 2.65e9,
        "facebook/opt-6.7b": 6.66e9,
    }
    for name, n in approx.items():
        assert Shape.of(model_config(name)).params == pytest.approx(n, rel=0.02), name
    assert set(approx) | {"facebook/opt-1.3b"} == set(OPT_FAMILY)


def test_units_add_up_and_local_configs_work(tmp_path):
    folder = make_local_model(tmp_path / "m")
    shape = Shape.of(model_config(str(folder)))
    assert shape.root_params + shape.layers * shape.block_params == shape.params
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert shape.params == sum(p.numel() for p in model.parameters())  # tied head counted once


def test_memory_arithmetic_for_opt_1_3b_on_two_t4():
    shape = Shape.of(model_config("facebook/opt-1.3b"))
    n = shape.params
    t4 = Inputs(gpus=2, gpu_memory=15 * GIB, batch_size=4, max_length=512, accum_steps=16, precision="fp16")
    full = memory(shape, "FULL_SHARD", t4)
    # ZeRO-3: 16 bytes per parameter split over 2 GPUs (the design figure: about 10.5 GB resident).
    assert full["parameters"] + full["gradients"] + full["optimizer"] == 16 * n // 2
    assert full["accumulated_gradients"] == 4 * n
    assert (
        memory(shape, "FULL_SHARD", Inputs(**{**t4.__dict__, "reduce_every_microbatch": True}))["accumulated_gradients"]
        == 0
    )
    # Checkpointed activations: one 2-byte hidden state per block input, plus one block's saved tensors: 34*s*b*h
    # bytes for a GeLU MLP, less the 8*s*b*h of the activation's input, which OPT's ReLU does not keep, plus the
    # 2*s*b*h of SDPA's saved output.
    assert shape.relu_mlp and not Shape.of(model_config("Qwen/Qwen2.5-0.5B")).relu_mlp
    assert full["activations"] == 24 * 512 * 4 * 2048 * 2 + (34 - 8 + 2) * 512 * 4 * 2048
    # The loss runs OPT's output layer itself (a bias-free Linear): the fp32 logits, their log-softmax and its
    # gradient; a model whose output holds its fp16 logits through backward (a head with a bias, softcapped logits)
    # adds those.
    assert shape.plain_head and full["logits"] == 512 * 4 * 50272 * 12
    assert memory(dataclasses.replace(shape, plain_head=False), "FULL_SHARD", t4)["logits"] == 512 * 4 * 50272 * 14
    # --loss_chunk_tokens 256: one chunk's logits at a time, with its fp16 gradient as well.
    assert (
        memory(shape, "FULL_SHARD", Inputs(**{**t4.__dict__, "loss_chunk_tokens": 256}))["logits"] == 256 * 50272 * 16
    )
    # --reduce_every_microbatch auto: on 15 GiB the unsharded gradient does not fit; on 80 GiB it does.
    assert reduce_every_microbatch_needed(shape, "FULL_SHARD", t4)
    assert not reduce_every_microbatch_needed(shape, "FULL_SHARD", Inputs(**{**t4.__dict__, "gpu_memory": 80 * GIB}))
    assert not reduce_every_microbatch_needed(shape, "FULL_SHARD", Inputs(**{**t4.__dict__, "accum_steps": 1}))
    # Gathered fp16 weights: the root (embeddings, positions, final norm) and two of 24 blocks, or 1 + prefetch, and
    # the gather buffer of the largest unit (the root), which outlives its copy-out until the next gather.
    assert full["gathered_weights"] == 2 * (shape.root_params + 2 * shape.block_params) + 2 * shape.root_params
    # Without sync the sharded gradients never sit beside the accumulated ones: the total leaves them out.
    assert peak_bytes(full) == sum(full.values()) - full["gradients"]
    ahead = memory(shape, "FULL_SHARD", Inputs(**{**t4.__dict__, "prefetch": 3}))["gathered_weights"]
    assert ahead - full["gathered_weights"] == 2 * 2 * shape.block_params
    assert shape.block_params == 12 * 2048**2 + 13 * 2048  # an OPT block: 4 h^2 attention + 8 h^2 MLP, biases, 2 norms

    # --packing docs (the default): the boolean [4, 1, 512, 512] mask, and SDPA's fp16 copy of it in the block
    # being recomputed (the simulation measures the rule: tests/test_simulate.py). concat needs no mask.
    assert full["attention_mask"] == 4 * 512 * 512 + 4 * 512 * 512 * 2
    assert memory(shape, "FULL_SHARD", Inputs(**{**t4.__dict__, "packing": "concat"}))["attention_mask"] == 0
    # 500 tokens: on CUDA torch pads the copy's last dimension to 504 (a multiple of 8), one copy for every head.
    odd = memory(shape, "FULL_SHARD", Inputs(**{**t4.__dict__, "max_length": 500}))["attention_mask"]
    assert odd == 4 * 500 * 500 + 4 * 500 * 504 * 2
    # Without checkpointing every block keeps its copy; eager attention gets the engine's fp32 mask once.
    off = Inputs(**{**t4.__dict__, "activation_checkpointing": False})
    assert memory(shape, "FULL_SHARD", off)["attention_mask"] == 4 * 512 * 512 + 24 * 4 * 512 * 512 * 2
    assert (
        memory(shape, "FULL_SHARD", Inputs(**{**off.__dict__, "attn_implementation": "eager"}))["attention_mask"]
        == 4 * 512 * 512 * 4
    )
    nosync = memory(shape, "NO_SHARD", t4)
    assert nosync["parameters"] == 4 * n and nosync["optimizer"] == 8 * n


def test_cli_reports_fit_and_disk(tmp_path):
    cmd = [
        "--model",
        "facebook/opt-1.3b",
        "--gpus",
        "2",
        "--gpu_memory",
        "15GiB",
        "--batch_size",
        "4",
        "--max_length",
        "512",
        "--reduce_every_microbatch",
        "--json",
    ]
    proc = plan_cli(cmd)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert list(plan["strategies"]) == ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]  # HYBRID needs 2+ nodes
    full, no = plan["strategies"]["FULL_SHARD"], plan["strategies"]["NO_SHARD"]
    assert full["fits"] and not no["fits"]
    assert full["total_bytes"] == sum(full["components"].values())
    assert full["max_micro_batch"] >= 4 and no["max_micro_batch"] == 0
    n = plan["shape"]["params"]
    assert plan["checkpoints"] == {
        "full_with_optimizer": 12 * n,
        "full_weights_only": 4 * n,
        "sharded_with_optimizer_per_rank": 6 * n,
        "export_fp16": 2 * n,
    }
    # 15.8 GB checkpoints on 20 GB: one fits, not two at once; the previous goes before a save once the Hub has it.
    assert plan["disk"]["fits"] and plan["disk"]["checkpoints_that_fit"] == 0 and plan["disk"]["needs_hub_for_room"]
    assert plan["disk"]["peak_bytes"] == 12 * n and plan["disk"]["kept_while_saving"] == 0
    assert plan["host_ram"]["gather_bytes"] == 12 * n and plan["host_ram"]["fits"]
    text = plan_cli(cmd[:-1]).stdout
    assert "| **total** |" in text
    assert "only one checkpoint fits: before each save the previous one is removed once the Hub has it" in text
    bad = plan_cli(["--gpu_memory", "lots"])
    assert (
        bad.returncode == 2
        and bad.stderr.strip() == "error: --gpu_memory 'lots': use a size such as 15GiB, 20GB or 512MiB"
    )


def test_parse_size():
    assert parse_size("15GiB", "-") == 15 * 2**30 and parse_size("20GB", "-") == 20 * 10**9
    assert (
        parse_size("31G", "-") == 31 * 2**30
        and parse_size("512MiB", "-") == 512 * 2**20
        and parse_size("100", "-") == 100
    )


def test_hub_repo_size_of_a_chain_of_ten_opt_1_3b_slices():
    """--hub_keep_full 1: one full checkpoint (12 bytes per parameter) and ten fp16 weights files (2 bytes each):
    42.1 GB, 44.7 GB with an exported model; every full checkpoint kept would be 158 GB."""
    from fsdp_opt.planner.disk import hub_repo_bytes

    shape = Shape.of(model_config("facebook/opt-1.3b"))
    n = 1_315_758_080
    kept = hub_repo_bytes(shape, slices=10, keep_full=1, export=True)
    assert kept["full_checkpoints"] == 12 * n and kept["weights_files"] == 10 * 2 * n and kept["export"] == 2 * n
    assert kept["total"] == 34 * n <= 45e9
    assert hub_repo_bytes(shape, slices=10, keep_full=0)["total"] == 120 * n  # 158 GB: the chain without retention


@pytest.mark.parametrize(
    "model,targets", [("facebook/opt-125m", None), ("facebook/opt-6.7b", None), ("facebook/opt-1.3b", "q_proj,v_proj")]
)
def test_lora_plan_counts_what_peft_adds(model, targets):
    """The planner's adapter count against peft's own: peft adds its layers to the meta model and counts them."""
    from peft import LoraConfig, get_peft_model

    from fsdp_opt.model.loader import meta_model as build_meta_model
    from fsdp_opt.planner.lora import adapter_params, checkpoints

    rank = 16
    names = targets.split(",") if targets else ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
    peft = get_peft_model(build_meta_model(model_config(model)), LoraConfig(r=rank, target_modules=names))
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    shape = Shape.of(model_config(model))
    inputs = Inputs(lora_rank=rank, lora_targets=targets)
    assert adapter_params(shape, inputs) == trainable
    assert checkpoints(shape, inputs)["full_with_optimizer"] == 12 * trainable
    parts = memory(shape, "FULL_SHARD", inputs)
    # 2 ranks: half the fp16 base and half the fp32 adapters, half their gradients and AdamW moments
    assert parts["parameters"] == pytest.approx(2 * shape.params / 2 + 4 * trainable / 2, abs=8)
    assert parts["gradients"] == pytest.approx(4 * trainable / 2, abs=4)
    assert parts["optimizer"] == pytest.approx(8 * trainable / 2, abs=8)


def test_lora_makes_opt_6_7b_fit_two_t4_and_full_fine_tuning_does_not():
    shape = Shape.of(model_config("facebook/opt-6.7b"))
    t4 = Inputs(gpus=2, gpu_memory=15 * GIB, batch_size=4, max_length=512, accum_steps=16)
    assert peak_bytes(memory(shape, "FULL_SHARD", t4)) > 60 * GIB
    lora = Inputs(**{**t4.__dict__, "lora_rank": 16})
    assert peak_bytes(memory(shape, "FULL_SHARD", lora)) < 12 * GIB
    assert peak_bytes(memory(shape, "SHARD_GRAD_OP", lora)) > 15 * GIB  # every block's fp16 weights kept gathered
    out = plan_cli(["--model", "facebook/opt-6.7b", "--lora_rank", "16", "--host_memory", "31GB", "--json"])
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["auto_pick"]["strategy"] == "FULL_SHARD" and plan["strategies"]["FULL_SHARD"]["fits"]
    assert plan["host_ram"]["fits"] and plan["checkpoints"]["full_with_optimizer"] < 0.5e9
    bad = plan_cli(["--base_bits", "4"])
    assert (
        bad.returncode == 2
        and bad.stderr.strip() == "error: --base_bits 4: only with --lora_rank (a 4-bit base is frozen)"
    )


def test_a_decoding_step_on_a_gpu_is_the_hosts_launch_time_where_reading_the_weights_is_shorter():
    """GRPO's decoding time on 2 x T4, opt-1.3b, LoRA rank 16. A T4 reads the gathered fp16 weights in 8 ms; the
    host's launches of a step take longer (the lent H200 showed 20.8 ms a step where its weights took 0.55 ms to
    read), so each step costs the host's time: per block, more for each adapted layer whose adapters are not merged
    (the NF4 base; generation on the shards), more again for each NF4 weight. The gathered 16-bit base merges its
    adapters: the same time as full fine-tuning's."""
    shape = Shape.of(model_config("facebook/opt-1.3b"))
    steps = 128

    def decode(**kw) -> float:
        gathered = kw.pop("gathered", True)
        inputs = Inputs(gpus=2, max_length=384, precision="fp16", **kw)
        return generation_time(shape, "FULL_SHARD", inputs, 16, steps, gathered=gathered)["decode_s"]

    read = 2 * shape.params / 320e9  # one step reading the fp16 weights at a T4's 320 GB/s
    assert read < shape.layers * HOST_S_PER_BLOCK
    full, merged = decode(), decode(lora_rank=16)
    assert full == pytest.approx(steps * shape.layers * HOST_S_PER_BLOCK, rel=0.02) and merged == full
    adapted = shape.layers * len(shape.linears)  # 24 blocks x 6 linear layers
    nf4 = decode(lora_rank=16, base_bits=4)
    assert nf4 - full == pytest.approx(steps * adapted * (HOST_S_PER_ADAPTER + HOST_S_PER_NF4), rel=1e-6)
    on_shards = decode(lora_rank=16, gathered=False)  # adapters beside the weights there
    assert on_shards - decode(gathered=False) == pytest.approx(steps * adapted * HOST_S_PER_ADAPTER, rel=1e-6)


def test_the_graph_path_replaces_the_hosts_launches_and_a_shared_generation_costs_its_steps_a_share():
    """--decoding graphs in the plan (2 x T4, opt-1.3b, 16 completions of 128 tokens): each decoding step costs the
    GPU's read of the weights and cache plus each block's kernels back to back and the sampler, once per generation a
    capture, written out here from the constants; the host's launches no longer count. A generation fed to 2 x 2
    steps (--steps_per_generation, --num_iterations) is sampled once for twice the prompts: a step's share is a
    quarter of it, beside the forward that keeps the old log-probabilities."""
    shape = Shape.of(model_config("facebook/opt-1.3b"))
    inputs = Inputs(gpus=2, max_length=384, precision="fp16")
    steps, requests, prompt = 128, 16, 384 - 128
    graphs = generation_time(shape, "FULL_SHARD", inputs, requests, steps, gathered=True, graphs=True)["decode_s"]
    eager = generation_time(shape, "FULL_SHARD", inputs, requests, steps, gathered=True)["decode_s"]
    kv = shape.layers * 2 * shape.kv_dim * 2
    by_hand = (
        CAPTURE_S
        + 2 * shape.layers * HOST_S_PER_BLOCK
        + sum(
            (2 * shape.params + requests * (prompt + t) * kv) / 320e9 + shape.layers * GRAPH_S_PER_BLOCK + SAMPLER_S
            for t in range(steps)
        )
    )
    assert graphs == pytest.approx(by_hand, rel=1e-3) and graphs < eager
    once = grpo_plan(shape, "FULL_SHARD", inputs, Phase(16, 8, steps), 1.0, decoding="graphs")
    shared = grpo_plan(shape, "FULL_SHARD", inputs, Phase(16, 8, steps, 2, 2), 1.0, decoding="graphs")
    assert shared["requests_per_rank"] == 2 * once["requests_per_rank"] and once["old_logps_s"] == 0
    generation = shared["gathered"]["seconds"]
    assert shared["step_s"] == pytest.approx(1.0 + generation / 4 + shared["old_logps_s"], rel=1e-9)
    assert (
        "graph_pool" in shared["gathered"]["components"] and "graph_pool" not in shared["layer_by_layer"]["components"]
    )
    assert shared["graphs_step_s"] < shared["eager_step_s"]


def test_help_answers_before_torch_is_imported():
    """`plan --help` in under a second (a fresh Python: the package and the parser, nothing heavy); the training
    command's --help the same way (its flags come from the config, which imports no torch)."""
    for args, seconds in ((["-m", "fsdp_opt.plan", "--help"], 1.0), (["-m", "fsdp_opt", "train", "--help"], None)):
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        took = time.perf_counter() - started
        assert proc.returncode == 0 and "--model" in proc.stdout, proc.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
        assert not imported & {"torch", "transformers", "numpy"}, args
        assert seconds is None or took < seconds, (args, took)


def test_one_unit_kaggles_host_ram_whole_steps_and_the_trainers_method_check():
    distill = [
        "--model",
        "facebook/opt-350m",
        "--method",
        "distill",
        "--teacher_model",
        "facebook/opt-1.3b",
        "--batch_size",
        "4",
        "--accum_steps",
        "4",
        "--max_completion_length",
        "128",
    ]
    plan = json.loads(plan_cli([*distill, "--json"]).stdout)
    text = plan_cli(distill).stdout
    # every size in GiB: no GB or MB figure anywhere
    assert "GiB" in text and not re.search(r"\d GB\b|\d MB\b|\d MiB\b", text), text
    # the T4s' machine: Kaggle's 31 GB of host RAM, not this machine's
    assert plan["host_ram"]["host_memory"] == 31 * 10**9 and "(Kaggle's 31GB, the T4s' machine)" in text
    # the recommendation against the flags by whole steps: generation and teacher included, not training alone
    g = plan["distill"]
    assert g["training_s"] < g["step_s"] and f"than the flags given ({g['step_s']:.2f} s)" in plan["recommended_line"]
    assert "(generation, teacher included; training" in plan["recommended_line"]
    # NO_SHARD: the layer-by-layer row equals gathered-once, and says why
    assert g["strategy"] == "NO_SHARD" and g["layer_by_layer"]["seconds"] == g["gathered"]["seconds"]
    assert "the same time as gathered once: under NO_SHARD every GPU holds the whole model" in text
    # the trainer's own refusals (config.method.MethodConfig), in one line
    kto = plan_cli(["--method", "kto", "--teacher_model", "facebook/opt-1.3b"])
    assert kto.returncode == 2 and kto.stderr.strip() == "error: --teacher_model: only with --method distill"
    alone = plan_cli(["--method", "distill"])
    assert alone.returncode == 2 and alone.stderr.strip().startswith(
        "error: --teacher_model: --method distill needs the teacher"
    )
