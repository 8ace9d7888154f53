"""Flags of what a run keeps: checkpoints (where, how often, how many, which format), the Hub repo, and W&B."""

from __future__ import annotations

import re
from dataclasses import dataclass

from fsdp_opt.base import ConfigError, parse_size
from fsdp_opt.config.choices import STATE_DICT_TYPES
from fsdp_opt.config.flags import flag, parse_duration, tri_state


@dataclass
class CheckpointConfig:
    output_dir: str = flag("outputs", "Folder for checkpoints and metrics.jsonl.")
    save_every_steps: int = flag(0, "Also save a mid-epoch checkpoint every N optimizer steps (0: epoch ends only).")
    resume_file: str | None = flag(
        None, "Checkpoint to resume from: a path, a checkpoint name in --output_dir, or 'latest' (highest global step)."
    )
    allow_changes: bool = flag(
        False,
        "Resume even when a flag that keeps the chain one exact run changed since the checkpoint (the model, dataset, "
        "row format, max_length, packing, seed, or the global batch inside a range). Every change is printed anyway.",
    )
    overwrite: bool = flag(
        False,
        "Train the range again when --output_dir (or --hf_repo) holds its last checkpoint already: it is replaced, "
        "and the step logs' records of the steps trained again move to metrics.replaced.jsonl (without it, such a "
        "session says the range is done and exits 0, or stops if its settings changed).",
    )
    time_limit: str | None = flag(
        None, "Wall-clock budget such as 11h30m: save and exit 0 before it runs out, printing the resume command."
    )
    keep_last: int = flag(
        2, "Keep the newest K checkpoints of output_dir, deleting older ones after a save (0: keep all)."
    )
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
    async_save: str = tri_state(
        "Write a full checkpoint in a background thread while training goes on (the gather still pauses it). "
        "auto: on with CUDA; off on CPU, where the write would compete with the steps for cores and memory."
    )
    export_hf: str | None = flag(
        None, "After training, write a Hugging Face model folder (safetensors, tokenizer) to this directory."
    )
    export_dtype: str = flag(
        "fp16", "Weight dtype of --export_hf: fp16, bf16 or fp32.", choices=("fp16", "bf16", "fp32")
    )
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
            parse_size(self.disk_budget, "--disk_budget")

    @property
    def time_limit_seconds(self) -> float | None:
        return parse_duration(self.time_limit)

    @property
    def disk_budget_bytes(self) -> int | None:
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
    take_over: bool = flag(
        False,
        "Take the chain's lease even when another session holds it (one that died and whose lease has not expired "
        "yet). The lease (in the --hf_repo repo, else in --output_dir) lets one session at a time write to a chain.",
    )

    def __post_init__(self) -> None:
        if self.hf_repo is not None and not re.fullmatch(r"[\w.-]+/[\w.-]+", self.hf_repo):
            raise ConfigError(f"--hf_repo {self.hf_repo!r}: expected the form user/name")
        if self.hub_retries < 0:
            raise ConfigError(f"--hub_retries {self.hub_retries}: must be 0 or more")
        parse_duration(self.hub_wait, "--hub_wait")
        if self.hub_keep_full is not None:
            if self.hub_keep_full < 0:
                raise ConfigError(
                    f"--hub_keep_full {self.hub_keep_full}: must be 0 (keep every full checkpoint) or more"
                )
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
