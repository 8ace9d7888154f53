"""Will it fit? Per-GPU memory by component for each sharding strategy, checkpoint sizes against a disk
budget, and the host RAM a full save needs, before anything is launched.

    python -m fsdp_opt.plan --model facebook/opt-1.3b --gpus 2 --gpu_memory 15GiB --batch_size 4 --max_length 512

The model is described from its config alone (the OPT family from 125m to 6.7b is built in, so this works
offline; any local config.json or model folder too): a skeleton on the meta device gives the exact parameter
counts of the whole model, of one decoder block (one FSDP unit) and of the root unit. The byte counts follow
the engine's choices: fp32 master weights, fp32 gradients, AdamW's two fp32 moments, weights gathered in the
compute dtype, per-block FSDP units with the tied embeddings in the root.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

from .shapes import LLAMA_8B, OPT_FAMILY, Shape, model_config

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
GIB = 2**30

# Allocator slack, the CUDA context and NCCL's buffers (with 2 GPUs or more), which torch's counters do not see.
CUDA_CONTEXT_BYTES = int(0.45 * GIB)
NCCL_BUFFER_BYTES = int(0.25 * GIB)
FRAGMENTATION = 0.05
# What torch.cuda.get_device_properties(i).total_memory reads on Kaggle's T4s (ECC on): 14.56 to 14.75 GiB, not the
# 16 GB they are sold as; the plan takes the lower reading.
T4_MEMORY = "14.56GiB"


def parse_size(text: str | int | float, flag: str) -> int:
    """'15GiB', '20GB', '31G', '512MiB' or a byte count -> bytes (GB = 1e9, GiB = 2**30; bare G means GiB)."""
    from .errors import ConfigError

    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*", text.lower())
    if not m:
        raise ConfigError(f"{flag} {text!r}: use a size such as 15GiB, 20GB or 512MiB")
    value, unit, binary, b = m.groups()
    power = "_kmgt".index(unit) if unit else 0
    base = 1024 if (binary or (unit and not b)) else 1000
    return int(float(value) * base**power)


@dataclass
class Inputs:
    gpus: int = 2
    nodes: int = 1
    gpu_memory: int = int(14.56 * GIB)
    batch_size: int = 4
    max_length: int = 512
    accum_steps: int = 16
    precision: str = "fp16"
    activation_checkpointing: bool = True
    attn_implementation: str = "sdpa"
    packing: str = "docs"  # the trainer's --packing: docs and pad attend through a [batch, 1, L, L] mask
    reduce_every_microbatch: bool = False
    prefetch: int = 0
    loss_chunk_tokens: int = 0
    cuda: bool = True
    lora_rank: int = 0  # 0: full fine-tuning
    lora_targets: str | None = None  # None: every linear layer of the blocks
    lora_dropout: float = 0.05
    base_bits: int = 16


def shard_factor(strategy: str, inputs: Inputs) -> int:
    if strategy == "NO_SHARD":
        return 1
    if strategy == "HYBRID_SHARD":
        return max(1, inputs.gpus // inputs.nodes)
    return inputs.gpus


def state_bytes(shape: Shape, strategy: str, inputs: Inputs) -> dict[str, int]:
    """Resident training state per GPU: fp32 weights, fp32 gradients, Adam m and v, all sharded."""
    f = shard_factor(strategy, inputs)
    per = math.ceil(shape.params / f)
    return {"parameters": 4 * per, "gradients": 4 * per, "optimizer": 8 * per}


def memory(shape: Shape, strategy: str, inputs: Inputs, batch_size: int | None = None) -> dict[str, int]:
    """Peak bytes per GPU by component for one micro-batch of `batch_size` sequences."""
    b = inputs.batch_size if batch_size is None else batch_size
    s, h, L = inputs.max_length, shape.hidden, shape.layers
    c = 4 if inputs.precision == "fp32" else 2  # compute dtype: gathered weights, activations
    out = state_bytes(shape, strategy, inputs)
    # Without gradient sync between micro-batches FSDP keeps an unsharded fp32 gradient until the last one.
    out["accumulated_gradients"] = 4 * shape.params if inputs.accum_steps > 1 and not inputs.reduce_every_microbatch else 0
    # Gathered weights: the root stays gathered through forward and backward; FULL_SHARD/HYBRID hold the block
    # being computed and the one prefetched (`prefetch` of them with --prefetch); SHARD_GRAD_OP and NO_SHARD
    # keep every block from forward to backward.
    # FSDP2 gathers a unit into one buffer and copies it out into the unit's parameters; that buffer lives until the
    # next gather, so one unit's worth more is held (the simulation shows it: `plan --simulate`).
    keeps_all = strategy in ("SHARD_GRAD_OP", "NO_SHARD")
    held = L if keeps_all else min(L, 1 + max(1, inputs.prefetch))
    gather_buffer = c * max(shape.root_params, shape.block_params) if shard_factor(strategy, inputs) > 1 else 0
    out["gathered_weights"] = c * (shape.root_params + held * shape.block_params) + gather_buffer
    # Reduce-scatter of the largest unit (the root, with the embeddings): its unsharded gradient in the compute
    # dtype and FSDP2's fp32 copy of it that is reduce-scattered, alive together.
    out["reduce_scatter"] = (c + 4) * max(shape.root_params, shape.block_params)
    attention = 5 * shape.heads * s * s * b * c // 2 if inputs.attn_implementation == "eager" else 0
    full_layer = 34 * s * b * h * c // 2 + attention  # every saved tensor of one block (Korthikanti et al.)
    if inputs.activation_checkpointing:
        out["activations"] = L * s * b * h * c + full_layer  # block inputs, plus one block being recomputed
    else:
        out["activations"] = L * full_layer
    out["attention_mask"] = mask_bytes(shape, inputs, b, c)
    # Logits in the compute dtype, their fp32 copy for the loss, the saved log-softmax and the fp32 gradient.
    out["logits"] = s * b * shape.vocab * (c + 4 + 4 + 4 if c == 2 else 12)
    if inputs.loss_chunk_tokens:
        # One chunk at a time, at its peak in backward's recompute: the same, plus its gradient in the compute dtype.
        out["logits"] = min(inputs.loss_chunk_tokens, s * b) * shape.vocab * (2 * c + 12 if c == 2 else 16)
    if inputs.lora_rank:
        from .loraplan import components

        out.update(components(shape, strategy, inputs, b, c))
    if inputs.cuda:
        nccl = NCCL_BUFFER_BYTES if inputs.gpus > 1 else 0
        out["runtime"] = CUDA_CONTEXT_BYTES + nccl + int(FRAGMENTATION * peak_bytes(out))
    return out


def mask_bytes(shape: Shape, inputs: Inputs, b: int, c: int) -> int:
    """The attention mask of a micro-batch: `--packing docs` (block-diagonal, built by the engine) and `pad`
    (transformers builds it from the padding) attend through a [b, 1, L, L] mask; `concat` blocks need none.

    SDPA takes the boolean mask, kept from forward to backward (activation checkpointing recomputes with it), and
    turns it into an additive one in the compute dtype at every call, which its kernel saves for backward: one
    layer's worth with checkpointing, every layer's without.
    Eager attention gets the additive mask once (fp32 from the engine, the compute dtype from transformers)."""
    if inputs.packing == "concat":
        return 0
    s, L = inputs.max_length, shape.layers
    if inputs.attn_implementation == "eager":
        return b * s * s * (4 if inputs.packing == "docs" else c)
    # On CUDA torch pads the mask's last dimension to a multiple of 8 for the memory-efficient kernel; the mask is
    # expanded over the heads with stride 0, so there is no copy per head.
    cols = -(-s // 8) * 8 if inputs.cuda else s
    per_call = b * s * cols * c
    return b * s * s + (1 if inputs.activation_checkpointing else L) * per_call


def peak_bytes(parts: dict[str, int]) -> int:
    """The peak of a step from its components. Accumulating without sync, the sharded gradients are made only as the
    last micro-batch reduce-scatters the accumulated ones, unit by unit, each freeing its accumulated gradient: the two
    never add up, so the sharded gradients leave the backward peak. The optimizer step's own peak (weights, gradients,
    state; the fused step adds nothing) is below the backward peak whenever activations are held."""
    total = sum(parts.values())
    if parts.get("accumulated_gradients"):
        total -= parts["gradients"]
    return max(total, parts["parameters"] + parts["gradients"] + parts["optimizer"] + parts.get("runtime", 0))


def reduce_every_microbatch_needed(shape: Shape, strategy: str, inputs: Inputs) -> bool:
    """Does the run fit only when gradients are reduce-scattered after every micro-batch?"""
    keep = Inputs(**{**inputs.__dict__, "reduce_every_microbatch": False})
    return inputs.accum_steps > 1 and peak_bytes(memory(shape, strategy, keep)) > inputs.gpu_memory


def activation_bytes(shape: Shape, inputs: Inputs, checkpointing: bool) -> int:
    return memory(shape, "FULL_SHARD", Inputs(**{**inputs.__dict__, "activation_checkpointing": checkpointing}))["activations"]


def largest_micro_batch(shape: Shape, strategy: str, inputs: Inputs, limit: int = 4096) -> int:
    """The largest micro-batch whose peak fits in gpu_memory (0: not even one sequence)."""
    fits = lambda b: peak_bytes(memory(shape, strategy, inputs, b)) <= inputs.gpu_memory  # noqa: E731
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def make_plan(model: str, inputs: Inputs, *, disk: int, host_memory: int, keep_last: int, save_optimizer: bool,
              sharded: bool = False, offload: bool = False, slices: int = 10, keep_full: int = 1,
              rates=None) -> dict[str, Any]:  # fmt: skip
    from .hostplan import host_memory as host_phases
    from .diskplan import disk_and_hub
    from .steptime import candidates, comm_bytes, step_time

    shape = Shape.of(model_config(model))
    strategies: dict[str, Any] = {}
    for strategy in STRATEGIES:
        if strategy == "HYBRID_SHARD" and inputs.nodes < 2:
            continue
        parts = memory(shape, strategy, inputs)
        total = peak_bytes(parts)
        strategies[strategy] = {
            "components": parts,
            "total_bytes": total,
            "fits": total <= inputs.gpu_memory,
            "max_micro_batch": largest_micro_batch(shape, strategy, inputs),
            "state_bytes_per_rank": sum(state_bytes(shape, strategy, inputs).values()),
            "comm_bytes_per_step": comm_bytes(shape, strategy, inputs),
            "predicted_step_time_s": step_time(shape, strategy, inputs, rates)["step_s"],
        }
    configurations = candidates(shape, inputs, list(strategies), rates)
    stored = disk_and_hub(shape, inputs, disk=disk, keep_last=keep_last, save_optimizer=save_optimizer, slices=slices,
                          keep_full=keep_full)  # fmt: skip
    saved = stored.pop("saved")
    from .loraplan import adapter_params, describe

    return {
        "model": model,
        "shape": shape.summary(),
        "lora": describe(shape, inputs) if inputs.lora_rank else None,
        "adapter_params": adapter_params(shape, inputs) if inputs.lora_rank else 0,
        "inputs": {**inputs.__dict__, "disk": disk, "host_memory": host_memory, "keep_last": keep_last, "save_optimizer": save_optimizer},
        "activations": {
            "with_checkpointing": activation_bytes(shape, inputs, True),
            "without_checkpointing": activation_bytes(shape, inputs, False),
        },
        "strategies": strategies,
        "configurations": configurations,
        "auto_pick": configurations[0] if configurations and configurations[0]["fits"] else None,
        **stored,
        "host_ram": host_ram(
            host_phases(shape, "FULL_SHARD", inputs, save_optimizer=save_optimizer, sharded=sharded, offload=offload),
            shape, host_memory, save_optimizer, saved,
        ),
    }


def host_ram(phases: dict[str, Any], shape: Shape, host_memory: int, save_optimizer: bool, saved: int) -> dict[str, Any]:
    worst = max(phases["peak_fresh"]["machine"], phases["peak_resumed"]["machine"])
    # gather_bytes: what rank 0 gathers for a full save (and maps again to resume).
    gather = (12 if save_optimizer else 4) * saved
    return {**phases, "gather_bytes": gather, "host_memory": host_memory, "fits": worst <= host_memory}


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:,.2f} GiB"


def render(plan: dict[str, Any]) -> str:
    i, shape = plan["inputs"], plan["shape"]
    lines = [
        f"{plan['model']}: {shape['params']:,} parameters ({shape['layers']} blocks of {shape['block_params']:,}, "
        f"root {shape['root_params']:,})",
        f"{i['gpus']} GPU(s) on {i['nodes']} node(s), {_gib(i['gpu_memory'])} each; micro-batch {i['batch_size']} x "
        f"{i['max_length']} tokens, {i['precision']}, accum {i['accum_steps']}, activation checkpointing "
        f"{'on' if i['activation_checkpointing'] else 'off'}",
        *([plan["lora"]] if plan.get("lora") else []),
        "",
    ]
    names = list(plan["strategies"])
    comps = list(next(iter(plan["strategies"].values()))["components"])
    lines.append("| per GPU | " + " | ".join(names) + " |")
    lines.append("| --- |" + " --- |" * len(names))
    for comp in comps:
        lines.append(f"| {comp} | " + " | ".join(_gib(plan["strategies"][n]["components"][comp]) for n in names) + " |")
    lines.append("| **total** | " + " | ".join(f"**{_gib(plan['strategies'][n]['total_bytes'])}**" for n in names) + " |")
    lines.append("| fits | " + " | ".join("yes" if plan["strategies"][n]["fits"] else "NO" for n in names) + " |")
    lines.append("| largest micro-batch | " + " | ".join(str(plan["strategies"][n]["max_micro_batch"]) for n in names) + " |")
    if any(plan["strategies"][n]["components"]["accumulated_gradients"] for n in names):
        lines.append("(total: accumulating without sync, the sharded gradients appear only as the accumulated ones are "
                     "reduce-scattered, so they are not added to them)")
    from .diskplan import disk_line
    from .steptime import render_configurations

    lines += ["", *render_configurations(plan)]
    a, c, d, r = plan["activations"], plan["checkpoints"], plan["disk"], plan["host_ram"]
    lines += [
        "",
        f"activations: {_gib(a['with_checkpointing'])} with checkpointing, {_gib(a['without_checkpointing'])} without",
        f"checkpoints{' (the adapters)' if plan.get('lora') else ''}: full {_gib(c['full_with_optimizer'])} (weights "
        f"only {_gib(c['full_weights_only'])}), sharded {_gib(c['sharded_with_optimizer_per_rank'])} per rank, fp16 "
        f"export {_gib(c['export_fp16'])}" + (f" (merged into the base: {_gib(c['merged_export_fp16'])})" if plan.get("lora") else ""),
        disk_line(d, i["keep_last"], i["disk"]),
        f"Hub repo after {plan['hub']['slices']} slices with --hub_keep_full {plan['hub']['keep_full']}: "
        f"{plan['hub']['total'] / 1e9:,.1f} GB ({plan['hub']['full_checkpoints'] / 1e9:,.1f} GB of full checkpoints, "
        f"{plan['hub']['weights_files'] / 1e9:,.1f} GB of weights files; {plan['hub']['with_export'] / 1e9:,.1f} GB with "
        "an exported model)",
        "",
    ]
    from .hostplan import render_host

    lines += render_host(r, r["host_memory"])
    return "\n".join(lines)


def machine_memory() -> int:
    from .hostmem import total_memory_bytes

    return total_memory_bytes() or 31 * 10**9


def build_parser() -> argparse.ArgumentParser:
    from .flags import OneLineParser, parse_bool
    from .packing import MODES

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
    p.add_argument("--packing", default="docs", choices=MODES,
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
    from .steptime import Rates

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
    from .errors import ConfigError
    from .steptime import Rates

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
        from . import simulate as sim

        plan["simulated"] = {}
        for strategy in simulate:
            result = sim.simulate(a.model, inputs, strategy)
            planned = plan["strategies"][strategy]["components"]
            rows = sim.compare(result, planned)
            with_runtime = result["peak_total"] + planned.get("runtime", 0)
            plan["simulated"][strategy] = {**result, "comparison": rows, "total_bytes": with_runtime,
                                           "fits": with_runtime <= inputs.gpu_memory}  # fmt: skip
            text += ["", *sim.render(strategy, rows, result),
                     f"{strategy} verdict: plan {_gib(plan['strategies'][strategy]['total_bytes'])}, simulated "
                     f"{_gib(with_runtime)} (with the plan's runtime row) of {_gib(inputs.gpu_memory)}: "
                     + ("fits" if with_runtime <= inputs.gpu_memory and plan["strategies"][strategy]["fits"]
                        else "does NOT fit" if with_runtime > inputs.gpu_memory and not plan["strategies"][strategy]["fits"]
                        else "the two disagree")]  # fmt: skip
    print(json.dumps(plan, indent=1) if a.json else "\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
