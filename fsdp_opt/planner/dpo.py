"""--method dpo in the plan: the training step, and the reference pass before it.

The step: under --packing docs a micro-batch is --batch_size blocks whichever pairs fill them, so its memory is an SFT
step's at the same blocks (the per-token log-probabilities the pair sums read are a vector of the micro-batch's
tokens); under --packing pad it holds --batch_size pairs, twice as many sequences.

The reference pass (full fine-tuning, or LoRA with --ref_model): before the trainable model is built, the reference is
loaded sharded with its weights frozen in the compute dtype and run forward, without gradients, over the session's
pairs; then freed. Its peak per GPU is the sharded weights and the larger of two moments: inside the blocks (the units
gathered around the one computing, as training gathers them, one block's forward tensors and the attention mask) and
at the loss (the root's weights gathered, the logits with their fp32 copy and its log-softmax; where the output layer
is a plain projection, of the answer tokens only, counted here as if every position were one, and the half-precision
logits freed as they are copied). Its time: a
forward of two sequences per pair, a third of a training step's work per sequence (a quarter with activation
checkpointing, whose recompute it does not do). A LoRA run without --ref_model scores with its own model, adapters off:
no memory beyond training's, the same forward time.
"""

from __future__ import annotations

import math
from typing import Any

from fsdp_opt.base import gib
from fsdp_opt.config.methods import spec
from fsdp_opt.model.shapes import Shape
from fsdp_opt.planner.inputs import CUDA_CONTEXT_BYTES, FRAGMENTATION, NCCL_BUFFER_BYTES, Inputs, shard_factor
from fsdp_opt.planner.memory import layer_bytes, mask_bytes
from fsdp_opt.planner.steptime import Rates, forward_time


def reference_memory(shape: Shape, strategy: str, inputs: Inputs) -> dict[str, int]:
    """Bytes per GPU of the reference pass by component (each at its own peak; reference_peak adds them up)."""
    b, s = inputs.batch_size * (2 if inputs.packing == "pad" else 1), inputs.max_length
    c = 4 if inputs.precision == "fp32" else 2
    f = shard_factor(strategy, inputs)
    held = shape.layers if strategy in ("SHARD_GRAD_OP", "NO_SHARD") else min(shape.layers, 1 + max(1, inputs.prefetch))
    gather_buffer = c * max(shape.root_params, shape.block_params) if f > 1 else 0
    out = {
        "parameters": c * math.ceil(shape.params / f),
        "gathered_weights": c * (shape.root_params + held * shape.block_params) + gather_buffer,
        "activations": layer_bytes(shape, inputs, b, c),  # one block's forward tensors, freed as the next runs
        "attention_mask": mask_bytes(shape, Inputs(**{**inputs.__dict__, "activation_checkpointing": True}), b, c),
        # the logits in the compute dtype, their fp32 copy and its log-softmax; where the loss runs the output layer
        # itself (HeadLoss) the half-precision product is a temporary, freed as its fp32 copy is made
        "logits": s * b * shape.vocab * (c + 4 + 4 if c == 2 and not shape.plain_head else 8),
    }
    out["root_at_loss"] = c * shape.root_params  # the root (embeddings, head) gathered while the loss is computed
    if inputs.cuda:
        nccl = NCCL_BUFFER_BYTES if inputs.gpus > 1 else 0
        out["runtime"] = CUDA_CONTEXT_BYTES + nccl + int(FRAGMENTATION * reference_peak(out, runtime=False))
    return out


def reference_peak(parts: dict[str, int], runtime: bool = True) -> int:
    """The pass's peak: the weights, and the larger of its two moments (the blocks, the loss)."""
    blocks = parts["gathered_weights"] + parts["activations"] + parts["attention_mask"]
    loss = parts["root_at_loss"] + parts["logits"]
    return parts["parameters"] + max(blocks, loss) + (parts.get("runtime", 0) if runtime else 0)


def reference_pass(shape: Shape, strategy: str, inputs: Inputs, rates: Rates | None, own_model: bool) -> dict[str, Any]:
    """The reference pass's memory (a model of its own) and its seconds per 1,000 pairs: forward passes over two rows
    of --max_length tokens per pair (a bound: a docs block holds one sequence of max_length tokens at most)."""
    rows_per_micro = inputs.batch_size * (2 if inputs.packing == "pad" else 1)
    seconds = forward_time(shape, strategy, Inputs(**{**inputs.__dict__, "batch_size": rows_per_micro}), 2000, rates)[
        "seconds"
    ]
    out: dict[str, Any] = {"own_model": own_model, "seconds_per_1000_pairs": seconds}
    if not own_model:
        parts = reference_memory(shape, strategy, inputs)
        peak = reference_peak(parts)
        out.update(components=parts, total_bytes=peak, fits=peak <= inputs.gpu_memory)
    return out


def reference_line(ref: dict[str, Any], strategy: str, gpu_memory: int, method: str = "dpo") -> str:
    """The plan's line on a method's reference pass (DPO's: two sequences a pair; KTO's: two an item, its own and
    a mismatched one)."""
    unit = spec(method).unit
    time = f"about {ref['seconds_per_1000_pairs']:,.0f} s per 1,000 {unit}s"
    if ref["own_model"]:
        return (
            f"{method} reference pass: the run's own model with its adapters off, before training: no memory beyond "
            f"training's, {time}"
        )
    verdict = "fits" if ref["fits"] else "DOES NOT FIT"
    return (
        f"{method} reference pass ({strategy}): {gib(ref['total_bytes'])} per GPU at its peak (its model sharded in the "
        f"compute dtype, freed before training), of {gib(gpu_memory)}: {verdict}; {time}"
    )
