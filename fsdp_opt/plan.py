"""Will it fit? Per-GPU memory by component for each sharding strategy, checkpoint sizes against a disk
budget, and the host RAM a full save needs, before anything is launched.

    python -m fsdp_opt.plan --model facebook/opt-1.3b --gpus 2 --gpu_memory 15GiB --batch_size 4 --max_length 512

The command over `fsdp_opt.planner`: flags in, the plan out as tables or JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

from fsdp_opt.base import ConfigError, gib, parse_size
from fsdp_opt.config.choices import PACKING_MODES, T4_MEMORY
from fsdp_opt.config.flags import OneLineParser, parse_bool
from fsdp_opt.model.sources import LLAMA_8B, OPT_FAMILY
from fsdp_opt.planner.inputs import Inputs
from fsdp_opt.planner.report import make_plan, render
from fsdp_opt.planner.simulate import compare
from fsdp_opt.planner.simulate import render as sim_render
from fsdp_opt.planner.simulate import simulate as sim_simulate
from fsdp_opt.planner.steptime import Rates
from fsdp_opt.runtime.hostmem import total_memory_bytes


def machine_memory() -> int:
    return total_memory_bytes() or 31 * 10**9


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m fsdp_opt.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="facebook/opt-1.3b",
                   help=f"one of {', '.join(OPT_FAMILY)}, {LLAMA_8B}, tiny-opt, or a local model folder")
    p.add_argument("--gpus", type=int, default=2, help="GPUs in all (ranks)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu_memory", default=T4_MEMORY, help=f"memory of one GPU as torch reads it (Kaggle's T4: {T4_MEMORY})")
    p.add_argument("--batch_size", type=int, default=4, help="micro-batch per GPU")
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument("--accum_steps", type=int, default=16)
    p.add_argument("--precision", default="fp16", choices=["fp16", "bf16", "fp32"])
    p.add_argument("--activation_checkpointing", type=parse_bool, nargs="?", const=True, default=True)
    p.add_argument("--attn_implementation", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--packing", default="docs", choices=PACKING_MODES,
                   help="the trainer's --packing (docs and pad attend through a mask, which the plan counts)")
    p.add_argument("--reduce_every_microbatch", type=parse_bool, nargs="?", const=True, default=False)
    p.add_argument("--prefetch", type=int, default=0, help="blocks gathered ahead (the trainer's --prefetch)")
    p.add_argument("--loss_chunk_tokens", type=int, default=0, help="the trainer's --loss_chunk_tokens")
    p.add_argument("--lora_rank", type=int, default=0, help="the trainer's --lora_rank (0: full fine-tuning)")
    p.add_argument("--lora_targets", default=None, help="the trainer's --lora_targets (default: every linear layer of the blocks)")
    p.add_argument("--lora_dropout", type=float, default=0.05, help="the trainer's --lora_dropout")
    p.add_argument("--base_bits", type=int, default=16, choices=[16, 4], help="the trainer's --base_bits")
    p.add_argument("--disk", default="20GB", help="disk for checkpoints (Kaggle's /kaggle/working: 20GB)")
    p.add_argument("--host_memory", default=None, help="RAM of one machine (default: this machine's; Kaggle: 31GB)")
    p.add_argument("--state_dict_type", default="full", choices=["full", "sharded"], help="the trainer's --state_dict_type")
    p.add_argument("--cpu_offload", type=parse_bool, nargs="?", const=True, default=False, help="the trainer's --cpu_offload")
    p.add_argument("--keep_last", type=int, default=2)
    p.add_argument("--save_optimizer", type=parse_bool, nargs="?", const=True, default=True)
    p.add_argument("--slices", type=int, default=10, help="sessions in the chain, for the Hub repo's size")
    p.add_argument("--hub_keep_full", type=int, default=1, help="the trainer's --hub_keep_full (0: keep every full checkpoint)")
    p.add_argument("--cpu", action="store_true", help="plan for CPU processes (no CUDA context)")

    rates = Rates()  # 2×T4's
    p.add_argument("--tflops", type=float, default=rates.tflops, help="sustained TFLOPS per GPU (T4 fp16: 24)")
    p.add_argument("--link_gbps", type=float, default=rates.link_gbps, help="GB/s between GPUs (2 T4s on PCIe 3 through NCCL: 3.2)")
    p.add_argument("--hbm_gbps", type=float, default=rates.hbm_gbps, help="GB/s of GPU memory (T4: 320)")
    p.add_argument("--simulate", nargs="?", const="FULL_SHARD", default=None, metavar="STRATEGIES",
                   help="also run one training step at the model's real shape on fake tensors (no memory used) for "
                        "these strategies (comma-separated; default FULL_SHARD) and hold its peaks against the plan")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        a = build_parser().parse_args(argv)
        for flag in ("gpus", "nodes", "batch_size", "max_length", "accum_steps", "slices"):
            if getattr(a, flag) < 1:
                raise ConfigError(f"--{flag} {getattr(a, flag)}: must be at least 1")
        for flag in ("tflops", "link_gbps", "hbm_gbps"):
            if not getattr(a, flag) > 0:
                raise ConfigError(f"--{flag} {getattr(a, flag)}: must be more than 0")
        for flag in ("prefetch", "loss_chunk_tokens", "hub_keep_full"):
            if getattr(a, flag) < 0:
                raise ConfigError(f"--{flag} {getattr(a, flag)}: must be 0 or more")
        if a.gpus % a.nodes:
            raise ConfigError(f"--gpus {a.gpus}: does not split evenly over --nodes {a.nodes}")
        inputs = Inputs(
            gpus=a.gpus, nodes=a.nodes, gpu_memory=parse_size(a.gpu_memory, "--gpu_memory"), batch_size=a.batch_size,
            max_length=a.max_length, accum_steps=a.accum_steps, precision=a.precision,
            activation_checkpointing=a.activation_checkpointing, attn_implementation=a.attn_implementation,
            packing=a.packing, reduce_every_microbatch=a.reduce_every_microbatch, prefetch=a.prefetch,
            loss_chunk_tokens=a.loss_chunk_tokens, cuda=not a.cpu, lora_rank=a.lora_rank, lora_targets=a.lora_targets,
            lora_dropout=a.lora_dropout, base_bits=a.base_bits,
        )  # fmt: skip
        if a.lora_rank < 0:
            raise ConfigError(f"--lora_rank {a.lora_rank}: must be 0 (full fine-tuning) or more")
        if a.base_bits != 16 and not a.lora_rank:
            raise ConfigError(f"--base_bits {a.base_bits}: only with --lora_rank (a 4-bit base is frozen)")
        host = parse_size(a.host_memory, "--host_memory") if a.host_memory is not None else machine_memory()
        plan = make_plan(a.model, inputs, disk=parse_size(a.disk, "--disk"), host_memory=host, keep_last=a.keep_last,
                         save_optimizer=a.save_optimizer, sharded=a.state_dict_type == "sharded", offload=a.cpu_offload,
                         slices=a.slices, keep_full=a.hub_keep_full,
                         rates=Rates(tflops=a.tflops, link_gbps=a.link_gbps, hbm_gbps=a.hbm_gbps))  # fmt: skip
        simulate = [x.strip() for x in a.simulate.split(",")] if a.simulate else []
        for strategy in simulate:
            if strategy not in plan["strategies"]:
                raise ConfigError(f"--simulate {a.simulate}: {strategy} is not one of {', '.join(plan['strategies'])}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = [] if a.json else [render(plan)]
    if simulate:

        plan["simulated"] = {}
        for strategy in simulate:
            result = sim_simulate(a.model, inputs, strategy)
            planned = plan["strategies"][strategy]["components"]
            rows = compare(result, planned)
            with_runtime = result["peak_total"] + planned.get("runtime", 0)
            plan["simulated"][strategy] = {**result, "comparison": rows, "total_bytes": with_runtime,
                                           "fits": with_runtime <= inputs.gpu_memory}  # fmt: skip
            text += ["", *sim_render(strategy, rows, result),
                     f"{strategy} verdict: plan {gib(plan['strategies'][strategy]['total_bytes'])}, simulated "
                     f"{gib(with_runtime)} (with the plan's runtime row) of {gib(inputs.gpu_memory)}: "
                     + ("fits" if with_runtime <= inputs.gpu_memory and plan["strategies"][strategy]["fits"]
                        else "does NOT fit" if with_runtime > inputs.gpu_memory and not plan["strategies"][strategy]["fits"]
                        else "the two disagree")]  # fmt: skip
    print(json.dumps(plan, indent=1) if a.json else "\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
