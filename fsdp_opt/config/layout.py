"""Flags of how a run lays itself out: the parallel layout (sharding, precision, the step's layout on the GPUs) and
LoRA's adapters.

Each field's `help` metadata is its flag's help text; the flag is `--<field name>`. `__post_init__` raises a
`ConfigError` naming the flag, before anything is built or written."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_opt.base import ConfigError, parse_size
from fsdp_opt.config.choices import DEVICES, PRECISIONS, STRATEGIES, T4_LINK_GBPS
from fsdp_opt.config.flags import flag, tri_state


@dataclass
class ParallelConfig:
    sharding_strategy: str = flag(
        "FULL_SHARD",
        "FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2: keep gathered weights until backward), "
        "HYBRID_SHARD (shard within a node, replicate across nodes), NO_SHARD (DDP-like replication), or AUTO: on "
        "a GPU, the one the memory plan fits with the shortest predicted step (plan's step-time model; FULL_SHARD "
        "on CPU).",
        type=str.upper,
        choices=STRATEGIES + ("AUTO",),
    )
    precision: str = flag(
        "auto",
        "Compute precision. auto: bf16 on GPUs that support it, fp16 on others (e.g. T4), fp32 on CPU.",
        type=str.lower,
        choices=PRECISIONS,
    )
    activation_checkpointing: bool = flag(True, "Recompute each decoder layer in backward to save memory.")
    cpu_offload: bool = flag(False, "Keep sharded parameters, gradients and optimizer state in CPU memory.")
    reduce_every_microbatch: str = tri_state(
        "Reduce-scatter gradients after every micro-batch instead of only the last one of a step: less memory "
        "(no unsharded fp32 gradient kept between micro-batches, 4 bytes per parameter), more communication. "
        "auto: on a GPU, whichever of the two fits with the shorter predicted step (without sync when both fit); "
        "never on CPU."
    )
    reduce_dtype: str = flag(
        "fp32",
        "Dtype of the gradient reduce-scatter. fp32: exact sums. fp16 (with --precision fp16): half the bytes on the "
        "link, the gradients accumulated in fp16 between micro-batches; an overflow in the sum shows as a non-finite "
        "gradient norm, and the step is skipped and the loss scale halved. auto: the plan's choice (fp16 where it "
        "predicts a shorter step).",
        type=str.lower,
        choices=["fp32", "fp16", "auto"],
    )
    compile: bool = flag(
        False, "torch.compile each decoder block's forward (FSDP2's gathers stay eager); the first steps compile."
    )
    prefetch: int = flag(
        0,
        "Gather the weights of the next N blocks ahead, in forward and in backward (FSDP2 explicit prefetch); "
        "each holds one more gathered block in memory. 0: FSDP2's own order (one block ahead in backward).",
    )
    max_gpu_memory: str | None = flag(
        None, "Cap each GPU's memory to this (e.g. 15GiB: a T4 on a bigger GPU); the plan and the auto choices use it."
    )
    tflops: float = flag(
        0.0, "Sustained TFLOPS per GPU for the step-time prediction (0: T4's 24 on a T4, else 40%% of the GPU's peak)."
    )
    link_gbps: float = flag(
        T4_LINK_GBPS, "GB/s between GPUs for the step-time prediction (2 T4s on PCIe 3 through NCCL: 3.2)."
    )
    device: str = flag("auto", "auto (CUDA when available), cuda or cpu.", type=str.lower, choices=DEVICES)
    nproc_per_node: str | None = flag(
        None,
        "python -m fsdp_opt only: start this many workers on this machine (a number, or gpu: one per GPU), as torchrun "
        "--standalone does, and end with the failed worker's own error line and exit code (no torchrun report after "
        "it). Under torchrun, leave it to torchrun.",
    )

    def __post_init__(self) -> None:
        if self.prefetch < 0:
            raise ConfigError(f"--prefetch {self.prefetch}: must be 0 or more")
        if self.max_gpu_memory is not None:
            if parse_size(self.max_gpu_memory, "--max_gpu_memory") <= 0:
                raise ConfigError(f"--max_gpu_memory {self.max_gpu_memory}: must be more than 0")
        if not self.tflops >= 0:
            raise ConfigError(f"--tflops {self.tflops}: must be 0 or more")
        if not self.link_gbps > 0:
            raise ConfigError(f"--link_gbps {self.link_gbps}: must be more than 0")


@dataclass
class LoraConfig:
    lora_rank: int = flag(
        0, "LoRA rank: train low-rank adapters (peft) on a frozen base instead of every weight. 0: full fine-tuning."
    )
    lora_alpha: float | None = flag(None, "LoRA scaling numerator (the update is alpha/rank x B A). Default: 2 x rank.")
    lora_dropout: float | None = flag(None, "Dropout on the adapters' input. Default: 0.05.")
    lora_targets: str | None = flag(
        None,
        "Comma-separated layer names to adapt (e.g. q_proj,v_proj), matched inside the decoder blocks. Default: every "
        "linear layer of the blocks (embeddings and lm_head stay frozen).",
    )
    base_bits: int = flag(
        16, "Storage of the frozen base: 16 (the compute dtype) or 4 (NF4, torchao).", choices=(16, 4)
    )

    def __post_init__(self) -> None:
        if self.lora_rank < 0:
            raise ConfigError(f"--lora_rank {self.lora_rank}: must be 0 (full fine-tuning) or more")
        if self.lora_rank == 0:
            given = [n for n in ("lora_alpha", "lora_dropout", "lora_targets") if getattr(self, n) is not None]
            if given:
                raise ConfigError(f"--{given[0]}: only with --lora_rank of 1 or more (rank 0 is full fine-tuning)")
            if self.base_bits != 16:
                raise ConfigError(
                    f"--base_bits {self.base_bits}: only with LoRA (--lora_rank 1 or more): a 4-bit base is frozen"
                )
            return
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ConfigError(f"--lora_alpha {self.lora_alpha}: must be greater than 0")
        if self.lora_dropout is not None and not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"--lora_dropout {self.lora_dropout}: must be in [0, 1)")
        if self.lora_targets is not None and not [t for t in self.lora_targets.split(",") if t.strip()]:
            raise ConfigError("--lora_targets: name at least one layer, e.g. q_proj,v_proj")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def alpha(self) -> float:
        return float(self.lora_alpha) if self.lora_alpha is not None else 2.0 * self.lora_rank

    @property
    def dropout(self) -> float:
        return 0.05 if self.lora_dropout is None else float(self.lora_dropout)
