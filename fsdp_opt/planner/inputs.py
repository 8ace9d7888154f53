"""What the planner is asked about (`Inputs`: GPUs, memory, batch, precision, LoRA ...), the shard factor of a
strategy, the resident training state per GPU, and the runtime's fixed costs the counters do not see."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from fsdp_opt.base import GIB
from fsdp_opt.config.choices import shard_count
from fsdp_opt.config.method import MethodConfig
from fsdp_opt.data.prompts import generation_slices
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
    # the trainer's --method with its settings: dpo and kto add their reference pass (planner/dpo.py), a method that
    # samples its generation phase (planner/generation.py), distillation its teacher
    method: MethodConfig = field(default_factory=MethodConfig)

    @property
    def method_name(self) -> str:
        return self.method.method

    @property
    def ref_model(self) -> bool:
        """A reference named by --ref_model: with LoRA, a model of its own instead of the base with its adapters off."""
        return bool(getattr(self.method.settings, "ref_model", None))

    @property
    def generations(self) -> int:
        """Completions sampled per prompt (a group's, or one)."""
        return self.method.completions_per_prompt

    @property
    def completion_length(self) -> int:
        return getattr(self.method.settings, "max_completion_length", 256)

    @property
    def beta(self) -> float:
        """The weight of a reference kept beside the policy (> 0: its forward on the completions), else 0."""
        return self.method.settings.beta if self.method.uses_reference and self.method.spec.generates else 0.0

    @property
    def decoding(self) -> str:
        return getattr(self.method.settings, "decoding", "static")

    @property
    def iterations(self) -> int:
        return getattr(self.method.settings, "num_iterations", 1)

    @property
    def generation_slices(self) -> int:
        """The steps' worth of prompts a generation takes (--steps_per_generation over --accum_steps)."""
        return generation_slices(getattr(self.method.settings, "steps_per_generation", None), self.accum_steps)

    @property
    def teacher(self) -> str | None:
        return getattr(self.method.settings, "teacher_model", None)

    @property
    def teacher_bits(self) -> int:
        return getattr(self.method.settings, "teacher_bits", 16)

    def described(self) -> dict:
        """The inputs as plain values (the plan's JSON): the method by name with its settings."""
        plain = {k: v for k, v in self.__dict__.items() if k != "method"}
        return {**plain, "method": self.method_name, "method_settings": dataclasses.asdict(self.method.settings)}


def shard_factor(strategy: str, inputs: Inputs) -> int:
    return shard_count(strategy, inputs.gpus, inputs.gpus // inputs.nodes)


def state_bytes(shape: Shape, strategy: str, inputs: Inputs) -> dict[str, int]:
    """Resident training state per GPU: fp32 weights, fp32 gradients, Adam m and v, all sharded."""
    f = shard_factor(strategy, inputs)
    per = math.ceil(shape.params / f)
    return {"parameters": 4 * per, "gradients": 4 * per, "optimizer": 8 * per}
