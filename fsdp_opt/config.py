"""Run configuration: one dataclass per concern, the CLI generated from them, validation in one place.

Each field's `help` metadata is its flag's help text; the flag is `--<field name>`. Validation raises
`ConfigError` naming the flag, before anything is built or written.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from .errors import ConfigError
from .flags import OneLineParser, flag, parse_bool, parse_duration
from .lora import LoraConfig
from .packing import MODES as PACKING_MODES
from .steptime import T4_LINK_GBPS

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
PRECISIONS = ("auto", "fp16", "bf16", "fp32")
LR_SCHEDULES = ("constant", "linear", "cosine")
DEVICES = ("auto", "cuda", "cpu")
STATE_DICT_TYPES = ("full", "sharded")


@dataclass
class ModelConfig:
    model: str = flag("facebook/opt-1.3b", "Hugging Face hub id, local model folder, or the built-in 'tiny-opt'.")
    attn_implementation: str = flag(
        "sdpa", "Attention kernel: 'sdpa' (PyTorch scaled-dot-product) or 'eager'.", choices=("sdpa", "eager")
    )


@dataclass
class DataConfig:
    dataset: str = flag(
        "ash001/arxiv-abstract",
        "Hub dataset id, a local .jsonl/.json/.csv/.parquet/.txt file or folder, or the built-in 'python-docs'.",
    )
    text_column: str = flag("text", "Column holding the training text.")
    start_idx: int = flag(0, "First row of the slice to train on (inclusive).")
    end_idx: int | None = flag(None, "End of the slice (exclusive). Default: the end of the dataset.")
    max_length: int = flag(512, "Tokens per training sequence.")
    eval_rows: int = flag(
        0,
        "Held-out rows right after the slice, [end_idx, end_idx + N): eval loss and perplexity at every save "
        "(0: no evaluation).",
    )
    packing: str = flag(
        "docs",
        "How rows fill the blocks of max_length tokens. docs: whole rows share a block, each attending only to "
        "itself with positions from 0 (the same losses as padding, in far fewer blocks); concat: rows joined end to "
        "end and cut every max_length tokens, attending across row ends; pad: one row per block, truncated and "
        "padded (the original recipe).",
        choices=PACKING_MODES,
    )
    pad_to_max_length: bool = flag(False, "Same as --packing pad (the original recipe's padding).")

    def __post_init__(self) -> None:
        if self.start_idx < 0:
            raise ConfigError(f"--start_idx {self.start_idx}: must be 0 or more")
        if self.end_idx is not None and self.end_idx <= self.start_idx:
            raise ConfigError(f"--end_idx {self.end_idx}: must be greater than --start_idx {self.start_idx}")
        if self.max_length < 2:
            raise ConfigError(f"--max_length {self.max_length}: must be at least 2")
        if self.eval_rows < 0:
            raise ConfigError(f"--eval_rows {self.eval_rows}: must be 0 or more")
        if not self.text_column:
            raise ConfigError("--text_column: must not be empty")
        if self.pad_to_max_length:
            if self.packing == "concat":
                raise ConfigError("--pad_to_max_length: contradicts --packing concat (it means --packing pad)")
            self.packing = "pad"
        self.pad_to_max_length = self.packing == "pad"


@dataclass
class TrainConfig:
    num_epochs: int = flag(1, "Epochs this invocation runs over the slice, counting one that a resume finishes.")
    initial_epoch: int = flag(0, "Epoch number to start counting from when not resuming.")
    batch_size: int = flag(4, "Micro-batch size per rank (sequences per forward pass).")
    accum_steps: int = flag(1, "Micro-batches per optimizer step. Global batch = batch_size x ranks x accum_steps.")
    total_batch_size: int | None = flag(
        None,
        "Sequences per optimizer step, instead of --accum_steps: accum_steps = total / (batch_size x ranks), "
        "which must divide exactly. Keeps the global batch when the rank count changes between sessions.",
    )
    lr: float = flag(5e-6, "Peak learning rate (AdamW).")
    warmup_steps: int = flag(0, "Linear warm-up steps, counted in global optimizer steps.")
    lr_schedule: str = flag(
        "constant",
        "After warm-up: 'constant', or 'linear'/'cosine' decay to min_lr_ratio*lr over lr_decay_steps.",
        choices=LR_SCHEDULES,
    )
    lr_decay_steps: int = flag(0, "Global steps (after warm-up) over which linear/cosine decay runs.")
    min_lr_ratio: float = flag(0.0, "Final learning rate of a decay schedule, as a fraction of lr.")
    weight_decay: float = flag(0.0, "AdamW weight decay, applied to matrices and embeddings only.")
    max_grad_norm: float = flag(1.0, "Clip the global gradient norm to this value; 0 disables clipping.")
    seed: int = flag(42, "Seed for model init, data order and dropout.")
    init_loss_scale: float = flag(2.0**16, "Starting loss scale for fp16 (halved on overflow, doubled after 2000 good steps).")
    loss_chunk_tokens: int = flag(
        0,
        "Compute the output projection and loss N tokens at a time, recomputed in backward, so the whole "
        "micro-batch's logits never exist at once (opt-1.3b at 4 x 512: about 1.3 GiB less; see the plan). "
        "0: all logits at once.",
    )

    def __post_init__(self) -> None:
        if self.loss_chunk_tokens < 0:
            raise ConfigError(f"--loss_chunk_tokens {self.loss_chunk_tokens}: must be 0 (off) or more")
        for name in ("num_epochs", "batch_size", "accum_steps"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"--{name} {value}: must be 1 or more")
        if self.total_batch_size is not None:
            if self.total_batch_size < 1:
                raise ConfigError(f"--total_batch_size {self.total_batch_size}: must be 1 or more")
            if self.accum_steps != 1:
                raise ConfigError("--total_batch_size and --accum_steps: give one of them (accum_steps is derived)")
        if self.initial_epoch < 0:
            raise ConfigError(f"--initial_epoch {self.initial_epoch}: must be 0 or more")
        if not self.lr > 0:
            raise ConfigError(f"--lr {self.lr}: must be greater than 0")
        if self.warmup_steps < 0:
            raise ConfigError(f"--warmup_steps {self.warmup_steps}: must be 0 or more")
        if self.lr_schedule != "constant" and self.lr_decay_steps < 1:
            raise ConfigError(f"--lr_schedule {self.lr_schedule}: needs --lr_decay_steps of 1 or more")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"--min_lr_ratio {self.min_lr_ratio}: must be between 0 and 1")
        if self.weight_decay < 0:
            raise ConfigError(f"--weight_decay {self.weight_decay}: must be 0 or more")
        if not self.init_loss_scale >= 1:
            raise ConfigError(f"--init_loss_scale {self.init_loss_scale}: must be 1 or more")
        if self.max_grad_norm < 0:
            raise ConfigError(f"--max_grad_norm {self.max_grad_norm}: must be 0 (off) or more")

    def accum_for(self, world_size: int) -> int:
        """--accum_steps, or the one --total_batch_size implies for this many ranks."""
        if self.total_batch_size is None:
            return self.accum_steps
        per_step = self.batch_size * world_size
        if self.total_batch_size % per_step:
            low = self.total_batch_size // per_step * per_step
            options = " or ".join(str(x) for x in (low, low + per_step) if x > 0)
            raise ConfigError(
                f"--total_batch_size {self.total_batch_size}: not a multiple of --batch_size {self.batch_size} x "
                f"{world_size} rank(s) = {per_step}; use {options}, or another --batch_size"
            )
        return self.total_batch_size // per_step


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
    reduce_every_microbatch: str = flag(
        "auto",
        "Reduce-scatter gradients after every micro-batch instead of only the last one of a step: less memory "
        "(no unsharded fp32 gradient kept between micro-batches, 4 bytes per parameter), more communication. "
        "auto: on a GPU, whichever of the two fits with the shorter predicted step (without sync when both fit); "
        "never on CPU.",
        type=str.lower,
        choices=["auto", "true", "false"],
        nargs="?",
        const="true",
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
    link_gbps: float = flag(T4_LINK_GBPS, "GB/s between GPUs for the step-time prediction (2 T4s on PCIe 3 through NCCL: 3.2).")
    device: str = flag("auto", "auto (CUDA when available), cuda or cpu.", type=str.lower, choices=DEVICES)

    def __post_init__(self) -> None:
        if self.prefetch < 0:
            raise ConfigError(f"--prefetch {self.prefetch}: must be 0 or more")
        if self.max_gpu_memory is not None:
            from .plan import parse_size

            if parse_size(self.max_gpu_memory, "--max_gpu_memory") <= 0:
                raise ConfigError(f"--max_gpu_memory {self.max_gpu_memory}: must be more than 0")
        if not self.tflops >= 0:
            raise ConfigError(f"--tflops {self.tflops}: must be 0 or more")
        if not self.link_gbps > 0:
            raise ConfigError(f"--link_gbps {self.link_gbps}: must be more than 0")


@dataclass
class CheckpointConfig:
    output_dir: str = flag("outputs", "Folder for checkpoints and metrics.jsonl.")
    save_every_steps: int = flag(0, "Also save a mid-epoch checkpoint every N optimizer steps (0: epoch ends only).")
    resume_file: str | None = flag(
        None, "Checkpoint to resume from: a path, a checkpoint name in --output_dir, or 'latest' (highest global step)."
    )
    time_limit: str | None = flag(
        None, "Wall-clock budget such as 11h30m: save and exit 0 before it runs out, printing the resume command."
    )
    keep_last: int = flag(2, "Keep the newest K checkpoints of output_dir, deleting older ones after a save (0: keep all).")
    disk_budget: str | None = flag(
        None,
        "Most bytes the checkpoints in output_dir may take (Kaggle: 19GB of the 20 GB output cap). Before a save, "
        "local checkpoints that are on the Hub are deleted, oldest first, to make room.",
    )
    state_dict_type: str = flag(
        "full",
        "full: one .pt file gathered on rank 0. sharded: one folder per checkpoint, each rank writing its own shard.",
        choices=STATE_DICT_TYPES,
    )
    save_optimizer: bool = flag(True, "Include the optimizer state (false: weights only, about a third of the size).")
    async_save: str = flag(
        "auto",
        "Write a full checkpoint in a background thread while training goes on (the gather still pauses it). "
        "auto: on with CUDA; off on CPU, where the write would compete with the steps for cores and memory.",
        type=str.lower,
        choices=["auto", "true", "false"],
        nargs="?",
        const="true",
    )
    export_hf: str | None = flag(
        None, "After training, write a Hugging Face model folder (safetensors, tokenizer) to this directory."
    )
    export_dtype: str = flag("fp16", "Weight dtype of --export_hf: fp16, bf16 or fp32.", choices=("fp16", "bf16", "fp32"))
    export_merge: bool = flag(
        False, "LoRA runs: --export_hf writes the base with the adapters merged in, not the peft adapter folder."
    )

    def __post_init__(self) -> None:
        if self.save_every_steps < 0:
            raise ConfigError(f"--save_every_steps {self.save_every_steps}: must be 0 or more")
        if self.keep_last < 0:
            raise ConfigError(f"--keep_last {self.keep_last}: must be 0 (keep all) or more")
        if not self.output_dir:
            raise ConfigError("--output_dir: must not be empty")
        parse_duration(self.time_limit)
        if self.disk_budget is not None:
            from .plan import parse_size

            parse_size(self.disk_budget, "--disk_budget")

    @property
    def time_limit_seconds(self) -> float | None:
        return parse_duration(self.time_limit)

    @property
    def disk_budget_bytes(self) -> int | None:
        from .plan import parse_size

        return None if self.disk_budget is None else parse_size(self.disk_budget, "--disk_budget")


@dataclass
class HubConfig:
    hf_repo: str | None = flag(
        None,
        "Hugging Face repo (user/name) that stores the checkpoints: created if missing, each checkpoint pushed in "
        "the background, --resume_file looked up there too.",
    )
    hub_public: bool = flag(False, "Create the repo public (default: private). An existing repo keeps its visibility.")
    hub_retries: int = flag(5, "Retries of a failed upload (network errors, 5xx), with exponential backoff.")
    hub_wait: str = flag("30m", "At exit, wait at most this long for pending uploads (a duration such as 30m).")
    hub_keep_full: int | None = flag(
        None,
        "Full resumable checkpoints the repo keeps (default 1 with --hf_repo): older ones leave only their fp16 "
        "weights file (weights/<name>.safetensors, one per range), and their storage is freed. 0 keeps every one.",
    )

    def __post_init__(self) -> None:
        if self.hf_repo is not None and not re.fullmatch(r"[\w.-]+/[\w.-]+", self.hf_repo):
            raise ConfigError(f"--hf_repo {self.hf_repo!r}: expected the form user/name")
        if self.hub_retries < 0:
            raise ConfigError(f"--hub_retries {self.hub_retries}: must be 0 or more")
        parse_duration(self.hub_wait, "--hub_wait")
        if self.hub_keep_full is not None:
            if self.hub_keep_full < 0:
                raise ConfigError(f"--hub_keep_full {self.hub_keep_full}: must be 0 (keep every full checkpoint) or more")
            if self.hf_repo is None:
                raise ConfigError("--hub_keep_full: only with --hf_repo (it says what the Hub repo keeps)")

    @property
    def keep_full(self) -> int:
        """--hub_keep_full, with its default of 1."""
        return 1 if self.hub_keep_full is None else self.hub_keep_full

    @property
    def hub_wait_seconds(self) -> float:
        return parse_duration(self.hub_wait, "--hub_wait") or 0.0


@dataclass
class WandbConfig:
    wandb_project: str = flag("opt-fsdp", "W&B project (rank 0 logs; the config goes in without secrets).")
    wandb_mode: str = flag(
        "auto",
        "W&B mode: online, offline or disabled. auto: online when an API key is configured, else offline.",
        choices=["auto", "online", "offline", "disabled"],
    )
    wandb_new_run: bool = flag(
        False, "Start a new W&B run instead of continuing the run whose id the resumed checkpoint holds."
    )


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "lora": LoraConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "hub": HubConfig,
    "wandb": WandbConfig,
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def flat(self) -> dict[str, Any]:
        """Every flag and its value: what is printed and stored in checkpoints."""
        out: dict[str, Any] = {}
        for section in SECTIONS:
            out.update(dataclasses.asdict(getattr(self, section)))
        return out

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> "Config":
        sections = {}
        for name, section_cls in SECTIONS.items():
            names = {f.name for f in dataclasses.fields(section_cls)}
            sections[name] = section_cls(**{k: v for k, v in values.items() if k in names})
        return cls(**sections)


def _field_type(f: dataclasses.Field) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if "bool" in kind:
        return parse_bool
    if "int" in kind:
        return int
    if "float" in kind:
        return float
    return str


def build_parser(prog: str = "fsdp_finetune.py", description: str | None = None) -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=prog,
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    for section, section_cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(section_cls):
            meta = dict(f.metadata)
            help_text = meta.pop("help")
            kind = meta.pop("type", None) or _field_type(f)
            kwargs: dict[str, Any] = {"default": f.default, "help": help_text, "type": kind}
            if kind is parse_bool:
                kwargs.update(nargs="?", const=True, metavar="BOOL")
            kwargs.update(meta)
            group.add_argument(f"--{f.name}", **kwargs)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> Config:
    namespace = build_parser().parse_args(argv)
    return Config.from_flat(vars(namespace))
