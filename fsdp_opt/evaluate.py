"""Held-out evaluation: token-mean loss and perplexity over packed blocks, on any number of ranks.

Each rank takes every world_size-th block; ranks with fewer blocks run filler rows (no targets), so every rank
makes the same forward calls, which a sharded model needs. Sums of loss and target tokens are all-reduced.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .data import IGNORE_INDEX, Blocks
from .distributed import DistEnv


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over the targets; fp32 for the softmax."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def rank_batches(num_blocks: int, batch_size: int, rank: int, world_size: int) -> list[torch.Tensor]:
    """This rank's block indices in micro-batches; -1 pads so every rank has the same batch shapes and count."""
    per_rank = math.ceil(num_blocks / world_size)
    mine = torch.arange(rank, num_blocks, world_size)
    mine = torch.cat([mine, torch.full((per_rank - len(mine),), -1, dtype=mine.dtype)])
    return [mine[i : i + batch_size] for i in range(0, per_rank, batch_size)]


@torch.no_grad()
def evaluate_loss(model: nn.Module, blocks: Blocks, batch_size: int, env: DistEnv) -> dict[str, float]:
    """{"loss": token-mean loss, "perplexity": exp(loss), "tokens": target tokens} over all of `blocks`."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)
    try:
        for index in rank_batches(len(blocks), batch_size, env.rank, env.world_size):
            batch = blocks.batch(index, env.device)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
            totals[0] += causal_lm_loss_sum(logits, batch["labels"]).double()
            totals[1] += (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    finally:
        model.train(was_training)
    if env.world_size > 1:
        dist.all_reduce(totals)
    loss_sum, tokens = totals.tolist()
    loss = loss_sum / max(1.0, tokens)
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(tokens)}
