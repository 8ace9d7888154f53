"""The state of one training session, built once by `build.setup()` and shared by the loop and the savers. Frozen
after setup but for its `position`: what a step, a save and the clock move. A further range in the same session is
a new Session (train/chain.py), the model, optimizer, uploader and W&B run going on."""

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
from fsdp_opt.data.blocks import StepBatch
from fsdp_opt.engine.fp16watch import SkipWatch
from fsdp_opt.engine.loss import HeadLoss
from fsdp_opt.engine.microbatches import StepLoss
from fsdp_opt.engine.optim import LossScaler, LRSchedule
from fsdp_opt.engine.step import TrainState
from fsdp_opt.hub.lease import Lease
from fsdp_opt.hub.uploads import Uploader
from fsdp_opt.planner.layout import Layout
from fsdp_opt.runtime.distributed import DistEnv
from fsdp_opt.tracking.metrics import MetricsWriter
from fsdp_opt.tracking.wandb_run import WandbRun
from fsdp_opt.train.components import Components
from fsdp_opt.train.methods.base import Method, Scorer


@dataclass
class Position:
    """What moves while a session trains: the position in the data, the chain's status, the saves and the clock."""

    state: TrainState
    chain: ChainStatus | None = None  # where the chain of sessions stands; saved with every checkpoint
    last_save_seconds: float = 0.0
    last_save_bytes: int = 0
    last_saved_step: int = -1
    last_saved_path: Path | None = None
    step_seconds: list[float] = field(default_factory=list)  # of this session's optimizer steps
    clock_started: float | None = None  # time.monotonic() when training began: the session's share of train_seconds
    chain_seconds_before: float = 0.0  # train_seconds of the chain before this session


@dataclass(frozen=True)
class Session:
    """Everything the loop needs. The flags (`config`) are only read; what they leave open is decided at setup and
    held here: `precision` and `layout` (strategy, batch, accumulation, ...)."""

    config: Config
    env: DistEnv
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    scaler: LossScaler
    blocks: Any  # the slice's sequences: blocks, preference pairs, items, prompts (the method's)
    plan: Any  # the global batches of its epochs, this rank's share of each
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
    method: Method  # the run's method (train/methods): its sequences, plan, loss and scorer
    components: Components  # what setup built for it (train/components.py)
    loss: StepLoss  # the method's step (engine/microbatches.py)
    position: Position
    scorer: Scorer | None = None  # the held-out evaluation at each save (--eval_rows)
    n_params: int = 0
    params: list[nn.Parameter] = field(default_factory=list)  # the trainable ones
    eval_blocks: Any = None  # --eval_rows
    eval_label: str = ""  # which rows they are: [a, b), or [0, n) of split S
    head_loss: HeadLoss | None = None  # the output layer run by the loss (at the targets; --loss_chunk_tokens)
    lora: dict[str, Any] | None = None  # adapters.identity() of a LoRA run: what its checkpoints record
    rows: dict[str, Any] = field(default_factory=dict)  # the rows' format, resolved: data.formats.row_key
    settings_changes: list[dict[str, Any]] = field(default_factory=list)  # flags changed along the chain (rank 0)
    data_pin: dict[str, Any] | None = None  # the data the chain trained on (rank 0): data/pin.py
    data_revision: str | None = None  # a Hub dataset's revision this session reads
    lease: Lease | None = None  # the chain's lease (rank 0): renewed by pushes, or with each save on a shared disk
    uploader: Uploader | None = None  # rank 0 with --hf_repo
    wandb: WandbRun | None = None  # inactive off rank 0 or when disabled
    ckpt_writer: BackgroundWriter | None = None  # --async_save (rank 0 writes; None: saves written in place)
    skip_watch: SkipWatch = field(default_factory=SkipWatch)  # fp16: skipped-step rate, warnings, the storm stop
    prune_lock: threading.Lock = field(default_factory=threading.Lock)
    benchmarks: Any = None  # --eval_tasks: the scoring at each save (train/chain_scores.py ChainScores)

    @property
    def state(self) -> TrainState:
        return self.position.state

    @property
    def chain(self) -> ChainStatus | None:
        return self.position.chain

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
        p = self.position
        if p.clock_started is not None:
            self.chain.train_seconds = p.chain_seconds_before + time.monotonic() - p.clock_started
        return self.chain.to_dict()

    def method_state(self) -> dict[str, Any]:
        """What checkpoints keep of the method (under its name): its components', and its step's (every rank calls
        this, as every rank saves: a generation in progress is gathered from every rank)."""
        return {**self.components.state(), **self.loss.state(self.env)}


def seed_dropout(config: Config, env: DistEnv) -> None:
    """Dropout masks: per rank, reproducible; what a session (or a new range in one) starts from."""
    torch.manual_seed(config.train.seed + 7919 * env.rank)
