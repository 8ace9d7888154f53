"""Communication per step counted on gloo equals the plan's formula; the step-time model and what auto picks."""

from __future__ import annotations

import json

from conftest import ROOT, launch, plan_cli

from fsdp_opt.base import GIB
from fsdp_opt.model.shapes import Shape, model_config
from fsdp_opt.planner.inputs import Inputs
from fsdp_opt.planner.layout import choose_layout
from fsdp_opt.planner.steptime import Rates, candidates, comm_bytes, fastest_that_fits, step_time

CONFIGS = [
    "FULL_SHARD:false:true:fp32",
    "FULL_SHARD:true:true:fp32",
    "SHARD_GRAD_OP:false:true:fp32",
    "SHARD_GRAD_OP:true:false:fp32",
    "NO_SHARD:false:true:fp32",
    "FULL_SHARD:true:true:fp16",
]


def test_collective_bytes_counted_on_gloo_equal_the_formula(tmp_path):
    out = tmp_path / "comm.json"
    proc = launch([str(ROOT / "tests" / "workers" / "comm_bytes.py")], [str(out), *CONFIGS], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"comm.json.rank{r}").read_text()) for r in range(2)]
    shape = Shape.of(model_config("tiny-opt"))
    for item in CONFIGS:
        strategy, every, _, precision = item.split(":")
        inputs = Inputs(
            gpus=2,
            batch_size=2,
            max_length=64,
            accum_steps=3,
            precision=precision,
            reduce_every_microbatch=every == "true",
        )
        want = {
            k: v
            for k, v in comm_bytes(shape, strategy, inputs).items()
            if k in ("all_gather", "reduce_scatter", "all_reduce") and v
        }
        for rep in ranks:
            assert rep[item] == want, (item, rep[item], want)
    # Independent of the formula: accumulating without sync reduce-scatters 1 of 3 micro-batches' fp32 gradients.
    assert (
        ranks[0]["FULL_SHARD:true:true:fp32"]["reduce_scatter"]
        == 3 * ranks[0]["FULL_SHARD:false:true:fp32"]["reduce_scatter"]
    )
    assert ranks[0]["FULL_SHARD:false:true:fp32"]["reduce_scatter"] == 4 * shape.params
    # fp16 gathers half the bytes of fp32; gradients are reduced in fp32 either way.
    assert (
        2 * ranks[0]["FULL_SHARD:true:true:fp16"]["all_gather"] == ranks[0]["FULL_SHARD:true:true:fp32"]["all_gather"]
    )
    assert (
        ranks[0]["FULL_SHARD:true:true:fp16"]["reduce_scatter"]
        == ranks[0]["FULL_SHARD:true:true:fp32"]["reduce_scatter"]
    )


def test_step_time_model_and_auto_pick_for_opt_1_3b():
    shape = Shape.of(model_config("facebook/opt-1.3b"))
    t4 = Inputs(gpus=2, gpu_memory=15 * GIB, batch_size=4, max_length=512, accum_steps=16, precision="fp16")
    # 6N + 12*L*H*Q*T at T=512 is about 8.17 GFLOP per token for opt-1.3b (the published figure).
    base = 6 * shape.flop_params + 12 * shape.layers * shape.hidden * 512
    assert abs(base / 8.17e9 - 1) < 0.01
    t = step_time(shape, "FULL_SHARD", Inputs(**{**t4.__dict__, "reduce_every_microbatch": True}))
    assert t["hardware_flops_per_token"] > base  # checkpointing recomputes the blocks' forward
    assert abs(t["compute_s"] - 4 * 512 * 16 * t["hardware_flops_per_token"] / 24e12) < 1e-9
    wire = comm_bytes(shape, "FULL_SHARD", Inputs(**{**t4.__dict__, "reduce_every_microbatch": True}))["wire"]
    assert abs(t["communication_s"] - wire / 3.2e9) < 1e-9
    # On 15 GiB T4s only FULL_SHARD reducing every micro-batch fits; auto takes it.
    pick = fastest_that_fits(shape, t4, ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
    assert (pick["strategy"], pick["reduce_every_microbatch"]) == ("FULL_SHARD", True)
    # With 80 GiB everything fits and the fastest is taken: every fitting option is at least as slow.
    big = Inputs(**{**t4.__dict__, "gpu_memory": 80 * GIB})
    options = candidates(shape, big, ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
    pick = fastest_that_fits(shape, big, ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
    assert all(o["fits"] for o in options) and all(pick["step_s"] <= o["step_s"] for o in options)
    assert not pick["reduce_every_microbatch"]  # fewer bytes for the same compute
    # A faster link makes communication cheaper: the prediction moves with the rate.
    fast = step_time(shape, "FULL_SHARD", t4, Rates(link_gbps=64.0))
    assert fast["communication_s"] < step_time(shape, "FULL_SHARD", t4)["communication_s"] / 19


def test_plan_json_carries_bytes_and_predicted_time():
    plan = json.loads(plan_cli(["--json", "--link_gbps", "6.4"]).stdout)
    for name, s in plan["strategies"].items():
        assert s["comm_bytes_per_step"]["wire"] >= 0 and s["predicted_step_time_s"] > 0, name
    assert plan["auto_pick"]["fits"] and plan["auto_pick"] == plan["configurations"][0]
    bad = plan_cli(["--link_gbps", "0"])
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --link_gbps 0.0: must be more than 0"


def test_trainer_resolves_auto_as_on_a_t4():
    """The CUDA-only branch of the trainer's choice, given a T4's memory and name (no GPU here)."""
    import torch

    from fsdp_opt.config.parse import parse_args
    from fsdp_opt.runtime.distributed import DistEnv

    env = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"))
    t4 = (15 * GIB, "Tesla T4")
    args = ["--sharding_strategy", "auto", "--batch_size", "4", "--accum_steps", "16", "--max_length", "512"]
    config = parse_args(args)
    layout = choose_layout(config, env, model_config("facebook/opt-1.3b"), "fp16", 16, gpu=t4)
    prediction = layout.prediction
    assert layout.strategy == "FULL_SHARD" and layout.reduce_each_microbatch is True
    assert config.parallel.sharding_strategy == "AUTO"  # the flags are read, never rewritten
    assert prediction["tflops"] == 24.0 and prediction["step_s"] > prediction["compute_s"]
    # An explicit choice is kept; on an 80 GiB H100 without sync, at 40% of its peak.
    config = parse_args(["--sharding_strategy", "SHARD_GRAD_OP", "--reduce_every_microbatch", "false", *args[2:]])
    layout = choose_layout(config, env, model_config("facebook/opt-1.3b"), "bf16", 16, gpu=(80 * GIB, "NVIDIA H100"))
    prediction = layout.prediction
    assert layout.strategy == "SHARD_GRAD_OP" and layout.reduce_each_microbatch is False
    assert abs(prediction["tflops"] - 0.4 * 989) < 1e-6
    # One micro-batch per step with an explicit --reduce_every_microbatch: one mode, nothing to choose.
    config = parse_args(["--reduce_every_microbatch", "true", "--batch_size", "4", "--max_length", "512"])
    prediction = choose_layout(config, env, model_config("facebook/opt-1.3b"), "fp16", 1, gpu=t4).prediction
    assert prediction["strategy"] == "FULL_SHARD" and prediction["fits"]
    # Without a GPU: FULL_SHARD, no prediction.
    config = parse_args(args)
    layout = choose_layout(config, env, model_config("tiny-opt"), "fp32", 16)
    assert (layout.reduce_each_microbatch, layout.prediction) == (False, None)
    assert layout.strategy == "FULL_SHARD"


def test_the_trainer_warns_before_the_first_step_when_the_plan_says_the_flags_do_not_fit(capsys):
    """Flags whose every layout the memory plan puts over the GPU's memory: one warning before the model is built,
    naming the plan's peak and what fits (LoRA on one T4; --batch_size auto where it finds a layout); none for the
    README's Kaggle command on two T4s."""
    import torch

    from fsdp_opt.config.parse import parse_args
    from fsdp_opt.planner.memory import memory, peak_bytes
    from fsdp_opt.runtime.distributed import DistEnv

    t4, opt = (int(14.56 * GIB), "Tesla T4"), model_config("facebook/opt-1.3b")

    def warnings(world: int, *flags: str) -> list[str]:
        env = DistEnv(rank=0, world_size=world, local_rank=0, local_world_size=world, device=torch.device("cpu"))
        config = parse_args([*flags, "--max_length", "512"])
        choose_layout(config, env, opt, "fp16", config.train.accum_for(world), gpu=t4)
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]

    (line,) = warnings(1, "--batch_size", "4", "--accum_steps", "2")
    # The peak the plan gives FULL_SHARD on one rank, reducing every micro-batch (the smaller of the two modes).
    one = Inputs(
        gpus=1,
        gpu_memory=t4[0],
        batch_size=4,
        accum_steps=2,
        max_length=512,
        precision="fp16",
        reduce_every_microbatch=True,
    )
    want = peak_bytes(memory(Shape.of(opt), "FULL_SHARD", one)) / GIB
    assert f"peak for these flags is {want:.2f} GiB per GPU" in line and "over the 14.56 GiB this GPU has" in line
    assert "full fine-tuning does not fit 1 x 14.56 GiB; --lora_rank 16 fits" in line
    assert warnings(2, "--batch_size", "4", "--accum_steps", "16") == []
    (line,) = warnings(2, "--batch_size", "8", "--accum_steps", "8")
    assert "--batch_size auto fits it (micro-batch" in line
