"""Groups of completions (--method grpo, rloo): the settings a step reads, rewards into advantages (TRL 1.16's rules:
GRPO's group-relative one, RLOO's leave-one-out baseline), and the reward statistics that span ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_opt.engine.generation import Decoding
from fsdp_opt.engine.rewards import Reward


@dataclass(kw_only=True)
class GroupSettings(Decoding):
    """What a GRPO step needs of the flags, decided once: its decoding, and its groups' and loss's settings."""

    generations: int
    epsilon: float
    epsilon_high: float
    beta: float
    loss_type: str
    scale_rewards: str
    mask_truncated: bool
    rewards: list[Reward]
    weights: list[float]
    delta: float | None = None  # the two-sided clip's upper bound on the ratio (TRL's delta)
    level: str = "token"  # where the ratio is taken: token, sequence (the mean log-ratio, GSPO), sequence_sum (RLOO)
    baseline: str = "group"  # an advantage's baseline: its group's mean (group), or the others' mean (leave_one_out)
    normalize: bool = False  # the generation's advantages less their mean, divided by their std (RLOO's option)
    kl_in_reward: bool = False  # beta x the completion's summed log-ratio to the reference leaves its reward (RLOO)


def advantages(
    rewards: torch.Tensor, generations: int, scale: str, batch_std: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] advantages of n = groups x G total rewards (NaN: no reward), and [n] whether each one's group has zero
    std. `batch_std`: the std over the generation's rewards on all ranks (--scale_rewards batch)."""
    grouped = rewards.view(-1, generations)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    count = (~torch.isnan(grouped)).sum(1, keepdim=True)
    var = torch.nanmean((grouped - mean) ** 2, dim=1, keepdim=True) * count / (count - 1).clamp(min=1)
    group_std = torch.where(count > 1, var.sqrt(), torch.full_like(var, math.nan))
    adv = grouped - mean
    if scale == "group":
        adv = adv / (group_std + 1e-4)
    elif scale == "batch":
        adv = adv / ((batch_std if batch_std is not None else math.nan) + 1e-4)
    zero = torch.isclose(group_std, torch.zeros_like(group_std)).expand_as(grouped)
    return torch.nan_to_num(adv, nan=0.0).reshape(-1), zero.reshape(-1)


def leave_one_out(rewards: torch.Tensor, generations: int) -> torch.Tensor:
    """[n] each reward less the mean of the others of its group that have one (NaN where it has none, or no other
    has), as TRL 1.16's RLOO takes it."""
    grouped = rewards.view(-1, generations)
    count = (~torch.isnan(grouped)).sum(1, keepdim=True)
    others = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (count - 1)
    return (grouped - others).reshape(-1)


def nan_stats(values: torch.Tensor) -> torch.Tensor:
    """[count, sum, sum of squares] of the non-NaN values (for a std over ranks)."""
    ok = ~torch.isnan(values)
    v = values[ok].double()
    return torch.stack([ok.sum().double(), v.sum(), (v * v).sum()])


def std_of(stats: torch.Tensor) -> float:
    count, total, squares = (float(x) for x in stats)
    if count < 2:
        return math.nan
    return math.sqrt(max(0.0, (squares - total * total / count) / (count - 1)))


def weighted_rewards(per_func: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """[n] each completion's reward: the weighted sum of its functions' rewards, NaN where every one is None."""
    summed = (per_func * torch.tensor(weights, dtype=torch.float32)).nansum(dim=1)
    return torch.where(torch.isnan(per_func).all(dim=1), torch.full_like(summed, math.nan), summed)


def reduce_sum(t: torch.Tensor, env) -> torch.Tensor:  # noqa: ANN001
    if env.world_size > 1:
        t = t.to(env.device)
        dist.all_reduce(t)
    return t.cpu()


def reduce_max(t: torch.Tensor, env) -> torch.Tensor:  # noqa: ANN001
    if env.world_size > 1:
        t = t.to(env.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu()
