"""A generation's completions scored (GRPO, RLOO): the reward functions called on every rank's completions, their
weighted sum, and each completion's advantage against its group (a group's mean and spread, or the mean of the rest
of the group: RLOO's leave-one-out baseline). Held-out prompts are scored the same way, without advantages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_opt.data.prompts import Prompts
from fsdp_opt.engine.groups import (
    GroupSettings,
    advantages,
    leave_one_out,
    nan_stats,
    reduce_sum,
    std_of,
    weighted_rewards,
)
from fsdp_opt.engine.rewards import score
from fsdp_opt.runtime.distributed import DistEnv, all_ranks_ok


@dataclass
class Scoring:
    """How a generation's completions are scored (GRPO, RLOO): the settings, and the reference's token log-probabilities
    of a packed micro-batch (None without one)."""

    settings: GroupSettings
    reference_logps: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = None


@dataclass
class Scored:
    """The generation's scores on this rank, in request order (NaN: no reward)."""

    per_func: torch.Tensor  # [n, functions]
    reward: torch.Tensor  # [n] the weighted sum of the functions' (what the records and the metrics show)
    advantages: torch.Tensor  # [n] from the reward, less the KL where it is in the reward (RLOO)
    zero: torch.Tensor  # [n] bool: its group's rewards are all the same


@dataclass
class Completions:
    """This rank's completions as the reward functions read them: of which prompts, their text and tokens, their
    rows, whether each ended, and (sampled in groups) each one's place in its group."""

    prompts: list[int]  # indices into the Prompts
    texts: list[str]
    ids: list[list[int]]
    rows: list[int]
    ended: list[bool]
    places: list[int] | None = None


def rewards(settings: GroupSettings, prompts: Prompts, done: Completions) -> tuple[torch.Tensor, torch.Tensor]:
    """([n, functions] each reward function's score, [n] their weighted sum) of this rank's completions. Every rank
    calls it: a failing function fails every rank, and a reward model's forward is collective."""
    texts = done.texts
    completions = [[{"role": "assistant", "content": t}] for t in texts] if prompts.conversational else texts
    asked = [prompts.rows[p]["prompt"] for p in done.prompts]
    columns = prompts.column_lists(done.prompts) if done.prompts else {}
    per_func = all_ranks_ok(
        lambda: score(settings.rewards, asked, completions, done.ids, columns, done.rows, done.ended, done.places)
    )
    per_func = torch.tensor(per_func, dtype=torch.float32).view(len(done.prompts), len(settings.rewards))
    return per_func, weighted_rewards(per_func, settings.weights)


def scores(
    settings: GroupSettings, prompts: Prompts, done: Completions, log_ratio: torch.Tensor, env: DistEnv
) -> Scored:
    """The rewards of this rank's completions of a generation and their advantages; `log_ratio` [n]: each one's summed
    log-ratio to the reference, taken off the reward where the KL is in it (RLOO). The statistics span the ranks."""
    per_func, raw = rewards(settings, prompts, done)
    n = len(done.prompts)
    reward = raw - settings.beta * log_ratio.float() if settings.kl_in_reward and len(log_ratio) else raw
    generation_stats = reduce_sum(nan_stats(reward), env)  # the generation's rewards on all ranks
    if not n:
        adv, zero = torch.zeros(0), torch.zeros(0, dtype=torch.bool)
    elif settings.baseline == "leave_one_out":
        adv, zero = leave_one_out(reward, settings.generations), advantages(reward, settings.generations, "none")[1]
    else:
        batch_std = std_of(generation_stats) if settings.scale_rewards == "batch" else None
        adv, zero = advantages(reward, settings.generations, settings.scale_rewards, batch_std)
    if settings.normalize:  # over the generation's scored advantages, all ranks
        stats = reduce_sum(nan_stats(adv), env)
        adv = (adv - float(stats[1] / max(1.0, float(stats[0])))) / (std_of(stats) + 1e-4)
    return Scored(per_func, raw, torch.nan_to_num(adv, nan=0.0), zero)


def mean_rewards(settings: GroupSettings, per_func: torch.Tensor, reward: torch.Tensor, env: DistEnv) -> dict[str, Any]:
    """The mean reward over every rank's completions, in total (`reward`) and per function (`reward_<label>`); a
    completion without a reward (NaN) counts in neither."""
    funcs = range(len(settings.rewards))
    stats = reduce_sum(torch.cat([nan_stats(reward)[:2], *(nan_stats(per_func[:, j])[:2] for j in funcs)]), env)
    out = {"reward": float(stats[1] / max(1.0, float(stats[0])))}
    for j, r in enumerate(settings.rewards):
        out[f"reward_{r.label}"] = float(stats[2 + 2 * j + 1] / max(1.0, float(stats[2 + 2 * j])))
    return out
