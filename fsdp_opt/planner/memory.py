"""Peak bytes per GPU by component for one micro-batch: training state, accumulated gradients, gathered weights,
reduce-scatter buffers, activations, the attention mask, logits, LoRA's parts, the runtime. And the questions asked
of it: the peak, the largest micro-batch that fits, whether gradients must be reduced every micro-batch."""

from __future__ import annotations

from fsdp_opt.model.shapes import Shape
from fsdp_opt.planner.inputs import (
    CUDA_CONTEXT_BYTES,
    FRAGMENTATION,
    NCCL_BUFFER_BYTES,
    Inputs,
    shard_factor,
    state_bytes,
)
from fsdp_opt.planner.lora import components


def memory(shape: Shape, strategy: str, inputs: Inputs, batch_size: int | None = None) -> dict[str, int]:
    """Peak bytes per GPU by component for one micro-batch of `batch_size` sequences."""
    b = inputs.batch_size if batch_size is None else batch_size
    if inputs.packing == "pad":  # a micro-batch of rows: each row's sequences padded (a preference pair: two)
        b *= inputs.method.spec.sequences_per_row
    s, h, L = inputs.max_length, shape.hidden, shape.layers
    c = 4 if inputs.precision == "fp32" else 2  # compute dtype: gathered weights, activations
    r = 2 if inputs.reduce_dtype == "fp16" else 4  # a reduced gradient's bytes
    out = state_bytes(shape, strategy, inputs)
    # Without gradient sync between micro-batches FSDP keeps an unsharded gradient until the last one, in the reduce
    # dtype (fp32; with --reduce_dtype fp16 the compute dtype's own gradient).
    out["accumulated_gradients"] = (
        r * shape.params if inputs.accum_steps > 1 and not inputs.reduce_every_microbatch else 0
    )
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
    out["reduce_scatter"] = (c + r) * max(shape.root_params, shape.block_params)
    full_layer = layer_bytes(shape, inputs, b, c)
    if inputs.activation_checkpointing:
        out["activations"] = L * s * b * h * c + full_layer  # block inputs, plus one block being recomputed
    else:
        out["activations"] = L * full_layer
    out["attention_mask"] = mask_bytes(shape, inputs, b, c)
    # Logits in the compute dtype, their fp32 copy for the loss, the saved log-softmax and the fp32 gradient.
    out["logits"] = s * b * shape.vocab * (c + 4 + 4 + 4 if c == 2 else 12)
    if shape.plain_head:
        # The loss runs the output layer itself (engine/loss.py HeadLoss): the model's output holds no logits through
        # backward (2 bytes less a position in fp16, 4 in fp32; the simulated opt-1.3b step at 4 x 512: 206 and 412 MB
        # less). Every position counted as a target, the worst case: a prompt or padding adds none.
        out["logits"] = s * b * shape.vocab * (12 if c == 2 else 8)
    if inputs.loss_chunk_tokens:
        # One chunk at a time, at its peak in backward's recompute: the same, plus its gradient in the compute dtype.
        out["logits"] = min(inputs.loss_chunk_tokens, s * b) * shape.vocab * (2 * c + 12 if c == 2 else 16)
    if inputs.lora_rank:
        out.update(components(shape, strategy, inputs, b, c, r))
    if inputs.cpu_offload:  # the sharded state lives in host memory (host.py counts it there)
        out.update(parameters=0, gradients=0, optimizer=0)
    if inputs.cuda:
        nccl = NCCL_BUFFER_BYTES if inputs.gpus > 1 else 0
        out["runtime"] = CUDA_CONTEXT_BYTES + nccl + int(FRAGMENTATION * peak_bytes(out))
    return out


def layer_bytes(shape: Shape, inputs: Inputs, b: int, c: int) -> int:
    """Every tensor one block keeps for backward, in bytes per token and hidden unit at 2-byte activations: 34
    (Korthikanti et al.: a GeLU MLP of 4h keeps its input, 2, the activation's input, 8, and its output, 8; two
    dropout masks, 1 each; under SDPA the kernel's saved output, 2, takes the place of the softmax terms, which models
    without dropout pay for with their missing masks). A ReLU MLP (OPT) keeps only the activation's output, which
    the next linear reads too: 8 fewer, 26 without dropout (a DPO run), 28 with it; the plan takes 28 (opt-1.3b's
    simulated step holds 27.3). Eager attention adds the scores, their softmax and its dropout: 5 bytes per head
    and pair of positions."""
    s, h = inputs.max_length, shape.hidden
    attention = 5 * shape.heads * s * s * b * c // 2 if inputs.attn_implementation == "eager" else 0
    if shape.gated_mlp:
        # A gated MLP (SiLU or GeLU gate times an up projection) keeps four tensors of its width: the gate's and the
        # up projection's outputs, the activation's and the product; the rest of the block (norms, rotary embeddings,
        # SDPA's saved output) about 18 units. Fitted to the simulated step of Llama-3.2-1B's and Qwen2.5-1.5B's
        # shapes (49.2 and 63.5 units against 50 and 64.6).
        units = 18 + 8 * (shape.intermediate or 4 * h) / h
        return int(units * s * b * h * c / 2) + attention
    return (28 if shape.relu_mlp else 34) * s * b * h * c // 2 + attention


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
    return memory(shape, "FULL_SHARD", Inputs(**{**inputs.__dict__, "activation_checkpointing": checkpointing}))[
        "activations"
    ]


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
