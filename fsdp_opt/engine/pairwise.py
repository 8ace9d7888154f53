"""A pairwise loss over sequence scores (--method reward: TRL 1.16's RewardTrainer). A sequence classifier of one label
scores each answer of a pair (prompt and answer as one text) at its last token that is not the pad token, as
transformers' sequence-classification models pool; the loss of a pair is

    -log sigmoid(r_chosen - r_rejected - margin) + coefficient x (r_chosen + r_rejected)^2

(the margin column where the rows have one, else 0; the coefficient --center_rewards_coefficient, else 0), and a
step's loss is the mean over its pairs, all ranks and micro-batches. The metrics are TRL's: the share of pairs whose
chosen answer scores the higher (accuracy), the mean of r_chosen - r_rejected (margin), the lowest, mean and highest
score of the step's answers.

The scores are read per position from the score layer's own output (a hook on it), so that a micro-batch packs
several pairs into one row (--packing docs) as it packs DPO's: the model's pooled output, one score per row, is not
used.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_opt.data.blocks import model_inputs
from fsdp_opt.data.pairs import Pairs
from fsdp_opt.data.sequences import held_out_micro_batches, rank_rounds
from fsdp_opt.engine.microbatches import MicroLoss, StepLoss
from fsdp_opt.model.loader import SCORE_LAYER
from fsdp_opt.runtime.distributed import DistEnv

STATS = ("loss", "accuracy", "margin", "mean_reward")  # sums over pairs (mean_reward: over answers), in this order


def score_layer(model: nn.Module) -> nn.Module:
    """The layer that turns a sequence classifier's hidden states into its scores."""
    return model.get_submodule(SCORE_LAYER)


def sequence_scores(
    model: nn.Module, batch: dict[str, torch.Tensor], slot: torch.Tensor, sequences: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[sequences] each sequence's score at its last token that is not the pad token, and the scores of every position
    (kept alive through the backward). `slot`: each position's sequence (-1: none)."""
    seen: list[torch.Tensor] = []
    handle = score_layer(model).register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        model(**model_inputs(batch))
    finally:
        handle.remove()
    per_position = seen[-1][..., 0].float()  # [rows, length]
    rows, length = per_position.shape
    place = torch.arange(rows * length, device=slot.device).view(rows, length)
    mine = (slot >= 0) & (batch["input_ids"] != pad_id)
    owner = torch.where(mine, slot, sequences).reshape(-1)
    last = torch.full((sequences + 1,), -1, dtype=torch.long, device=slot.device)
    last = last.scatter_reduce(0, owner, torch.where(mine, place, -1).reshape(-1), "amax")
    return per_position.reshape(-1)[last[:sequences].clamp(min=0)], per_position


def pair_terms(scores: torch.Tensor, margins: torch.Tensor | None, coefficient: float | None) -> torch.Tensor:
    """[len(STATS), pairs] per pair: loss, correct, margin, mean score of its two answers. `scores`: [2 x pairs],
    chosen then rejected of each pair."""
    chosen, rejected = scores[0::2], scores[1::2]
    gap = chosen - rejected
    loss = -F.logsigmoid(gap - (margins.to(gap.device) if margins is not None else 0.0))
    if coefficient:
        loss = loss + coefficient * (chosen + rejected) ** 2
    with torch.no_grad():
        stats = [(gap > 0).float(), gap, (chosen + rejected) / 2]
    return torch.stack([loss, *stats])


class PairScoreLoss(StepLoss):
    """--method reward's step (engine/step.py): each micro-batch's pairs scored, the loss a mean over the step's
    pairs."""

    names = STATS

    def __init__(self, pairs: Pairs, coefficient: float | None, env: DistEnv) -> None:
        self.pairs, self.coefficient, self.env = pairs, coefficient, env
        self.extremes = torch.full((2,), float("-inf"), device=env.device)  # the step's highest score, and -lowest

    def prepare(self, run: Any, step: Any) -> None:  # noqa: ANN401
        self.extremes = torch.full((2,), float("-inf"), device=self.env.device)

    def loss(self, model: nn.Module, members: list[int]) -> MicroLoss:
        batch, slot = self.pairs.micro(members, self.env.device)
        scores, out = sequence_scores(model, batch, slot, 2 * len(members), self.pairs.pad_id)
        margins = self.pairs.margins[members] if self.pairs.margins is not None else None
        terms = pair_terms(scores, margins, self.coefficient)
        if members:  # on the device: the host reads it once, in record
            self.extremes = torch.maximum(self.extremes, torch.stack([scores.max(), -scores.min()]).detach())
        return MicroLoss(terms[0].sum(), terms[1:].sum(1).detach(), out)

    def record(self, sums: dict[str, float], step: Any, seconds: float) -> dict[str, Any]:  # noqa: ANN401
        """The step's means over its pairs, and its lowest and highest score (every rank calls this)."""
        extremes = self.extremes.clone()
        if self.env.world_size > 1:
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        pairs = max(1, step.loss_units)
        return {
            "pairs": step.loss_units,
            "accuracy": sums["accuracy"] / pairs,
            "margin": sums["margin"] / pairs,
            "min_reward": -float(extremes[1]),
            "mean_reward": sums["mean_reward"] / pairs,
            "max_reward": float(extremes[0]),
        }


@torch.no_grad()
def evaluate_scores(
    model: nn.Module, pairs: Pairs, coefficient: float | None, batch_size: int, env: DistEnv
) -> dict[str, float]:
    """The loss and TRL's metrics of a reward model on held-out pairs (each rank a share of the micro-batches; every
    rank runs as many)."""
    was = model.training
    model.eval()
    sums = torch.zeros(len(STATS), dtype=torch.float64, device=env.device)
    extremes = torch.tensor([float("-inf"), float("-inf")], dtype=torch.float64, device=env.device)
    try:
        for members in rank_rounds(held_out_micro_batches(pairs, batch_size), env.rank, env.world_size):
            batch, slot = pairs.micro(members, env.device)
            scores, _ = sequence_scores(model, batch, slot, 2 * len(members), pairs.pad_id)
            margins = pairs.margins[members] if pairs.margins is not None else None
            sums += pair_terms(scores, margins, coefficient).sum(1).double()
            if members:
                extremes = torch.maximum(extremes, torch.stack([scores.max(), -scores.min()]).double())
    finally:
        model.train(was)
    if env.world_size > 1:
        dist.all_reduce(sums)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    n = max(1, len(pairs))
    loss, accuracy, margin, mean = (float(v) / n for v in sums.tolist())
    return {
        "loss": loss,
        "accuracy": accuracy,
        "margin": margin,
        "min_reward": -float(extremes[1]),
        "mean_reward": mean,
        "max_reward": float(extremes[0]),
        "pairs": len(pairs),
    }
