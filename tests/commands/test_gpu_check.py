"""`python -m fsdp_opt.gpu_check` on CPU at tiny size: two launches (train, then resume on the next rows), a GRPO
launch, one table."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import run_cli_concurrently, sandbox_env


def test_gpu_check_trains_saves_resumes_and_reports(tmp_path):
    # --workdir relative to where the command runs, as a user types it
    cmd = [
        sys.executable,
        "-m",
        "fsdp_opt.gpu_check",
        "--device",
        "cpu",
        "--max_length",
        "32",
        "--batch_size",
        "2",
        "--steps",
        "3",
        "--workdir",
        "work",
        "--json",
        str(tmp_path / "check.json"),
        "--max_completion_length",
        "16",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=sandbox_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    f = json.loads((tmp_path / "check.json").read_text())
    assert f["model"] == "tiny-opt" and f["ranks"] == 2 and f["strategy"] == "FULL_SHARD"
    assert f["steps"] >= 3 and f["resumed_steps"] >= 1 and f["resumed_from_step"] == f["steps"] + 1
    assert f["useful_tokens_per_s"] > 0 and f["step_time_measured_s"] > 0
    assert f["save_s"] is not None and f["checkpoint_read_s"] is not None and f["load_into_shards_s"] is not None
    assert f["max_memory_allocated_gib"] is None and f["step_time_predicted_s"] is None  # GPU figures: none on CPU
    assert "| step time: measured / predicted |" in proc.stdout and "CPU" in proc.stdout
    assert f["cuda_context_in_this_process"] is False and f["usable_gib"] is None
    [link] = f["links"]  # gloo on CPU: one measurement (NCCL: P2P on and off)
    assert link["backend"] == "gloo" and link["world_size"] == 2 and link["all_gather_gbps"] > 0
    assert link["reduce_scatter_gbps"] > 0 and "| link (gloo) | all-gather" in proc.stdout
    assert (tmp_path / "work" / "out" / "metrics.jsonl").is_file()
    # then GRPO steps: one prompt per rank a step, 8 completions each, generated on the gathered model
    g = f["grpo"]
    assert g["steps"] == 3 and g["completions_per_step"] == 16 and g["generated_tokens_per_s"] > 0
    assert g["where"] == "the model gathered once" and 0 < g["generation_share"] < 1
    assert "| GRPO generated tokens/s (median, all ranks) |" in proc.stdout
    # beside it, on one device at the same batch: transformers' static-cache generate and the run's decoding alone
    peer = g["peer"]
    assert peer["prompts"] == 8 and peer["new_tokens"] == 16 and peer["device"] == "cpu"
    assert peer["ways"]["hf_static"]["tokens_per_s"] > 0 and peer["ways"]["static"]["tokens_per_s"] > 0
    assert peer["ways"]["graphs"] == {"skipped": "CUDA graphs need a CUDA device"}
    assert "| GRPO generated tokens/s per GPU: the run / transformers' static-cache generate" in proc.stdout


def test_random_shapes_and_the_gpu_cap_flag_refuse_bad_input(tmp_path):
    runs = [
        (["--model", "random:facebook/opt-99b"], tmp_path, None),
        (["--model", "tiny-opt", "--max_gpu_memory", "lots"], tmp_path, None),
    ]
    first, second = run_cli_concurrently(runs, timeout=120)
    assert first.returncode != 0 and "--model random:facebook/opt-99b: random weights are built for" in first.stderr
    assert second.returncode != 0 and "--max_gpu_memory 'lots'" in second.stderr
    for proc in (first, second):
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_on_one_t4_sized_gpu_the_check_trains_what_the_plan_says_fits(capsys):
    """gpu_check's default on a machine with one GPU (held to a T4's 14.56 GiB): opt-1.3b's full fine-tuning needs
    23.8 GiB on one rank, so it runs the plan's first change that fits, LoRA rank 16, at the same sequences per step,
    with flags the trainer's own layout choice agrees fit (no warning). Two GPUs fit the flags given, unchanged."""
    import torch

    from fsdp_opt.base import GIB
    from fsdp_opt.commands.gpu_check import fitted, parse
    from fsdp_opt.config.parse import parse_args
    from fsdp_opt.model.shapes import Shape, model_config
    from fsdp_opt.planner.layout import choose_layout
    from fsdp_opt.planner.memory import memory, peak_bytes
    from fsdp_opt.runtime.distributed import DistEnv

    a, opt = parse([]), model_config("facebook/opt-1.3b")
    inputs, flags, line = fitted("facebook/opt-1.3b", 1, a, cuda=True)
    assert (
        line.startswith("full fine-tuning does not fit 1 x 14.56 GiB; --lora_rank 16 fits")
        and "gpu_check runs that" in line
    )
    assert flags[:2] == ["--lora_rank", "16"] and inputs.lora_rank == 16
    assert inputs.batch_size * inputs.accum_steps == a.batch_size * a.accum_steps
    assert peak_bytes(memory(Shape.of(opt), "FULL_SHARD", inputs)) <= int(14.56 * GIB)
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    config = parse_args(
        [
            "--max_length",
            str(inputs.max_length),
            "--batch_size",
            str(inputs.batch_size),
            "--accum_steps",
            str(inputs.accum_steps),
            *flags,
        ]
    )
    capsys.readouterr()
    layout = choose_layout(config, env, opt, "fp16", inputs.accum_steps, gpu=(int(14.56 * GIB), "Tesla T4"))
    assert layout.prediction["fits"] and "warning" not in capsys.readouterr().out
    two, flags, line = fitted("facebook/opt-1.3b", 2, a, cuda=True)
    assert (flags, line, two.lora_rank, two.batch_size, two.accum_steps) == ([], None, 0, a.batch_size, a.accum_steps)
