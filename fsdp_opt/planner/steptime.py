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
from dataclasses import dataclass, replace
from typing import Any

from fsdp_opt.base import gib
from fsdp_opt.config.choices import HOST_LINK_GBPS, HOST_OPTIMIZER_GBPS, T4_HBM_GBPS, T4_LINK_GBPS, T4_TFLOPS
from fsdp_opt.config.methods import SECOND_FORWARD
from fsdp_opt.planner.calibrate import ADAMW_BYTES_PER_PARAM
from fsdp_opt.planner.inputs import Inputs, shard_factor
from fsdp_opt.planner.lora import adapter_dims, adapter_params, block_base_bytes
from fsdp_opt.planner.memory import memory, peak_bytes
from fsdp_opt.runtime.gpus import MEMORY_GBPS, PEAK_FLOPS


@dataclass
class Rates:
    """What the prediction runs at. The defaults are 2xT4's; `measured` makes them from `fsdp_opt.calibrate`."""

    tflops: float = T4_TFLOPS  # sustained matmul rate of the compute dtype, per rank
    link_gbps: float = T4_LINK_GBPS  # all-gather (and all-reduce) bus bandwidth between ranks
    hbm_gbps: float = T4_HBM_GBPS  # AdamW's update at ADAMW_BYTES_PER_PARAM bytes per parameter
    memory_gbps: float = T4_HBM_GBPS  # bytes read + written per second by the step's memory-bound work
    first_touch_gbps: float = 0.0  # CPU: fresh memory mapped and zeroed by the kernel per second (0: no such cost)
    reduce_gbps: float = 0.0  # reduce-scatter bus bandwidth of fp32 gradients (0: link_gbps)
    reduce_fp16_gbps: float = 0.0  # the same of fp16 gradients, per byte (0: reduce_gbps)
    # GPUs run collectives on their own streams beside compute; CPU ranks run gloo on the cores that compute.
    overlap: bool = True
    host_link_gbps: float = HOST_LINK_GBPS  # --cpu_offload: host <-> GPU copies (PCIe)
    host_optimizer_gbps: float = HOST_OPTIMIZER_GBPS  # --cpu_offload: AdamW on the host's cores
    source: str = "2xT4 figures"

    @classmethod
    def measured(cls, m: dict[str, Any], precision: str) -> Rates:
        """From a calibration (`planner.calibrate.measure`) for runs in `precision`."""
        cpu = m["device"] == "cpu"
        return cls(
            tflops=m["matmul_tflops"][precision],
            link_gbps=m["all_gather_gbps"]["fp32"],
            hbm_gbps=m["optimizer_gbps"],
            memory_gbps=m["memory_gbps"],
            first_touch_gbps=m.get("first_touch_gbps", 0.0),
            reduce_gbps=m["reduce_scatter_gbps"]["fp32"],
            reduce_fp16_gbps=m["reduce_scatter_gbps"]["fp16"],
            overlap=not cpu,
            source=f"measured on {m['device']}, {m['world_size']} ranks",
        )

    def reduce_rate(self, fp16: bool) -> float:
        base = self.reduce_gbps or self.link_gbps
        return (self.reduce_fp16_gbps or base) if fp16 else base


def _padded(unit: tuple, shards: int) -> int:
    """Elements of a unit once each parameter's dim 0 is padded to a multiple of the shard count."""
    return sum(math.ceil(d0 / shards) * shards * (n // d0) if d0 else n for d0, n in unit)


def comm_bytes(shape, strategy: str, inputs) -> dict[str, Any]:  # noqa: ANN001
    """Collective bytes of one rank in one optimizer step, by kind, and what crosses the link (wire)."""

    f = shard_factor(strategy, inputs)
    replicas = max(1, inputs.gpus // f)
    c = 4 if inputs.precision == "fp32" else 2
    r = 2 if inputs.reduce_dtype == "fp16" else 4  # bytes of a reduced gradient
    micro = inputs.accum_steps
    reduces = micro if inputs.reduce_every_microbatch or micro == 1 else 1
    root, blocks = shape.units[0], shape.units[1:]
    root_padded, blocks_padded = _padded(root, f), sum(_padded(b, f) for b in blocks)
    block_gathers = 2 if strategy in ("FULL_SHARD", "HYBRID_SHARD") else 1
    sharded = f > 1
    gathered_elements = root_padded + block_gathers * blocks_padded
    gathered = c * gathered_elements
    reduced = r * (root_padded + blocks_padded)  # every parameter's gradient
    root_reduced = r * root_padded
    reduced_elements = root_padded + blocks_padded
    if getattr(inputs, "lora_rank", 0):
        # LoRA: the frozen base is gathered as stored (NF4 with --base_bits 4) with the adapters; only the adapters'
        # gradients are reduced (the root has none).

        adapters = _padded(adapter_dims(shape, inputs), f)
        block = block_base_bytes(shape, inputs, c) + c * adapters
        gathered = int(c * root_padded + block_gathers * len(blocks) * block)
        gathered_elements = adapters * block_gathers * len(blocks)  # what an offloaded run copies: the adapters
        reduced, root_reduced, reduced_elements = r * adapters * len(blocks), 0, adapters * len(blocks)
    out = {
        "all_gather": micro * gathered if sharded else 0,
        "reduce_scatter": reduces * reduced if sharded else 0,
        "all_reduce": reduces * reduced // f if replicas > 1 else 0,
    }
    out["gather_wire"] = int((f - 1) / f * out["all_gather"])
    out["reduce_wire"] = int((f - 1) / f * out["reduce_scatter"])
    out["all_reduce_wire"] = int(2 * (replicas - 1) / replicas * out["all_reduce"])
    out["wire"] = out["gather_wire"] + out["reduce_wire"] + out["all_reduce_wire"]
    # What waits on the link with no compute beside it: the root's gather and its reduce-scatter, every micro-batch.
    out["exposed_gather_wire"] = int((f - 1) / f * micro * c * root_padded) if sharded else 0
    out["exposed_reduce_wire"] = int((f - 1) / f * reduces * root_reduced) if sharded else 0
    out["exposed_wire"] = out["exposed_gather_wire"] + out["exposed_reduce_wire"]
    # --cpu_offload: each gather first copies the fp32 shard to the GPU; each reduce copies the fp32 shard back.
    out["host_copies"] = 4 * (micro * gathered_elements + reduces * reduced_elements) // f if inputs.cpu_offload else 0
    return out


def compute_flops(shape, inputs) -> float:  # noqa: ANN001
    """Hardware FLOPs of one rank's step: forward, backward, the recomputed forward of activation checkpointing, the
    output projection again with a chunked loss."""
    tokens = inputs.batch_size * inputs.max_length * inputs.accum_steps
    lora = bool(getattr(inputs, "lora_rank", 0))
    # forward + input gradients (+ weight gradients, which a frozen base does not compute)
    passes = 2.0 if lora else 3.0
    s, L, h = inputs.max_length, shape.layers, shape.hidden
    per_token = 2.0 * passes * shape.flop_params + 4.0 * passes * L * h * s
    if inputs.activation_checkpointing:  # one more forward of the blocks
        per_token += 2.0 * (shape.flop_params - shape.vocab * h) + 4.0 * L * h * s
    if inputs.loss_chunk_tokens:  # the output projection again, in backward
        per_token += 2.0 * shape.vocab * h
    return tokens * per_token


def memory_traffic(shape, strategy: str, inputs) -> tuple[float, float]:  # noqa: ANN001
    """Bytes one rank reads and writes in a step outside matmuls and collectives (memory-bound work; on CPU it is a
    large share of the step), and the part of them written into freshly allocated memory:
    - each gather: the shard cast to the compute dtype into the gather's input, the gathered unit (a new buffer)
      copied out into the parameters' new storage (one rank's "gather", NO_SHARD's, only casts);
    - each micro-batch's gradients: written in the compute dtype by backward, copied (cast) into a new buffer in
      the reduce dtype, and added in place to what earlier micro-batches left when accumulating without sync;
    - activations: the tensors a block saves written in forward and read in backward (twice with activation
      checkpointing, which makes them again), and the logits with their fp32 copies and gradient."""
    f = shard_factor(strategy, inputs)
    c = 4 if inputs.precision == "fp32" else 2
    r = 2 if inputs.reduce_dtype == "fp16" else 4
    micro = inputs.accum_steps
    block_gathers = 2 if strategy in ("FULL_SHARD", "HYBRID_SHARD") else 1
    gathered = shape.root_params + block_gathers * shape.layers * shape.block_params
    lora = bool(getattr(inputs, "lora_rank", 0))
    trainable = adapter_params(shape, inputs) if lora else shape.params
    if f > 1:
        gathers = micro * gathered * ((4 + c) / f + 2 * c)
        gathers_fresh = micro * gathered * (c / f + 2 * c)
    else:  # FSDP2 skips a one-rank gather: the parameters are made from the shard, cast if the dtype differs
        gathers = micro * gathered * (4 + c) if c != 4 else 0
        gathers_fresh = micro * gathered * c if c != 4 else 0
    accumulating = 0 if inputs.reduce_every_microbatch else max(0, micro - 1)
    grads = trainable * (micro * (c + c + r) + accumulating * 3 * r)
    grads_fresh = trainable * micro * (c + r)
    parts = memory(shape, "FULL_SHARD", replace(inputs, activation_checkpointing=False))
    saved = (parts["activations"] + parts["logits"]) * (2 if inputs.activation_checkpointing else 1)
    return gathers + grads + micro * 2 * saved, gathers_fresh + grads_fresh + micro * saved


def step_time(shape, strategy: str, inputs, rates: Rates | None = None) -> dict[str, float]:  # noqa: ANN001
    """Predicted seconds of one optimizer step on each rank, and its parts."""

    rates = rates or Rates()
    flops = compute_flops(shape, inputs)
    compute = flops / (rates.tflops * 1e12)
    traffic, fresh = memory_traffic(shape, strategy, inputs)
    memory_bound = traffic / (rates.memory_gbps * 1e9) + (
        fresh / (rates.first_touch_gbps * 1e9) if rates.first_touch_gbps else 0.0
    )
    busy = compute + memory_bound  # the device's own work: matmuls, then what memory bandwidth bounds
    comm = comm_bytes(shape, strategy, inputs)
    link, reduce = rates.link_gbps * 1e9, rates.reduce_rate(inputs.reduce_dtype == "fp16") * 1e9
    gather_s, reduce_s = comm["gather_wire"] / link, comm["reduce_wire"] / reduce
    all_reduce_s = comm["all_reduce_wire"] / reduce
    host_s = comm["host_copies"] / (rates.host_link_gbps * 1e9)
    communication = gather_s + reduce_s + all_reduce_s
    exposed = comm["exposed_gather_wire"] / link + comm["exposed_reduce_wire"] / reduce
    trainable = adapter_params(shape, inputs) if getattr(inputs, "lora_rank", 0) else shape.params
    local = math.ceil(trainable / shard_factor(strategy, inputs))
    if inputs.cpu_offload:
        optimizer = ADAMW_BYTES_PER_PARAM * local / (rates.host_optimizer_gbps * 1e9)
    else:
        optimizer = ADAMW_BYTES_PER_PARAM * local / (rates.hbm_gbps * 1e9)
    if rates.overlap:
        step = max(busy, communication + host_s - exposed) + exposed + optimizer
    else:  # one set of cores does everything in turn
        step = busy + communication + host_s + optimizer
    second = 0.0
    if SECOND_FORWARD in inputs.method.spec.phases:  # a forward without gradients of each micro-batch (KTO's KL)
        rows = inputs.batch_size * inputs.accum_steps * inputs.gpus
        second = forward_time(shape, strategy, inputs, rows, rates)["seconds"]
        step += second
    return {
        "compute_s": compute,
        "second_forward_s": second,
        "memory_bound_s": memory_bound,
        "communication_s": communication,
        "exposed_communication_s": exposed if rates.overlap else communication,
        "host_copies_s": host_s,
        "optimizer_s": optimizer,
        "step_s": step,
        "hardware_flops_per_token": flops / (inputs.batch_size * inputs.max_length * inputs.accum_steps),
    }


def forward_time(shape, strategy: str, inputs, rows: int, rates: Rates | None = None) -> dict[str, float]:  # noqa: ANN001
    """Predicted seconds for forward passes without gradients over `rows` rows of --max_length tokens, spread over the
    ranks in micro-batches of --batch_size rows (the DPO reference pass, GRPO's prefill and log-probabilities): the
    forward's matmuls, one gather of every unit per micro-batch (a frozen model's weights are stored in the compute
    dtype: no cast), the logits written and read once, and the root's gather that nothing overlaps."""
    rates = rates or Rates()
    f = shard_factor(strategy, inputs)
    c = 4 if inputs.precision == "fp32" else 2
    s, L, h = inputs.max_length, shape.layers, shape.hidden
    per_rank = math.ceil(rows / max(1, inputs.gpus))
    micro = math.ceil(per_rank / max(1, inputs.batch_size))
    compute = per_rank * s * (2.0 * shape.flop_params + 4.0 * L * h * s) / (rates.tflops * 1e12)
    root, blocks = shape.units[0], shape.units[1:]
    root_padded, blocks_padded = _padded(root, f), sum(_padded(b, f) for b in blocks)
    sharded = f > 1
    gathered = c * (root_padded + blocks_padded)
    traffic = micro * (gathered * (1 / f + 1) if sharded else 0) + per_rank * s * shape.vocab * (c + 4) * 2
    memory_bound = traffic / (rates.memory_gbps * 1e9)
    link = rates.link_gbps * 1e9
    comm = micro * (f - 1) / f * gathered / link if sharded else 0.0
    exposed = micro * (f - 1) / f * c * root_padded / link if sharded else 0.0
    busy = compute + memory_bound
    total = max(busy, comm - exposed) + exposed if rates.overlap else busy + comm
    return {"compute_s": compute, "memory_bound_s": memory_bound, "communication_s": comm, "seconds": total}


def candidates(shape, inputs, strategies: list[str], rates: Rates | None = None) -> list[dict[str, Any]]:  # noqa: ANN001
    """Every strategy and accumulation mode with its peak memory and predicted step time, fastest first."""

    out = []
    for strategy in strategies:
        for every in (False, True) if inputs.accum_steps > 1 else (False,):
            this = Inputs(**{**inputs.__dict__, "reduce_every_microbatch": every})
            peak = peak_bytes(memory(shape, strategy, this))
            out.append(
                {
                    "strategy": strategy,
                    "reduce_every_microbatch": every,
                    "peak_bytes": peak,
                    "fits": peak <= inputs.gpu_memory,
                    **step_time(shape, strategy, this, rates),
                }
            )
    return sorted(out, key=lambda r: (not r["fits"], r["step_s"]))


def fastest_that_fits(shape, inputs, strategies: list[str], rates: Rates | None = None) -> dict[str, Any] | None:  # noqa: ANN001
    best = candidates(shape, inputs, strategies, rates)
    return best[0] if best and best[0]["fits"] else None


def rates_for(gpu_name: str, tflops: float, link_gbps: float) -> Rates:
    """The prediction's rates on this GPU: --tflops, or T4's sustained figure on a T4, else 40% of the peak; its memory
    bandwidth from the datasheet (a T4's where the name is not known)."""

    if not tflops:
        peak = next((v for k, v in PEAK_FLOPS.items() if k in gpu_name), 0.0)
        tflops = T4_TFLOPS if "T4" in gpu_name else 0.4 * peak / 1e12
    hbm = next((v for k, v in MEMORY_GBPS.items() if k in gpu_name), T4_HBM_GBPS)
    return Rates(tflops=tflops or T4_TFLOPS, link_gbps=link_gbps, hbm_gbps=hbm)


def render_configurations(plan: dict[str, Any]) -> list[str]:
    lines = [
        "| configuration | peak per GPU | fits | comm per step (wire) | compute | step (predicted) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c in plan["configurations"]:
        sync = "reduce every micro-batch" if c["reduce_every_microbatch"] else "reduce on the last micro-batch"
        lines.append(
            f"| {c['strategy']}, {sync} | {gib(c['peak_bytes'])} | {'yes' if c['fits'] else 'NO'} | "
            f"{c['communication_s']:.2f} s | {c['compute_s']:.2f} s | {c['step_s']:.2f} s |"
        )
    pick = plan["auto_pick"]
    lines.append(
        "auto picks: "
        + (
            f"{pick['strategy']}, "
            + ("reduce every micro-batch" if pick["reduce_every_microbatch"] else "reduce on the last micro-batch")
            + f" ({pick['step_s']:.2f} s per step)"
            if pick
            else "nothing fits"
        )
    )
    return lines


def describe_prediction(p: dict[str, Any] | None) -> str:
    """The run summary's line for a prediction."""
    if p is None:
        return "GPU runs only (the model's rates are a GPU's)"
    line = (
        f"{p['step_s']:.2f} s: compute {p['compute_s']:.2f} s at {p['tflops']:.3g} TFLOPS, memory-bound work "
        f"{p.get('memory_bound_s', 0.0):.2f} s, communication "
        f"{p['communication_s']:.2f} s at {p['link_gbps']:.3g} GB/s ({p['exposed_communication_s']:.2f} s not "
        f"overlapped), optimizer {p['optimizer_s']:.2f} s"
    )
    if "generation_s" in p:  # --method grpo (planner/generation.py with_generation)
        line += f"; generation {p['generation_s']:.2f} s, reference forward {p['reference_s']:.2f} s"
        if p.get("shared_steps", 1) > 1:
            line += (
                f", old log-probabilities {p['old_logps_s']:.2f} s (each a step's share of a generation that "
                f"feeds {p['shared_steps']} steps)"
            )
    return line


def step_time_line(step_seconds: list[float], predicted: dict[str, Any] | None) -> str | None:
    """The measured step time (median, first step left out: it allocates and warms up) beside the prediction."""
    times = sorted(step_seconds[1:] or step_seconds)
    if not times:
        return None
    measured, how = times[(len(times) - 1) // 2], "median"
    if predicted is not None and predicted.get("shared_steps", 1) > 1:  # a generation's steps differ: their mean
        measured, how = sum(times) / len(times), "mean"
    line = f"step time: measured {measured:.3f} s ({how} of {len(times)})"
    if predicted is not None:
        line += f", predicted {predicted['step_s']:.3f} s ({measured / predicted['step_s']:.2f}x)"
    return line
