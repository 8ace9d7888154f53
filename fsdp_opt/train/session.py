"""The state of one training session, built once by `run.setup()` and shared by the loop and the savers."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from fsdp_opt.checkpoint.chain import ChainStatus
from fsdp_opt.checkpoint.save import BackgroundWriter
from fsdp_opt.config.parse import Config
from fsdp_opt.data.blocks import Blocks, StepBatch, StepPlan
from fsdp_opt.engine.fp16watch import SkipWatch
from fsdp_opt.engine.loss import HeadLoss
from fsdp_opt.engine.optim import LossScaler, LRSchedule
from fsdp_opt.engine.step import StepLoss, TrainState
from fsdp_opt.hub.lease import Lease
from fsdp_opt.hub.uploads import Uploader
from fsdp_opt.planner.layout import Layout
from fsdp_opt.runtime.distributed import DistEnv
from fsdp_opt.tracking.metrics import MetricsWriter
from fsdp_opt.tracking.wandb_run import WandbRun


@dataclass
class Session:
    """Everything the loop needs, built once by setup(). The flags (`config`) are only read; what they leave open is
    decided at setup and held here: `precision` and `layout` (strategy, batch, accumulation, ...)."""

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
    tag: str  # the model's part of checkpoint names
    end_idx: int  # the slice's end, clamped to the dataset
    precision: str  # --precision, with auto decided for this device
    layout: Layout  # what the flags leave open (--sharding_strategy AUTO, --batch_size auto, ...), decided
    flops_per_token: float
    peak_flops: float | None
    out_dir: Path
    model_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    n_params: int = 0
    params: list[nn.Parameter] = field(default_factory=list)  # the trainable ones
    last_loss: float = float("nan")
    last_save_seconds: float = 0.0
    last_save_bytes: int = 0
    last_saved_step: int = -1
    last_saved_path: Path | None = None
    uploader: Uploader | None = None  # rank 0 with --hf_repo
    wandb: WandbRun | None = None  # inactive off rank 0 or when disabled
    prune_lock: threading.Lock = field(default_factory=threading.Lock)
    eval_blocks: Blocks | None = None  # --eval_rows
    eval_label: str = ""  # which rows they are: [a, b), or [0, n) of split S
    step_seconds: list[float] = field(default_factory=list)  # of this session's optimizer steps
    head_loss: HeadLoss | None = None  # the output layer run by the loss (at the targets; --loss_chunk_tokens)
    lora: dict[str, Any] | None = None  # adapters.identity() of a LoRA run: what its checkpoints record
    skip_watch: SkipWatch = field(default_factory=SkipWatch)  # fp16: skipped-step rate, warnings, the storm stop
    ckpt_writer: BackgroundWriter | None = None  # --async_save (rank 0 writes; None: saves written in place)
    chain: ChainStatus | None = None  # where the chain of sessions stands; saved with every checkpoint
    clock_started: float | None = None  # time.monotonic() when training began: the session's share of train_seconds
    chain_seconds_before: float = 0.0  # train_seconds of the chain before this session
    rows: dict[str, Any] = field(default_factory=dict)  # the rows' format, resolved: data.formats.row_key
    settings_changes: list[dict[str, Any]] = field(default_factory=list)  # flags changed along the chain (rank 0)
    data_pin: dict[str, Any] | None = None  # the data the chain trained on (rank 0): data/pin.py
    data_revision: str | None = None  # a Hub dataset's revision this session reads
    lease: Lease | None = None  # the chain's lease (rank 0): renewed by pushes, or with each save on a shared disk
    method: Any = None  # the run's method object (train/methods): what it computes, logs, keeps, evaluates
    loss: StepLoss | None = None  # the method's step (engine/step.py): set once the model is built
    benchmarks: Any = None  # --eval_tasks: the scoring at each save (train/chain_scores.py ChainScores)

    @property
    def chat_template(self) -> str | None:
        """The template conversations were rendered with (--chat_template, or the tokenizer's own)."""
        return getattr(self.tokenizer, "chat_template", None) or None

    @property
    def reduce_each_microbatch(self) -> bool:
        return self.layout.reduce_each_microbatch

    @property
    def accum_steps(self) -> int:
        return self.layout.accum_steps

    @property
    def predicted_step(self) -> dict[str, Any] | None:
        return self.layout.prediction

    def flags(self) -> dict[str, Any]:
        """The flags with what setup decided in their place: what the run prints and stores with its checkpoints."""
        return {**self.config.flat(), **self.layout.decided()}

    def count_step(self, step: StepBatch) -> None:
        """The chain's position and rows after `step`: its share of the range's samples, as a share of its rows."""
        c = self.chain
        if c is None:
            return
        c.rows_trained += (c.end - c.start) * step.samples / max(1, self.plan.num_samples)
        c.move_to(step.epoch, step.end_offset, self.plan.num_samples)

    def chain_record(self) -> dict[str, Any] | None:
        """The chain's status now, as saved with a checkpoint (and its Hub index entry)."""
        if self.chain is None:
            return None
        if self.clock_started is not None:
            self.chain.train_seconds = self.chain_seconds_before + time.monotonic() - self.clock_started
        return self.chain.to_dict()


def step_plan(
    config: Config, env: DistEnv, method: Any, sequences: Any, batch_size: int, accum_steps: int
) -> StepPlan | Any:
    """The global batches of the slice's epochs, and this rank's share of each (the method's plan of its sequences)."""
    return method.plan(config, env, sequences, batch_size, accum_steps)


def seed_dropout(config: Config, env: DistEnv) -> None:
    """Dropout masks: per rank, reproducible; what a session (or a new range in one) starts from."""
    torch.manual_seed(config.train.seed + 7919 * env.rank)
