"""The plan of a LoRA run (`python -m fsdp_opt.plan --lora_rank R`): per GPU, the frozen base in its storage dtype (or
NF4 with --base_bits 4), the fp32 adapters, their gradients and AdamW state; the gathers and reduce-scatters; the
adapters' dropout copies among the activations; checkpoint and export sizes.

The adapters of a linear layer (in -> out) are lora_A (rank x in) and lora_B (out x rank): rank x (in + out) fp32
parameters. Only they have gradients, optimizer state, or a place in a checkpoint.
"""

from __future__ import annotations

import math
from typing import Any

from fsdp_opt.planner.inputs import shard_factor

# torchao's NF4 tensor: 4 bits per weight, one int8 scale per 64 weights, one fp32 factor per 256 scales.
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)

# The live peak of dequantizing one NF4 weight to fp16, per weight: 15.8 to 17.1 bytes measured on CPU (torchao 0.18,
# the process's peak RSS, reset just before `linear(x, nf4_weight)`, at three shapes; tests/test_cuda_paths.py measures
# it again), rounded up.
NF4_DEQUANT_BYTES = 18


def chosen(shape, targets: str | None) -> list[tuple[str, int, int]]:  # noqa: ANN001
    """The linear layers of one block that get adapters: (leaf name, in, out)."""
    if not targets:
        return list(shape.linears)
    wanted = {t.strip().rsplit(".", 1)[-1] for t in targets.split(",") if t.strip()}
    return [lin for lin in shape.linears if lin[0] in wanted]


def adapter_dims(shape, inputs) -> tuple:  # noqa: ANN001
    """(dim 0, elements) of each adapter tensor of one block, as FSDP2 shards them."""
    r = inputs.lora_rank
    out: list[tuple[int, int]] = []
    for _, d_in, d_out in chosen(shape, inputs.lora_targets):
        out += [(r, r * d_in), (d_out, d_out * r)]
    return tuple(out)


def adapter_params(shape, inputs) -> int:  # noqa: ANN001
    return shape.layers * sum(n for _, n in adapter_dims(shape, inputs))


def block_base_bytes(shape, inputs, c: int) -> float:  # noqa: ANN001
    """Bytes of one block's frozen weights as stored: all in the compute dtype, or its linear weights in NF4."""
    linear = sum(d_in * d_out for _, d_in, d_out in shape.linears)
    if inputs.base_bits == 4:
        return NF4_BYTES_PER_PARAM * linear + c * (shape.block_params - linear)
    return c * shape.block_params


def components(shape, strategy: str, inputs, b: int, c: int, r: int = 4) -> dict[str, Any]:  # noqa: ANN001
    """The components of plan.memory() that LoRA changes."""

    f = shard_factor(strategy, inputs)
    unit = sum(n for _, n in adapter_dims(shape, inputs))
    total = shape.layers * unit
    base = c * shape.root_params + shape.layers * block_base_bytes(shape, inputs, c)
    local = math.ceil(total / f)
    keeps_all = strategy in ("SHARD_GRAD_OP", "NO_SHARD")
    held = shape.layers if keeps_all else min(shape.layers, 1 + max(1, inputs.prefetch))
    gathered_block = block_base_bytes(shape, inputs, c) + c * unit
    buffer = max(c * shape.root_params, gathered_block) if f > 1 else 0
    # An NF4 weight is dequantized for its matmul, one at a time, through temporaries (the unpacked codes, their
    # values, the scales spread out) that peak at NF4_DEQUANT_BYTES per weight, the compute-dtype result included.
    dequantized = (
        NF4_DEQUANT_BYTES * max((i * o for _, i, o in shape.linears), default=0) if inputs.base_bits == 4 else 0
    )
    # lora_dropout makes its own copy of each adapted layer's input, kept for backward: one block's worth under
    # activation checkpointing (the block being recomputed), every block's without.
    inputs_of_adapted = sum(i for _, i, _ in chosen(shape, inputs.lora_targets))
    dropout = inputs_of_adapted * b * inputs.max_length * c if inputs.lora_dropout > 0 else 0
    return {
        "parameters": int(math.ceil(base / f)) + 4 * local,
        "gradients": 4 * local,
        "optimizer": 8 * local,
        "accumulated_gradients": r * total if inputs.accum_steps > 1 and not inputs.reduce_every_microbatch else 0,
        "gathered_weights": int(c * shape.root_params + held * gathered_block + buffer + dequantized),
        "reduce_scatter": (c + r) * unit,
        "adapter_dropout": dropout * (1 if inputs.activation_checkpointing else shape.layers),
    }


def checkpoints(shape, inputs) -> dict[str, int]:  # noqa: ANN001
    """A LoRA checkpoint holds the adapters and their AdamW state, never the base."""
    a = adapter_params(shape, inputs)
    return {
        "full_with_optimizer": 12 * a,
        "full_weights_only": 4 * a,
        "sharded_with_optimizer_per_rank": math.ceil(12 * a / inputs.gpus),
        "export_fp16": 2 * a,  # the adapter folder
        "merged_export_fp16": 2 * shape.params,
    }


def describe(shape, inputs) -> str:  # noqa: ANN001
    a = adapter_params(shape, inputs)
    names = ", ".join(name for name, _, _ in chosen(shape, inputs.lora_targets))
    base = "NF4 (4-bit)" if inputs.base_bits == 4 else inputs.precision
    return (
        f"LoRA rank {inputs.lora_rank} on {names} of each block: {a:,} trainable parameters "
        f"({100 * a / shape.params:.2f}%); the base frozen in {base}"
    )
