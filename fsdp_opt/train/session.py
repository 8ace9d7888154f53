"""The state of one training session, built once by trainer.setup() and shared by the loop and the savers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_opt.checkpoint.state import TrainState
from fsdp_opt.config.parse import Config
from fsdp_opt.data.blocks import Blocks, StepPlan
from fsdp_opt.engine.fp16watch import SkipWatch
from fsdp_opt.engine.optim import LossScaler, LRSchedule
from fsdp_opt.runtime.distributed import DistEnv
from fsdp_opt.tracking.metrics import MetricsWriter


@dataclass
class Session:
    """Everything the loop needs, built once by setup()."""

    config: Config
    env: DistEnv
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    scaler: LossScaler
    blocks: Blocks
    plan: StepPlan
    state: TrainState
    writer: MetricsWriter
    tag: str
    end_idx: int
    precision: str
    flops_per_token: float
    peak_flops: float | None
    out_dir: Path
    n_params: int = 0
    model_config: Any = None
    tokenizer: Any = None
    params: list[nn.Parameter] = field(default_factory=list)
    last_loss: float = float("nan")
    last_save_seconds: float = 0.0
    last_save_bytes: int = 0
    last_saved_step: int = -1
    last_saved_path: Path | None = None
    uploader: Any = None  # uploads.Uploader on rank 0 with --hf_repo
    wandb: Any = None  # tracking.WandbRun (inactive off rank 0 or when disabled)
    prune_lock: threading.Lock = field(default_factory=threading.Lock)
    eval_blocks: Blocks | None = None  # --eval_rows
    reduce_each_microbatch: bool = False  # --reduce_every_microbatch, with auto decided by the memory plan
    predicted_step: dict[str, Any] | None = None  # steptime.choose_layout's prediction on a GPU
    step_seconds: list[float] = field(default_factory=list)  # of this session's optimizer steps
    chunked_loss: Any = None  # a loss.ChunkedLoss with --loss_chunk_tokens
    lora: dict[str, Any] | None = None  # lora.identity() of a LoRA run: what its checkpoints record
    skip_watch: SkipWatch = field(default_factory=SkipWatch)  # fp16: skipped-step rate, warnings, the storm stop
    ckpt_writer: Any = None  # saving.BackgroundWriter with --async_save (rank 0 writes; None: saves written in place)
