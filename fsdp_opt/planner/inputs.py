"""What the planner is asked about (`Inputs`: GPUs, memory, batch, precision, LoRA ...), the shard factor of a
strategy, the resident training state per GPU, and the runtime's fixed costs the counters do not see."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fsdp_opt.base import GIB
from fsdp_opt.config.choices import shard_count
from fsdp_opt.model.shapes import Shape

# Allocator slack, the CUDA context and NCCL's buffers (with 2 GPUs or more), which torch's counters do not see.
CUDA_CONTEXT_BYTES = int(0.45 * GIB)

NCCL_BUFFER_BYTES = int(0.25 * GIB)

FRAGMENTATION = 0.05


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
    reduce_dtype: str = "fp32"  # the trainer's --reduce_dtype: gradients reduce-scattered in fp32 or fp16
    cpu_offload: bool = False  # the trainer's --cpu_offload: sharded state in host memory, AdamW on the host
    method: str = "sft"  # the trainer's --method: dpo adds the reference pass (planner/dpo.py), grpo its generation
    ref_model: bool = False  # --method dpo with --ref_model: a LoRA run's reference is a model of its own
    generations: int = 8  # --method grpo: --num_generations
    completion_length: int = 256  # --method grpo: --max_completion_length
    beta: float = 0.0  # --method grpo: the KL weight (> 0: a reference model's forward, kept beside the policy)
    decoding: str = "static"  # --method grpo: --decoding (graphs: each decoding step a CUDA graph's replay)
    iterations: int = 1  # --method grpo: --num_iterations
    generation_slices: int = 1  # --method grpo: the steps' worth of prompts a generation takes (--steps_per_generation)
    teacher: str | None = None  # --method distill: --teacher_model (kept beside the model: its memory, its forward)
    teacher_bits: int = 16  # --method distill: --teacher_bits (4: the teacher's blocks' linear weights in NF4)


def shard_factor(strategy: str, inputs: Inputs) -> int:
    return shard_count(strategy, inputs.gpus, inputs.gpus // inputs.nodes)


def state_bytes(shape: Shape, strategy: str, inputs: Inputs) -> dict[str, int]:
    """Resident training state per GPU: fp32 weights, fp32 gradients, Adam m and v, all sharded."""
    f = shard_factor(strategy, inputs)
    per = math.ceil(shape.params / f)
    return {"parameters": 4 * per, "gradients": 4 * per, "optimizer": 8 * per}
