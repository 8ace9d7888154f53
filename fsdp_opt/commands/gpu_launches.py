"""gpu_check's launches: the training command under torchrun (W&B off) and what its output says; its GRPO launch, a
few GRPO steps (generation on the model gathered once in the compute dtype, then the update) with their figures, and
beside them, in a process of its own at the same shape and batch, transformers' static-cache generate, the run's
decoding alone and the weight-read bound (fsdp_opt/decodebench)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from fsdp_opt.base import parse_size
from fsdp_opt.model.shapes import Shape, model_config
from fsdp_opt.model.sources import RANDOM_PREFIX
from fsdp_opt.planner.generation import generation_memory, requests_per_rank
from fsdp_opt.planner.inputs import Inputs


def torchrun(nproc: int, module: str, *args: str) -> list[str]:
    """The command that runs `module` in `nproc` workers on this machine, under torchrun."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        module,
        *args,
    ]


def _launch(nproc: int, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    return subprocess.run(torchrun(nproc, "fsdp_opt", *args), cwd=cwd, env=env, capture_output=True, text=True)


def _grab(pattern: str, text: str, cast=float):  # noqa: ANN001
    m = re.search(pattern, text)
    return cast(m.group(1)) if m else None


def grpo_launch(a: argparse.Namespace, spec: str, nproc: int, cuda: bool, work: Path) -> dict[str, Any]:
    """--method grpo on the built-in prompts for --grpo_steps steps, one prompt per rank per step (LoRA rank 16 on a
    GPU, as GRPO runs on a T4; the model's random weights rarely end a completion, so each runs its full length):
    generated tokens/s, generation's share of the step, the step's time against the plan's (generation added), the
    GPU memory peak against the plan's generation phase."""
    out = work / "grpo"
    g, length = a.num_generations, a.max_completion_length
    args = [
        "--model",
        spec,
        "--dataset",
        "python-docs-prompts",
        "--chat_template",
        "chatml",
        "--method",
        "grpo",
        "--reward",
        "length",
        "--num_generations",
        str(g),
        "--max_completion_length",
        str(length),
        "--max_length",
        str(length + 256),
        "--batch_size",
        str(g),
        "--accum_steps",
        "1",
        "--start_idx",
        "0",
        "--end_idx",
        str(a.grpo_steps * nproc),
        "--num_epochs",
        "1",
        "--output_dir",
        str(out),
        "--device",
        "cuda" if cuda else "cpu",
        "--decoding",
        a.decoding,
    ]
    if cuda:
        args += ["--precision", a.precision, "--max_gpu_memory", a.gpu_memory, "--lora_rank", "16"]
    proc = _launch(nproc, args, work)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}", "output": proc.stdout[-3000:] + proc.stderr[-3000:]}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    later = rows[1:] or rows  # the first step allocates and warms up
    median = lambda xs: sorted(xs)[(len(xs) - 1) // 2] if xs else None  # noqa: E731
    return {
        "steps": len(rows),
        "num_generations": g,
        "max_completion_length": length,
        "lora_rank": 16 if cuda else 0,
        "completions_per_step": rows[0]["completions"] if rows else None,
        "generated_tokens_per_s": median([r["generated_tokens_per_second"] for r in later]),
        "generation_share": median([r["generation_share"] for r in later]),
        "completion_length": median([r["completion_length"] for r in later]),
        "step_time_measured_s": _grab(r"step time: measured ([\d.]+) s", proc.stdout),
        "step_time_predicted_s": _grab(r"predicted ([\d.]+) s \(", proc.stdout),
        "where": _grab(r"generation on ([^,\n]+)", proc.stdout, str),
        "decoding": _grab(r"decoded with ([^;\n]+)", proc.stdout, str),
        "max_memory_allocated_gib": _grab(r"GPU memory peak on rank 0: ([\d.]+) GiB allocated", proc.stdout),
        "plan_generation_peak_bytes": _grpo_plan_peak(a, spec, nproc, cuda),
    }


def decode_peer(a: argparse.Namespace, spec: str, nproc: int, cuda: bool, work: Path) -> dict[str, Any]:
    """transformers' static-cache generate, the run's decoding alone and the weight-read bound at the GRPO launch's
    shape and batch (one rank's completions, fp16 on a GPU), by fsdp_opt.decodebench in a process of its own (this
    one never makes a CUDA context)."""
    out = work / "decode_peer.json"
    requests = requests_per_rank(a.num_generations * nproc, a.num_generations, nproc)
    cmd = [
        sys.executable,
        "-m",
        "fsdp_opt.decodebench",
        "--model",
        spec,
        "--prompts",
        str(requests),
        "--prompt_length",
        "64",
        "--new_tokens",
        str(a.max_completion_length),
        "--repeat",
        "2",
        "--device",
        "cuda" if cuda else "cpu",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0 or not out.exists():
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.read_text())


def _grpo_plan_peak(a: argparse.Namespace, spec: str, nproc: int, cuda: bool) -> int | None:
    """The plan's peak per GPU of the GRPO launch's generation phase (gathered once)."""
    if not cuda:
        return None
    inputs = Inputs(
        gpus=nproc,
        gpu_memory=parse_size(a.gpu_memory, "--gpu_memory"),
        batch_size=a.num_generations,
        max_length=a.max_completion_length + 256,
        precision=a.precision,
        lora_rank=16,
    )
    shape = Shape.of(model_config(spec.removeprefix(RANDOM_PREFIX)))
    requests = requests_per_rank(a.num_generations * nproc, a.num_generations, nproc)
    return sum(generation_memory(shape, "FULL_SHARD", inputs, requests, True).values())
