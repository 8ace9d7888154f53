"""`plan --simulate`: the engine's step on fake tensors measures the same bytes as on real tensors, and the plan's
exact rows equal what the step holds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, plan_cli

from fsdp_opt.model.shapes import Shape, model_config
from fsdp_opt.planner.generation import generation_memory, generation_time
from fsdp_opt.planner.inputs import Inputs

# One process: a fake process group of 2 ranks (rank 0), the same step on fake tensors, then on real ones.
SCRIPT = """
import json, sys
from fsdp_opt.model.shapes import Shape, model_config
from fsdp_opt.planner.inputs import Inputs
from fsdp_opt.planner.memory import memory
from fsdp_opt.planner.simreport import compare
from fsdp_opt.planner.simulate import simulate
out = {}
for strategy, every in (("FULL_SHARD", False), ("SHARD_GRAD_OP", True)):
    inputs = Inputs(gpus=2, batch_size=2, max_length=64, accum_steps=4, precision="fp16", reduce_every_microbatch=every,
                    loss_chunk_tokens=48 if every else 0, cuda=False)
    fake = simulate("tiny-opt", inputs, strategy, fake=True)
    real = simulate("tiny-opt", inputs, strategy, fake=False)
    planned = memory(Shape.of(model_config("tiny-opt")), strategy, inputs)
    out[strategy] = {"fake": fake, "real": real, "planned": planned, "rows": compare(fake, planned),
                     "params": Shape.of(model_config("tiny-opt")).params}
# The mask --packing docs attends through, without activation checkpointing: the same step packed end to end.
masks = {}
for packing in ("concat", "docs"):
    inputs = Inputs(gpus=2, batch_size=2, max_length=64, accum_steps=2, precision="fp16", packing=packing,
                    activation_checkpointing=False, cuda=False)
    masks[packing] = {"groups": simulate("tiny-opt", inputs, "FULL_SHARD")["groups"],
                      "planned": memory(Shape.of(model_config("tiny-opt")), "FULL_SHARD", inputs)["attention_mask"]}
out["masks"] = masks
print(json.dumps(out))
"""


def test_fake_step_measures_what_a_real_step_holds_and_the_plan_agrees():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    masks = result.pop("masks")
    # By hand: the boolean [2, 1, 64, 64] mask, plus the fp16 copy SDPA makes of it and saves in each of the 4
    # blocks; the simulated step also holds the int64 [2, 64] position_ids, which the plan leaves out.
    mask = 2 * 64 * 64 + 4 * 2 * 64 * 64 * 2
    held = lambda packing: masks[packing]["groups"]["activations_and_logits"]  # noqa: E731
    assert held("docs") - held("concat") == mask + 2 * 64 * 8
    assert masks["docs"]["planned"] == mask and masks["concat"]["planned"] == 0
    for strategy, r in result.items():
        fake, real, planned, rows = r["fake"], r["real"], r["planned"], r["rows"]
        # The simulation itself: fake tensors count the bytes real tensors hold, group by group and at the peak.
        assert fake["groups"] == real["groups"], strategy
        assert fake["peak_total"] == real["peak_total"], strategy
        # Exact rows: sharded fp32 weights and gradients, Adam's two moments (the plan rounds each shard up).
        for row in ("parameters", "gradients", "optimizer"):
            assert abs(rows[row]["simulated"] - planned[row]) <= 64, (strategy, row, rows[row])
        n = r["params"]
        assert fake["groups"]["parameters"] >= 4 * n // 2
        if strategy == "FULL_SHARD":  # no sync between micro-batches: one unsharded fp32 gradient of every weight
            assert fake["groups"]["accumulated_gradients"] == 4 * n == planned["accumulated_gradients"]
        else:  # reduce-scattered after every micro-batch: nothing held between them
            assert fake["groups"]["accumulated_gradients"] == 0 == planned["accumulated_gradients"]
        assert abs(rows["gathered_weights"]["ratio"] - 1.0) <= 0.12, (strategy, rows)
        # The plan is an upper bound: it adds each component's own peak (at this tiny shape by up to 27%; at opt-1.3b 6-10%).
        assert 1.0 <= rows["total"]["ratio"] <= 1.35, (strategy, rows["total"])


def test_simulate_names_a_bad_strategy():
    proc = plan_cli(["--model", "tiny-opt", "--simulate", "FULL_SHARD,ZERO3"])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --simulate FULL_SHARD,ZERO3: ZERO3 is not one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD"
    ], proc.stderr


def test_dpo_plans_for_opt_1_3b_on_two_t4s_and_the_simulation_agrees():
    """--method dpo for opt-1.3b on 2x T4: full fine-tuning (with its reference pass: a model of its own, sharded in
    fp16) and LoRA (the base with its adapters off). The reference pass's rows are the hand-computed bytes; the
    simulated step and the simulated reference pass agree with the plan within 10%, and so does LoRA's step."""
    full = json.loads(
        plan_cli(
            [
                "--model",
                "facebook/opt-1.3b",
                "--method",
                "dpo",
                "--batch_size",
                "auto",
                "--global_batch",
                "128",
                "--simulate",
                "--json",
            ]
        ).stdout
    )
    ref = full["dpo"]
    assert ref["strategy"] == "FULL_SHARD" and not ref["own_model"] and ref["fits"]
    n, vocab, s, b = full["shape"]["params"], full["shape"]["vocab"], 512, full["inputs"]["batch_size"]
    parts = ref["components"]
    assert parts["parameters"] == 2 * -(-n // 2)  # fp16, half on each GPU
    # OPT's head is a plain projection: the loss runs it (HeadLoss), so the fp16 logits are a temporary, freed as their
    # fp32 copy is made; the copy and its log-softmax remain
    assert parts["logits"] == s * b * vocab * (4 + 4)
    assert parts["root_at_loss"] == 2 * full["shape"]["root_params"]
    assert ref["seconds_per_1000_pairs"] > 0
    assert abs(ref["simulated"]["ratio"] - 1) <= 0.10, ref["simulated"]
    step = full["simulated"]["FULL_SHARD"]["comparison"]["total"]
    assert abs(step["ratio"] - 1) <= 0.10, step
    assert full["recommended"] is not None  # something fits, and the plan names it
    lora = json.loads(
        plan_cli(
            [
                "--model",
                "facebook/opt-1.3b",
                "--method",
                "dpo",
                "--lora_rank",
                "16",
                "--batch_size",
                "auto",
                "--global_batch",
                "128",
                "--simulate",
                "FULL_SHARD",
                "--json",
            ]
        ).stdout
    )
    assert lora["dpo"]["own_model"] and "components" not in lora["dpo"] and lora["strategies"]["FULL_SHARD"]["fits"]
    step = lora["simulated"]["FULL_SHARD"]["comparison"]["total"]
    print("LoRA DPO step, plan / simulated:", step["ratio"], "at batch", lora["inputs"]["batch_size"])
    assert abs(step["ratio"] - 1) <= 0.10, step
    text = plan_cli(["--model", "facebook/opt-1.3b", "--method", "dpo", "--lora_rank", "16"]).stdout
    assert (
        "dpo reference pass: the run's own model with its adapters off, before training: no memory beyond "
        "training's" in text
    )


def test_grpo_plans_generation_for_qwen_on_two_t4s_and_the_simulation_agrees():
    """docs/grpo.md's command: --method grpo for Qwen2.5-1.5B-Instruct with LoRA rank 16 on 2x T4, 8 completions of
    256 tokens per prompt (the defaults), 64 completions per step (8 prompts, 4 per GPU). The KV cache is the published shape's (28 layers, 2 KV heads of
    128), the gathered model is the whole fp16 model plus its adapters; the simulated generation phase on FULL_SHARD
    (the model gathered by the engine's own `gathered`, a prefill filling the cache) agrees with the plan within 10%.
    Generating layer by layer on FULL_SHARD gathers the model for every token: less memory, slower."""
    plan = json.loads(
        plan_cli(
            [
                "--model",
                "Qwen/Qwen2.5-1.5B-Instruct",
                "--method",
                "grpo",
                "--lora_rank",
                "16",
                "--batch_size",
                "8",
                "--accum_steps",
                "4",
                "--simulate",
                "--json",
            ]
        ).stdout
    )
    g = plan["grpo"]
    assert (g["generations"], g["completion_length"], plan["inputs"]["max_length"]) == (8, 256, 512)  # the defaults
    assert g["requests_per_rank"] == 32
    gathered = g["gathered"]
    assert gathered["components"]["kv_cache"] == 32 * 512 * 28 * 2 * (2 * 128) * 2
    assert gathered["components"]["gathered_weights"] == 2 * (plan["shape"]["params"] + plan["adapter_params"])
    assert gathered["fits"] and g["uses"] == "gathered"
    assert g["step_s"] == gathered["seconds"] + g["training_s"] and g["training_s"] > 0  # beta 0: no reference
    sim = g["simulated"]
    print("GRPO generation, plan / simulated:", sim["ratio"])
    assert sim["strategy"] == "FULL_SHARD" and abs(sim["ratio"] - 1) <= 0.10, sim
    shape = Shape.of(model_config("Qwen/Qwen2.5-1.5B-Instruct"))
    inputs = Inputs(gpus=2, max_length=512, lora_rank=16, cuda=True)
    once = generation_time(shape, "FULL_SHARD", inputs, 32, 256, gathered=True)
    layered = generation_time(shape, "FULL_SHARD", inputs, 32, 256, gathered=False)
    assert layered["gather_s"] == pytest.approx(257 * once["gather_s"]) and layered["seconds"] > once["seconds"]
    assert sum(generation_memory(shape, "FULL_SHARD", inputs, 32, gathered=False).values()) < sum(
        generation_memory(shape, "FULL_SHARD", inputs, 32, gathered=True).values()
    )
    # Qwen3-1.7B (tied embeddings, 8 KV heads), a KL term: full fine-tuning keeps a reference model beside the policy.
    qwen3 = json.loads(
        plan_cli(
            [
                "--model",
                "Qwen/Qwen3-1.7B",
                "--method",
                "grpo",
                "--beta",
                "0.04",
                "--batch_size",
                "4",
                "--accum_steps",
                "8",
                "--json",
            ]
        ).stdout
    )
    parts = qwen3["grpo"]["gathered"]["components"]
    assert parts["reference"] == 2 * -(-qwen3["shape"]["params"] // 2) and qwen3["grpo"]["reference_s"] > 0
    assert parts["kv_cache"] == 32 * 512 * 28 * 2 * (8 * 128) * 2
