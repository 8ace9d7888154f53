"""Communication per optimizer step and a predicted step time, for each sharding strategy and accumulation mode.

Bytes are those of the collectives FSDP2 issues on one rank (all-gather outputs, reduce-scatter inputs, all-reduce
tensors), counted from the model's units with FSDP2's dim-0 padding; a 2-rank test counts the same on gloo. Per
micro-batch the root unit is gathered once (it stays gathered from forward to backward) and each block twice under
FULL_SHARD/HYBRID_SHARD (forward, then backward, where activation checkpointing recomputes with the same gather) or
once under SHARD_GRAD_OP. Gradients go out in fp32 after every micro-batch, or only after the last one when
accumulating without sync. NO_SHARD and HYBRID_SHARD all-reduce across replicas what each shard group reduced.

On the wire a ring collective moves (n-1)/n of its bytes per rank (twice that for an all-reduce). The step time is
the compute at a sustained rate, overlapped with the overlappable communication, plus what cannot overlap (the first
gather and the last reduce-scatter of each micro-batch: the root unit's) and the fused AdamW update, which reads and
writes 28 bytes per local parameter at the memory bandwidth. Defaults are 2×T4's: 24 TFLOPS sustained fp16 (T4's
datasheet peak is 65; its 70 W cap holds large matmuls near 24), 3.2 GB/s between two PCIe 3 cards through NCCL's
shared-memory path, 320 GB/s of GPU memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fsdp_opt.base import gib
from fsdp_opt.config.choices import STRATEGIES, T4_HBM_GBPS, T4_LINK_GBPS, T4_TFLOPS
from fsdp_opt.config.parse import Config
from fsdp_opt.model.shapes import Shape
from fsdp_opt.planner.inputs import Inputs, shard_factor
from fsdp_opt.planner.lora import adapter_dims, adapter_params, block_base_bytes
from fsdp_opt.planner.memory import memory, peak_bytes
from fsdp_opt.runtime.distributed import DistEnv, print0
from fsdp_opt.runtime.gpus import PEAK_FLOPS


@dataclass
class Rates:
    tflops: float = T4_TFLOPS
    link_gbps: float = T4_LINK_GBPS
    hbm_gbps: float = T4_HBM_GBPS


def _padded(unit: tuple, shards: int) -> int:
    """Elements of a unit once each parameter's dim 0 is padded to a multiple of the shard count."""
    return sum(math.ceil(d0 / shards) * shards * (n // d0) if d0 else n for d0, n in unit)


def comm_bytes(shape, strategy: str, inputs) -> dict[str, Any]:  # noqa: ANN001
    """Collective bytes of one rank in one optimizer step, by kind, and what crosses the link (wire)."""

    f = shard_factor(strategy, inputs)
    replicas = max(1, inputs.gpus // f)
    c = 4 if inputs.precision == "fp32" else 2
    micro = inputs.accum_steps
    reduces = micro if inputs.reduce_every_microbatch or micro == 1 else 1
    root, blocks = shape.units[0], shape.units[1:]
    root_padded, blocks_padded = _padded(root, f), sum(_padded(b, f) for b in blocks)
    block_gathers = 2 if strategy in ("FULL_SHARD", "HYBRID_SHARD") else 1
    sharded = f > 1
    gathered = c * (root_padded + block_gathers * blocks_padded)
    reduced = 4 * (root_padded + blocks_padded)  # fp32 gradients of every parameter
    root_reduced = 4 * root_padded
    if getattr(inputs, "lora_rank", 0):
        # LoRA: the frozen base is gathered as stored (NF4 with --base_bits 4) with the adapters; only the adapters'
        # gradients are reduced (the root has none).

        adapters = _padded(adapter_dims(shape, inputs), f)
        block = block_base_bytes(shape, inputs, c) + c * adapters
        gathered = int(c * root_padded + block_gathers * len(blocks) * block)
        reduced, root_reduced = 4 * adapters * len(blocks), 0
    out = {
        "all_gather": micro * gathered if sharded else 0,
        "reduce_scatter": reduces * reduced if sharded else 0,
        "all_reduce": reduces * reduced // f if replicas > 1 else 0,
    }
    out["wire"] = int((f - 1) / f * (out["all_gather"] + out["reduce_scatter"])
                      + 2 * (replicas - 1) / replicas * out["all_reduce"])  # fmt: skip
    # What waits on the link with no compute beside it: the root's gather and its reduce-scatter, every micro-batch.
    out["exposed_wire"] = int((f - 1) / f * (micro * c * root_padded + reduces * root_reduced)) if sharded else 0
    return out


def step_time(shape, strategy: str, inputs, rates: Rates | None = None) -> dict[str, float]:  # noqa: ANN001
    """Predicted seconds of one optimizer step on each rank, and its parts."""

    rates = rates or Rates()
    tokens = inputs.batch_size * inputs.max_length * inputs.accum_steps
    lora = bool(getattr(inputs, "lora_rank", 0))
    # forward + input gradients (+ weight gradients, which a frozen base does not compute)
    passes = 2.0 if lora else 3.0
    per_token = 2.0 * passes * shape.flop_params + 4.0 * passes * shape.layers * shape.hidden * inputs.max_length
    if inputs.activation_checkpointing:  # one more forward of the blocks
        per_token += 2.0 * (shape.flop_params - shape.vocab * shape.hidden) + 4.0 * shape.layers * shape.hidden * inputs.max_length
    if inputs.loss_chunk_tokens:  # the output projection again, in backward
        per_token += 2.0 * shape.vocab * shape.hidden
    compute = tokens * per_token / (rates.tflops * 1e12)
    comm = comm_bytes(shape, strategy, inputs)
    link = rates.link_gbps * 1e9
    overlapped = (comm["wire"] - comm["exposed_wire"]) / link
    exposed = comm["exposed_wire"] / link
    if lora:

        trainable = adapter_params(shape, inputs)
    else:
        trainable = shape.params
    local = math.ceil(trainable / shard_factor(strategy, inputs))
    optimizer = 28 * local / (rates.hbm_gbps * 1e9)
    return {"compute_s": compute, "communication_s": comm["wire"] / link, "exposed_communication_s": exposed,
            "optimizer_s": optimizer, "step_s": max(compute, overlapped) + exposed + optimizer,
            "hardware_flops_per_token": per_token}  # fmt: skip


def candidates(shape, inputs, strategies: list[str], rates: Rates | None = None) -> list[dict[str, Any]]:  # noqa: ANN001
    """Every strategy and accumulation mode with its peak memory and predicted step time, fastest first."""

    out = []
    for strategy in strategies:
        for every in ((False, True) if inputs.accum_steps > 1 else (False,)):
            this = Inputs(**{**inputs.__dict__, "reduce_every_microbatch": every})
            peak = peak_bytes(memory(shape, strategy, this))
            out.append({"strategy": strategy, "reduce_every_microbatch": every, "peak_bytes": peak,
                        "fits": peak <= inputs.gpu_memory, **step_time(shape, strategy, this, rates)})  # fmt: skip
    return sorted(out, key=lambda r: (not r["fits"], r["step_s"]))


def fastest_that_fits(shape, inputs, strategies: list[str], rates: Rates | None = None) -> dict[str, Any] | None:  # noqa: ANN001
    best = candidates(shape, inputs, strategies, rates)
    return best[0] if best and best[0]["fits"] else None


def rates_for(gpu_name: str, tflops: float, link_gbps: float) -> Rates:
    """The prediction's rates on this GPU: --tflops, or T4's sustained figure on a T4, else 40% of the peak."""

    if not tflops:
        peak = next((v for k, v in PEAK_FLOPS.items() if k in gpu_name), 0.0)
        tflops = T4_TFLOPS if "T4" in gpu_name else 0.4 * peak / 1e12
    return Rates(tflops=tflops or T4_TFLOPS, link_gbps=link_gbps)


@dataclass(frozen=True)
class Layout:
    """How the run shards and syncs, as `choose_layout` decided it."""

    strategy: str  # --sharding_strategy, with AUTO decided
    reduce_each_microbatch: bool  # --reduce_every_microbatch, with auto decided
    prediction: dict[str, Any] | None = None  # the step-time prediction of this layout (GPU runs only)


def choose_layout(config: Config, env: DistEnv, model_config: Any, precision: str, accum_steps: int,
                  gpu: tuple[int, str] | None = None) -> Layout:  # fmt: skip
    """Decide --sharding_strategy AUTO and --reduce_every_microbatch auto; on a GPU also predict the step time.

    `gpu` is this GPU's (usable memory in bytes, name), from `distributed.cap_gpu_memory`; None without one. The
    config is only read: what is decided comes back as the Layout."""
    pc, tc, dc = config.parallel, config.train, config.data
    choice = pc.reduce_every_microbatch
    if gpu is None:
        return Layout("FULL_SHARD" if pc.sharding_strategy == "AUTO" else pc.sharding_strategy, choice == "true")
    inputs = Inputs(
        gpus=env.world_size, nodes=env.num_nodes, gpu_memory=gpu[0],
        batch_size=tc.batch_size, max_length=dc.max_length, accum_steps=accum_steps, precision=precision,
        activation_checkpointing=pc.activation_checkpointing, attn_implementation=config.model.attn_implementation,
        packing=dc.packing, prefetch=pc.prefetch, loss_chunk_tokens=tc.loss_chunk_tokens,
    )  # fmt: skip
    shape = Shape.of(model_config)
    rates = rates_for(gpu[1], pc.tflops, pc.link_gbps)
    allowed = [s for s in STRATEGIES if s != "HYBRID_SHARD" or env.num_nodes > 1]
    strategies = allowed if pc.sharding_strategy == "AUTO" else [pc.sharding_strategy]
    # With one micro-batch per step the two modes are one: candidates lists it once.
    options = [c for c in candidates(shape, inputs, strategies, rates)
               if choice == "auto" or accum_steps == 1 or c["reduce_every_microbatch"] == (choice == "true")]  # fmt: skip
    if not options[0]["fits"]:  # nothing fits: the least memory, so the failure (if any) is the smallest
        options.sort(key=lambda c: c["peak_bytes"])
    best = options[0]
    if pc.sharding_strategy == "AUTO":
        print0(f"note: --sharding_strategy AUTO chose {best['strategy']} (fits the memory plan with the shortest "
               f"predicted step of {', '.join(strategies)})")  # fmt: skip
    if choice == "auto" and best["reduce_every_microbatch"] and accum_steps > 1:
        print0("note: the memory plan does not fit no-sync gradient accumulation on this GPU; gradients are "
               "reduce-scattered after every micro-batch (--reduce_every_microbatch false to override)")  # fmt: skip
    return Layout(best["strategy"], best["reduce_every_microbatch"],
                  {**best, "tflops": rates.tflops, "link_gbps": rates.link_gbps})


def render_configurations(plan: dict[str, Any]) -> list[str]:
    lines = ["| configuration | peak per GPU | fits | comm per step (wire) | compute | step (predicted) |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for c in plan["configurations"]:
        sync = "reduce every micro-batch" if c["reduce_every_microbatch"] else "reduce on the last micro-batch"
        lines.append(f"| {c['strategy']}, {sync} | {gib(c['peak_bytes'])} | {'yes' if c['fits'] else 'NO'} | "
                     f"{c['communication_s']:.2f} s | {c['compute_s']:.2f} s | {c['step_s']:.2f} s |")  # fmt: skip
    pick = plan["auto_pick"]
    lines.append("auto picks: " + (f"{pick['strategy']}, " + ("reduce every micro-batch" if pick["reduce_every_microbatch"]
                 else "reduce on the last micro-batch") + f" ({pick['step_s']:.2f} s per step)" if pick else "nothing fits"))  # fmt: skip
    return lines


def describe_prediction(p: dict[str, Any] | None) -> str:
    """The run summary's line for a prediction."""
    if p is None:
        return "GPU runs only (the model's rates are a GPU's)"
    return (f"{p['step_s']:.2f} s: compute {p['compute_s']:.2f} s at {p['tflops']:.0f} TFLOPS, communication "
            f"{p['communication_s']:.2f} s at {p['link_gbps']:g} GB/s ({p['exposed_communication_s']:.2f} s not "
            f"overlapped), optimizer {p['optimizer_s']:.2f} s")  # fmt: skip


def step_time_line(step_seconds: list[float], predicted: dict[str, Any] | None) -> str | None:
    """The measured step time (median, first step left out: it allocates and warms up) beside the prediction."""
    times = sorted(step_seconds[1:] or step_seconds)
    if not times:
        return None
    measured = times[(len(times) - 1) // 2]
    line = f"step time: measured {measured:.3f} s (median of {len(times)})"
    if predicted is not None:
        line += f", predicted {predicted['step_s']:.3f} s ({measured / predicted['step_s']:.2f}x)"
    return line
