"""Optimizer, learning-rate schedule, loss scaling, and the clip-and-step of one optimizer step."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_opt.model.parallelize import REPLICATED, shard_group


class ShardAdamW(torch.optim.AdamW):
    """torch's AdamW, updating each rank's shards as plain tensors.

    The update is elementwise, and FSDP2 gives a parameter, its gradient and its moments the same placements, so
    updating the local shards is updating the whole, bit for bit. On DTensors each foreach op of the step first
    propagates shardings in Python, uncached for lists of tensors: on 2 CPU ranks at tiny-opt's shape that was 85% of
    the optimizer step and 11% of a training run. The state stays DTensors, so the state dict, checkpoints and a
    resume see torch's AdamW unchanged.
    """

    def _init_group(self, group, *lists):  # noqa: ANN001, ANN202
        has_complex = super()._init_group(group, *lists)
        found = [f for f in lists if isinstance(f, list)]  # params, grads, moments, steps (plain 0-dim tensors)
        params = found[0]
        if all(_lines_up(p, t) for f in found[1:] for p, t in zip(params, f)):
            for f in found:
                f[:] = [_local(t) for t in f]
        return has_complex


def _lines_up(param: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether `t`'s local part is the part of the update that goes with `param`'s: a plain scalar (Adam's step
    count), both plain, or DTensors of one mesh and placements. Otherwise the step stays on the DTensors."""
    if t.dim() == 0 and not isinstance(t, DTensor):
        return True
    if isinstance(param, DTensor) != isinstance(t, DTensor):
        return False
    return not isinstance(t, DTensor) or (param.device_mesh == t.device_mesh and param.placements == t.placements)


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, device: torch.device) -> torch.optim.AdamW:
    """AdamW (on each rank's shards: ShardAdamW); decay on matrices and embeddings only (not biases or norms)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused kernels on CUDA, foreach (multi-tensor) on CPU
    kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return ShardAdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, **kind)


def create_state(optimizer: torch.optim.Optimizer) -> None:
    """Adam(W)'s per-parameter state as its first step would create it (step 0, zero moments), made directly.

    A resume loads into existing state; torch's state-dict helpers otherwise create it by running a step on zero
    gradients: one optimizer step of time and a zero gradient per parameter of memory, before the load (on 2 CPU
    ranks at opt-350m's shape, most of the resume). Other optimizers are left to those helpers.
    """
    if not isinstance(optimizer, torch.optim.Adam) or optimizer.state:
        return
    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable")  # else `step` lives on the CPU (torch's rule)
        for p in group["params"]:
            if not p.requires_grad:
                continue
            step = torch.zeros((), dtype=torch.float32, device=p.device) if on_device else torch.tensor(0.0)
            state = {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p)
            optimizer.state[p] = state


@dataclass
class LRSchedule:
    """Learning rate as a function of the global step only, so slices of a run compose into one schedule."""

    lr: float
    warmup_steps: int = 0
    kind: str = "constant"
    decay_steps: int = 0
    min_lr_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        """LR for the optimizer step that takes the global step from `step` to `step + 1`."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.decay_steps))
        floor = self.lr * self.min_lr_ratio
        if self.kind == "linear":
            return floor + (self.lr - floor) * (1.0 - progress)
        return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)


MIN_SCALE = 2.0**-24  # fp16's smallest subnormal


class LossScaler:
    """Dynamic loss scaling for fp16, with the skip decision taken from the global gradient norm.

    The norm is reduced over every shard, so it is the same number on every rank and so is the decision
    to skip; a per-rank inf check on local shards could make ranks disagree and their weights diverge.
    With `enabled=False` (fp32, bf16) the scale stays 1 and only non-finite steps are skipped.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped_steps = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.skipped_steps += 1
            self.good_steps = 0
            if self.enabled:
                # NOTE: below 1 only when the loss itself overflows; fp16watch warns then and stops a storm.
                self.scale = max(self.scale * 0.5, MIN_SCALE)
            return
        self.good_steps += 1
        if self.enabled and self.good_steps % self.growth_interval == 0:
            self.scale *= 2.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "scale": self.scale,
            "good_steps": self.good_steps,
            "skipped_steps": self.skipped_steps,
            "growth_interval": self.growth_interval,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"]) if self.enabled == state["enabled"] else self.scale
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def global_grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """L2 norm over every shard of every gradient: the same value on each rank."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    groups = {shard_group(g) if isinstance(g, DTensor) else None for g in grads}
    if len(groups) == 1 and None not in groups:
        # One FSDP2 layout for every gradient: the norm of the local shards, then their squares summed over the
        # shard group; DTensor's own path does the same (a partial norm reduced as squares), without its dispatch.
        local = torch.nn.utils.get_total_norm([g.to_local() for g in grads], norm_type=2.0, foreach=True)
        (group,) = groups
        if group == REPLICATED:
            return local
        squares = local**2
        dist.all_reduce(squares, group=group)
        return squares**0.5
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def unscale_and_clip_(
    params: list[nn.Parameter], scaled_norm: torch.Tensor, scale: float, max_norm: float
) -> torch.Tensor:
    """Divide gradients by the loss scale and clip them to max_norm in one pass. Returns the true norm."""
    norm = scaled_norm / scale
    factor = torch.full_like(norm, 1.0 / scale)
    if max_norm > 0:
        factor = factor * torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    local = [_local(p.grad) for p in params if p.grad is not None]
    if local:
        torch._foreach_mul_(local, factor.to(local[0].device))
    return norm
