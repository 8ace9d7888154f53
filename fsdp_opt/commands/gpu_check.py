"""One command for a GPU machine: train the real shape, save, resume, and hold every figure against the plan.

    python -m fsdp_opt.gpu_check                      # every visible GPU, opt-1.3b's shape, each capped to a T4's 14.56 GiB
    python -m fsdp_opt.gpu_check --device cpu --model tiny-opt --nproc 2

On the GPUs present it launches the training command under torchrun, one process per GPU, with `random:` weights of
the shape (no download), fp16 with loss scaling as on a T4, and each GPU's allocator held to `--gpu_memory` (14.56 GiB:
a T4's total_memory) with `--max_gpu_memory`; where the memory plan says those flags do not fit (opt-1.3b's full
fine-tuning on one GPU), it trains the plan's first change that fits instead (`fitted`). A second launch resumes from
the first one's checkpoint on the next rows.
Before them it reads each GPU (name, compute capability, the precision --precision auto picks, the memory free once a
context exists) from nvidia-smi or a short-lived process, never creating a CUDA context in its own process; after them
it times NCCL's all-gather and reduce-scatter with peer-to-peer on and off (NCCL_P2P_DISABLE=1). The table shows the
plan's peak against the usable memory and `max_memory_allocated`/`max_memory_reserved`, useful tokens/s, MFU, the
predicted against the measured step time, skipped fp16 steps, the save and load times and the link, with the device
named. Then a short GRPO launch (--grpo_steps): generation on the gathered model in the compute dtype, then the
update, with generated tokens/s and the step's time against the plan; and beside it, in a process of its own on one
GPU at the same shape and batch (fsdp_opt/commands/decodebench.py), transformers' static-cache generate (the peer), the run's
decoding alone (static, and as CUDA graphs) and the bound of reading the weights once a step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from fsdp_opt.base import GIB, parse_size
from fsdp_opt.commands.gpu_launches import _grab, _launch, decode_peer, grpo_launch, torchrun
from fsdp_opt.commands.gpu_table import render
from fsdp_opt.config.choices import T4_MEMORY
from fsdp_opt.model.shapes import Shape, model_config
from fsdp_opt.planner.inputs import NCCL_BUFFER_BYTES, Inputs
from fsdp_opt.planner.memory import memory, peak_bytes
from fsdp_opt.planner.search import Limits, Space, change_line, cheapest_change
from fsdp_opt.planner.steptime import Rates, candidates
from fsdp_opt.runtime.gpus import contexts_held, describe, from_a_child_process, from_nvidia_smi, precision_for

BLOCKS_PER_ROW_512 = 0.15  # python-docs rows packed into 512-token blocks by the built-in tokenizer (about)

DOC_ROWS = 754  # rows of python-docs


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fsdp_opt.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument(
        "--model",
        default=None,
        help="an OPT size (random weights) or tiny-opt; default: facebook/opt-1.3b on GPUs, tiny-opt on CPU",
    )
    p.add_argument("--nproc", type=int, default=0, help="processes (default: one per GPU; 2 on CPU)")
    p.add_argument(
        "--gpu_memory", default=T4_MEMORY, help=f"each GPU's allocator is capped to this (a T4: {T4_MEMORY})"
    )
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument("--accum_steps", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps of the first launch (the data allowing)")
    p.add_argument("--precision", default="fp16", help="fp16 as on a T4 (GPU); CPU runs fp32")
    p.add_argument("--workdir", default=None, help="where the runs write (default: a temporary folder)")
    p.add_argument(
        "--grpo_steps",
        type=int,
        default=3,
        help="then GRPO steps (--method grpo, LoRA rank 16 on a GPU): generation on the gathered model in "
        "the compute dtype, then the update; 0 skips them",
    )
    p.add_argument("--num_generations", type=int, default=8, help="the GRPO launch's completions per prompt")
    p.add_argument(
        "--decoding",
        default="static",
        choices=["static", "graphs", "generate"],
        help="the GRPO launch's --decoding (graphs: each decoding step replayed as a CUDA graph)",
    )
    p.add_argument("--max_completion_length", type=int, default=128, help="the GRPO launch's completion tokens")
    p.add_argument("--json", default=None, help="also write the figures here")
    return p.parse_args(argv)


def fitted(model: str, nproc: int, a: argparse.Namespace, cuda: bool) -> tuple[Inputs, list[str], str | None]:
    """What gpu_check trains: the flags given where the memory plan fits them on `nproc` GPUs of --gpu_memory, else
    the plan's first change that fits (LoRA before a 4-bit base before shorter rows: opt-1.3b's full fine-tuning needs
    23.8 GiB on one rank), at the same sequences per step. Returns the plan's inputs for that run, the flags added, and
    the line that says why (None when the flags given fit, and always on CPU)."""
    if not cuda:  # CPU ranks: fp32, a share of the host's memory; nothing to fit
        return (
            Inputs(
                gpus=nproc,
                gpu_memory=31 * GIB,
                batch_size=a.batch_size,
                max_length=a.max_length,
                accum_steps=a.accum_steps,
                precision="fp32",
                cuda=False,
            ),
            [],
            None,
        )
    given = Inputs(
        gpus=nproc,
        gpu_memory=parse_size(a.gpu_memory, "--gpu_memory"),
        batch_size=a.batch_size,
        max_length=a.max_length,
        accum_steps=a.accum_steps,
        precision=a.precision,
    )
    shape = Shape.of(model_config(model))
    if any(c["fits"] for c in candidates(shape, given, ["FULL_SHARD"], Rates())):
        return given, [], None
    samples = a.batch_size * a.accum_steps * nproc
    # The layout of the trainer's own flags: FULL_SHARD, no offload (the check is of the GPU, not the host).
    found = cheapest_change(shape, given, samples, Limits(space=Space(strategies=("FULL_SHARD",), offload=False)))
    if found is None:
        return given, [], change_line(True, given, None) + ": the check runs the flags given"
    inputs = replace(
        found["inputs"],
        batch_size=found["batch_size"],
        accum_steps=found["accum_steps"],
        activation_checkpointing=found["activation_checkpointing"],
        loss_chunk_tokens=found["loss_chunk_tokens"] or 0,
    )
    flags = found["change"].split() + [
        "--loss_chunk_tokens",
        str(inputs.loss_chunk_tokens),
        "--activation_checkpointing",
        str(inputs.activation_checkpointing).lower(),
    ]
    return inputs, flags, change_line(True, given, found) + ": gpu_check runs that"


def main(argv: list[str] | None = None) -> int:
    import torch

    a = parse(argv)
    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if a.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device is visible", file=sys.stderr)
        return 2
    model = a.model or ("facebook/opt-1.3b" if cuda else "tiny-opt")
    nproc = a.nproc or (torch.cuda.device_count() if cuda else 2)
    # The child process's reading includes the memory free once a context exists; nvidia-smi's does not.
    gpus = (from_a_child_process() or from_nvidia_smi()) if cuda else []
    device = gpus[0]["name"] if gpus else ("a CUDA GPU" if cuda else f"CPU ({os.cpu_count()} cores)")
    for g, line in zip(gpus, describe(gpus)):
        print(f"gpu_check: {line}; --precision auto trains in {precision_for(g['capability'])}")
    spec = model if model == "tiny-opt" else f"random:{model}"
    blocks = a.steps * a.batch_size * nproc * a.accum_steps  # the same sequences per step in a run that fits
    rows = min(DOC_ROWS // 2, math.ceil(blocks / BLOCKS_PER_ROW_512 * a.max_length / 512) + 8)
    # absolute: the launches run in this folder, and name their output folder inside it
    work = Path(a.workdir or tempfile.mkdtemp(prefix="gpu_check_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = work / "out"
    inputs, fit_flags, fit_line = fitted(model, nproc, a, cuda)
    if fit_line:
        print(f"gpu_check: {fit_line}", flush=True)
    common = [
        "--model",
        spec,
        "--dataset",
        "python-docs",
        "--max_length",
        str(inputs.max_length),
        "--batch_size",
        str(inputs.batch_size),
        "--accum_steps",
        str(inputs.accum_steps),
        "--output_dir",
        str(out),
        "--num_epochs",
        "1",
        "--device",
        "cuda" if cuda else "cpu",
        *fit_flags,
    ]
    if cuda:
        common += ["--precision", a.precision, "--max_gpu_memory", a.gpu_memory]
    print(
        f"gpu_check: {model} on {nproc} x {device}; first launch trains rows [0, {rows}), the second (--start_idx "
        f"auto) resumes on [{rows}, {2 * rows})",
        flush=True,
    )
    first = _launch(nproc, common + ["--start_idx", "0", "--end_idx", str(rows)], work)
    if first.returncode != 0:
        print(first.stdout[-3000:] + first.stderr[-3000:], file=sys.stderr)
        print(f"error: the first launch failed (exit {first.returncode}); its output is above", file=sys.stderr)
        return 1
    second = _launch(nproc, common + ["--start_idx", "auto", "--range_size", str(rows)], work)
    if second.returncode != 0:
        print(second.stdout[-3000:] + second.stderr[-3000:], file=sys.stderr)
        print(f"error: the resumed launch failed (exit {second.returncode}); its output is above", file=sys.stderr)
        return 1
    figures = collect(model, nproc, device, inputs, out, first.stdout, second.stdout)
    figures["changed_to_fit"] = fit_line
    if a.grpo_steps > 0:
        grpo = grpo_launch(a, spec, nproc, cuda, work)
        if "error" in grpo:
            print(grpo.pop("output"), file=sys.stderr)
            print(f"error: the GRPO launch failed: {grpo['error']}; its output is above", file=sys.stderr)
            return 1
        grpo["peer"] = decode_peer(a, spec, nproc, cuda, work)
        figures["grpo"] = grpo
    figures["gpus"] = gpus
    free = [g["free_after_context_gib"] for g in gpus if "free_after_context_gib" in g]
    figures["usable_gib"] = min(free) - NCCL_BUFFER_BYTES / GIB if free and nproc > 1 else min(free) if free else None
    figures["links"] = link_speeds(nproc, cuda, work) if nproc > 1 else []
    held = contexts_held() if cuda else [False]
    figures["cuda_context_in_this_process"] = None if held is None else any(held)
    print("\n".join(render(figures)))
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))
    return 0


def link_speeds(nproc: int, cuda: bool, work: Path) -> list[dict[str, Any]]:
    """commbench under torchrun: NCCL with peer-to-peer, then with NCCL_P2P_DISABLE=1; gloo once on CPU."""
    results = []
    for p2p_off in [False, True] if cuda else [False]:
        out = work / f"comm_p2p_{'off' if p2p_off else 'on'}.json"
        env = {**os.environ, **({"NCCL_P2P_DISABLE": "1"} if p2p_off else {})}
        cmd = torchrun(nproc, "fsdp_opt.commbench", "--device", "cuda" if cuda else "cpu", "--json", str(out))
        if not cuda:
            cmd += ["--mib", "16", "--iters", "3"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode == 0 and out.exists():
            results.append({"p2p": not p2p_off, "backend": "nccl" if cuda else "gloo", **json.loads(out.read_text())})
        else:
            results.append(
                {
                    "p2p": not p2p_off,
                    "backend": "nccl" if cuda else "gloo",
                    "error": (proc.stderr.strip().splitlines() or ["failed"])[-1],
                }
            )
    return results


def collect(model: str, nproc: int, device: str, inputs: Inputs, out: Path, first: str, second: str) -> dict[str, Any]:

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    slice1 = rows[0]["slice"]
    one = [r for r in rows if r["slice"] == slice1]
    later = one[1:] or one  # the first step allocates and warms up
    strategy = _grab(r"strategy\s+: (\w+)", first, str)
    every = "every micro-batch" in (_grab(r"gradient sync\s+: ([^\n]+)", first, str) or "")
    planned = memory(Shape.of(model_config(model)), strategy, replace(inputs, reduce_every_microbatch=every))
    median = lambda xs: sorted(xs)[(len(xs) - 1) // 2] if xs else None  # noqa: E731
    return {
        "device": device,
        "model": model,
        "ranks": nproc,
        "strategy": strategy,
        "reduce_every_microbatch": every,
        "lora_rank": inputs.lora_rank,
        "batch_size": inputs.batch_size,
        "accum_steps": inputs.accum_steps,
        "steps": len(one),
        "plan_peak_bytes": peak_bytes(planned),
        "plan_peak_without_runtime_bytes": peak_bytes({k: v for k, v in planned.items() if k != "runtime"}),
        "max_memory_allocated_gib": _grab(r"GPU memory peak on rank 0: ([\d.]+) GiB allocated", first),
        "max_memory_reserved_gib": _grab(r"GiB allocated, ([\d.]+) GiB reserved", first),
        "useful_tokens_per_s": median([r["tokens_per_second"] for r in later]),
        "mfu": median([r["mfu"] for r in later if "mfu" in r]),
        "step_time_measured_s": _grab(r"step time: measured ([\d.]+) s", first),
        "step_time_predicted_s": _grab(r"predicted ([\d.]+) s \(", first),
        "skipped_fp16_steps": rows[-1].get("skipped_steps", 0),
        "save_s": _grab(r"saved \S+ \([\d,.]+ MiB in ([\d.]+) s", first),
        "checkpoint_read_s": _grab(r"checkpoint found and read in ([\d.]+) s", second),
        "load_into_shards_s": _grab(r"loaded into the shards in ([\d.]+) s", second),
        "resumed_steps": len(rows) - len(one),
        "resumed_from_step": next((r["step"] for r in rows if r["slice"] != slice1), None),
    }


if __name__ == "__main__":
    sys.exit(main())
