"""One optimizer step: the method's phase before the forward (sampling, for a method that generates), its
micro-batches forward and backward (the one loop, engine/microbatches.py) with each micro-batch's summed loss divided
by what the step's loss is a mean over, all ranks (its target tokens, pairs, completion tokens: `denominator`), the
global gradient norm, unscale and clip, the step (skipped on a non-finite norm), the record for the log. And the
position a run has reached (TrainState), which checkpoints carry.

A method's loss (`StepLoss`) says only what is its own: its micro-batches on this rank (as many on every rank: a rank
with fewer runs filler ones, empty, whose loss is 0 through the same forward and backward, so every collective lines
up), its denominator, the summed loss of one micro-batch with the sums it logs, and its metrics. The weighting, the
gradient sync, the collectives and the fp16 probe are this module's, once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from fsdp_opt.config.parse import Config
from fsdp_opt.data.blocks import IGNORE_INDEX, StepBatch, StepPlan
from fsdp_opt.engine.loss import HeadLoss, forward_loss_sum, next_token_targets
from fsdp_opt.engine.microbatches import StepLoss, run_micro_batches
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
    plan: StepPlan
    state: TrainState
    end_idx: int
    head_loss: HeadLoss | None
    reduce_each_microbatch: bool
    flops_per_token: float
    peak_flops: float | None
    loss: StepLoss  # what the run's method computes in a step


def accumulate(run: StepRun, step: StepBatch, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward over this rank's micro-batches of `step` (the run's method: `run.loss`); returns this
    rank's summed loss and every sum the method keeps.

    The gradients add up to `scale` times the mean over the whole step (all ranks): each micro-batch's loss sum is
    divided by the step's global count of what the loss is a mean over (`StepLoss.denominator`).
    """
    loss, env = run.loss, run.env
    micro = loss.micro_batches(step)
    weight = scale / max(1.0, float(loss.denominator(step)))
    sums = torch.zeros(len(loss.names), device=env.device, dtype=torch.float32)

    def loss_of(i: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
        part = loss.loss(run.model, micro[i])
        added = part.total.detach().float().reshape(1)
        if part.stats is not None:
            added = torch.cat([added, part.stats.float().to(added.device)])
        return part.total * weight, added, part.output

    run_micro_batches(run.model, len(micro), loss_of, sync_each=run.reduce_each_microbatch, sums=sums)
    return sums[0].clone(), sums


def first_batch_loss(run: StepRun, sequences: Any) -> torch.Tensor:
    """The mean next-token loss of this session's first micro-batch's tokens (summed over ranks; a model with a score
    head: its mean score), in eval mode: no dropout draws, so the training that follows is the same with or without
    this forward. The fp16 probe's: a forward whose loss must be finite. Every rank calls it."""
    first = next(iter(run.plan.steps(run.state.epoch, run.state.offset, run.state.within)), None)
    members = list(first.micro_batches[0])[: run.plan.batch_size] if first is not None else []
    batch, _ = sequences.micro(members, run.env.device)
    total = torch.zeros(2, device=run.env.device, dtype=torch.float32)
    run.model.eval()
    try:
        with torch.no_grad():
            if run.model.get_output_embeddings() is not None:
                total[0] = forward_loss_sum(run.model, run.head_loss, batch)[1].float()
                total[1] = (next_token_targets(batch["labels"]) != IGNORE_INDEX).sum()
            else:  # a score head (a reward model): its scores must be finite
                scores = run.model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
                total[0], total[1] = scores.sum(), scores.numel()
    finally:
        run.model.train()
    if run.env.world_size > 1:
        dist.all_reduce(total)
    return total[0] / total[1].clamp(min=1)


def train_step(run: StepRun, step: StepBatch) -> dict[str, Any]:
    started = time.perf_counter()
    env = run.env
    lr = run.schedule(run.state.global_step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    scale = run.scaler.scale
    run.loss.prepare(run, step)
    _, reduced = accumulate(run, step, scale)
    scaled_norm = global_grad_norm(run.params)
    if env.world_size > 1:
        dist.all_reduce(reduced)
    # The one host sync of the step: loss for the log, norm for the skip decision (same on all ranks).
    values = torch.cat([reduced, scaled_norm.float().to(reduced.device).reshape(1)]).tolist()
    loss_total, norm_scaled, sums = values[0], values[-1], dict(zip(run.loss.names, values[:-1]))
    finite = math.isfinite(loss_total) and math.isfinite(norm_scaled)
    if finite:
        unscale_and_clip_(run.params, scaled_norm, scale, run.config.train.max_grad_norm)
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.scaler.update(finite)
    run.state.global_step += 1
    seconds = time.perf_counter() - started
    loss_mean = loss_total / max(1.0, float(run.loss.denominator(step)))
    run.state.last_loss = loss_mean
    record: dict[str, Any] = {
        "step": run.state.global_step,
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
        "skipped_steps": run.scaler.skipped_steps,
        "slice": f"{run.config.data.start_idx}-{run.end_idx}",
        "skipped_rate": 0.0,  # set by the loop's SkipWatch
    }
    if step.by_source is not None:  # a mixture: what each source gave the step, in the mixture file's order
        record.update({f"source_{k}": v for k, v in step.by_source.items()})
    # the method's fields; a method that learns its tokens in the step (sampled completions) gives them here
    record.update(run.loss.record(sums, step, seconds))
    record["tokens_per_second"] = record["tokens"] / seconds if seconds > 0 else 0.0
    seen_per_second = record["tokens_seen"] / seconds if seconds > 0 else 0.0
    if run.peak_flops:
        # The model computes every real token, answers or not: utilisation counts the tokens seen.
        record["mfu"] = seen_per_second * run.flops_per_token / (run.peak_flops * env.world_size)
    mem = peak_memory_bytes(env.device)
    if mem is not None:
        record["peak_memory_bytes"] = mem
    if not finite and not run.scaler.enabled:
        print0(f"warning: step {run.state.global_step}: non-finite loss or gradient norm; the update was skipped")
    return record


@dataclass
class TrainState:
    """Where the run is: what a resume restores besides model and optimizer, and what the session's loop measures
    as it goes (the last step's loss)."""

    global_step: int = 0
    epoch: int = 0  # 0-based epoch of the slice that `offset` points into
    offset: int = 0  # samples of that epoch already consumed
    within: int = 0  # steps done of the generation that starts at `offset` (--method grpo, reused generations)
    last_loss: float = float("nan")  # the last step's mean loss (not saved as position: checkpoints carry it apart)

    def state_dict(self) -> dict[str, int]:
        position = {"global_step": self.global_step, "epoch": self.epoch, "offset": self.offset}
        return {**position, "within": self.within} if self.within else position
