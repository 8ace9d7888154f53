"""One optimizer step: micro-batches forward and backward with the loss normalised by the step's global count of
target tokens, the global gradient norm, unscale and clip, the step (skipped on a non-finite norm), the record for
the log. And the position a run has reached (TrainState), which checkpoints carry."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from fsdp_opt.config.parse import Config
from fsdp_opt.data.blocks import Blocks, StepBatch, StepPlan
from fsdp_opt.engine.loss import HeadLoss, forward_loss_sum
from fsdp_opt.engine.microbatches import run_micro_batches
from fsdp_opt.engine.optim import LossScaler, LRSchedule, global_grad_norm, unscale_and_clip_
from fsdp_opt.runtime.distributed import DistEnv, peak_memory_bytes, print0


class StepRun(Protocol):
    """What a step reads and updates of the run (the trainer's Session is one)."""

    config: Config  # read for max_grad_norm and the slice's start
    env: DistEnv
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    scaler: LossScaler
    params: list[nn.Parameter]
    blocks: Blocks
    plan: StepPlan
    state: TrainState
    end_idx: int
    head_loss: HeadLoss | None
    reduce_each_microbatch: bool
    flops_per_token: float
    peak_flops: float | None
    last_loss: float
    loss: StepLoss  # what the run's method computes in a step


class StepLoss(Protocol):
    """What a training method computes in a step, which train_step runs without asking which method it is: a phase
    before the forward (sampling, for a method that generates), then its sums over this rank's micro-batches (forward
    and backward), the first of them the loss's. The sums are all-reduced together; `record` turns the step's totals
    into its metrics fields beyond the common ones."""

    names: tuple[str, ...]  # the sums `accumulate` returns, the loss's sum first

    def prepare(self, s: StepRun, step: StepBatch) -> None: ...

    def accumulate(self, s: StepRun, step: StepBatch, scale: float) -> torch.Tensor: ...

    def first_loss(self, s: StepRun, first: StepBatch | None) -> torch.Tensor: ...

    def record(self, sums: dict[str, float], step: StepBatch, seconds: float) -> dict[str, Any]: ...


class TokenLoss:
    """--method sft: the token-mean cross-entropy of the targets, normalised by the step's global count of target
    tokens (each micro-batch's sum divided by it)."""

    names = ("loss",)

    def prepare(self, s: StepRun, step: StepBatch) -> None:
        pass

    def accumulate(self, s: StepRun, step: StepBatch, scale: float) -> torch.Tensor:
        weight = scale / max(1, step.target_tokens)
        loss_sum = torch.zeros(1, device=s.env.device, dtype=torch.float32)

        def loss_of(i: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
            out, loss = self._loss_sum(s, s.blocks.batch(step.micro_batches[i], s.env.device))
            # NOTE: the output stays referenced through backward, as the memory plan and its simulation count it
            return loss * weight, loss.detach(), out

        run_micro_batches(s.model, len(step.micro_batches), loss_of, sync_each=s.reduce_each_microbatch, sums=loss_sum)
        return loss_sum

    def first_loss(self, s: StepRun, first: StepBatch | None) -> torch.Tensor:
        total = torch.zeros(2, device=s.env.device, dtype=torch.float32)
        if first is not None and first.micro_batches:
            batch = s.blocks.batch(first.micro_batches[0], s.env.device)
            total[0] = self._loss_sum(s, batch)[1].float()
            total[1] = (batch["labels"][:, 1:] != -100).sum()
        return total

    def record(self, sums: dict[str, float], step: StepBatch, seconds: float) -> dict[str, Any]:
        return {}

    @staticmethod
    def _loss_sum(s: StepRun, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward's output and the summed loss of the batch's targets."""
        return forward_loss_sum(s.model, s.head_loss, batch)


def accumulate(s: StepRun, step: StepBatch, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward over this rank's micro-batches of `step` (the run's method: `s.loss`); returns this rank's
    summed loss and every sum the method keeps.

    The gradients add up to `scale` times the mean over the whole step (all ranks): each micro-batch's loss sum is
    divided by the step's global count of what the loss is a mean over (target tokens; pairs for DPO).
    """
    sums = s.loss.accumulate(s, step, scale)
    return sums[0].clone(), sums


def first_batch_loss(s: StepRun) -> torch.Tensor:
    """The mean loss of this session's first micro-batch (summed over ranks), in eval mode: no dropout draws, so the
    training that follows is the same with or without this forward. Every rank calls it."""
    first = next(iter(s.plan.steps(s.state.epoch, s.state.offset, s.state.within)), None)
    s.model.eval()
    try:
        with torch.no_grad():
            total = s.loss.first_loss(s, first)
    finally:
        s.model.train()
    if s.env.world_size > 1:
        dist.all_reduce(total)
    return total[0] / total[1].clamp(min=1)


def train_step(s: StepRun, step: StepBatch) -> dict[str, Any]:
    started = time.perf_counter()
    env = s.env
    lr = s.schedule(s.state.global_step)
    for group in s.optimizer.param_groups:
        group["lr"] = lr
    scale = s.scaler.scale
    s.loss.prepare(s, step)
    _, reduced = accumulate(s, step, scale)
    scaled_norm = global_grad_norm(s.params)
    if env.world_size > 1:
        dist.all_reduce(reduced)
    # The one host sync of the step: loss for the log, norm for the skip decision (same on all ranks).
    values = torch.cat([reduced, scaled_norm.float().to(reduced.device).reshape(1)]).tolist()
    loss_total, norm_scaled, sums = values[0], values[-1], dict(zip(s.loss.names, values[:-1]))
    finite = math.isfinite(loss_total) and math.isfinite(norm_scaled)
    if finite:
        unscale_and_clip_(s.params, scaled_norm, scale, s.config.train.max_grad_norm)
        s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    s.scaler.update(finite)
    s.state.global_step += 1
    seconds = time.perf_counter() - started
    loss_mean = loss_total / max(1, step.loss_units)
    s.last_loss = loss_mean
    record: dict[str, Any] = {
        "step": s.state.global_step,
        "epoch": step.epoch,
        "loss": loss_mean,
        "lr": lr,
        "grad_norm": norm_scaled / scale,
        "loss_scale": scale,
        "tokens": step.target_tokens,
        "tokens_seen": step.seen_tokens,
        "tokens_per_second": 0.0,
        "elapsed": 0.0,
        "skipped": not finite,
        "skipped_steps": s.scaler.skipped_steps,
        "slice": f"{s.config.data.start_idx}-{s.end_idx}",
        "skipped_rate": 0.0,  # set by the loop's SkipWatch
    }
    if step.by_source is not None:  # a mixture: what each source gave the step, in the mixture file's order
        record.update({f"source_{k}": v for k, v in step.by_source.items()})
    # the method's fields; a method that learns its tokens in the step (sampled completions) gives them here
    record.update(s.loss.record(sums, step, seconds))
    record["tokens_per_second"] = record["tokens"] / seconds if seconds > 0 else 0.0
    seen_per_second = record["tokens_seen"] / seconds if seconds > 0 else 0.0
    if s.peak_flops:
        # The model computes every real token, answers or not: utilisation counts the tokens seen.
        record["mfu"] = seen_per_second * s.flops_per_token / (s.peak_flops * env.world_size)
    mem = peak_memory_bytes(env.device)
    if mem is not None:
        record["peak_memory_bytes"] = mem
    if not finite and not s.scaler.enabled:
        print0(f"warning: step {s.state.global_step}: non-finite loss or gradient norm; the update was skipped")
    return record


@dataclass
class TrainState:
    """Where the run is: what a resume restores besides model and optimizer."""

    global_step: int = 0
    epoch: int = 0  # 0-based epoch of the slice that `offset` points into
    offset: int = 0  # samples of that epoch already consumed
    within: int = 0  # steps done of the generation that starts at `offset` (--method grpo, reused generations)

    def state_dict(self) -> dict[str, int]:
        position = {"global_step": self.global_step, "epoch": self.epoch, "offset": self.offset}
        return {**position, "within": self.within} if self.within else position
