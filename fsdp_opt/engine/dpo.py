"""Direct Preference Optimization (--method dpo): a pair's loss from the summed log-probabilities of its answers.

A sequence's log-probability is the sum of its answer tokens' log-probabilities, in fp32 from the logits of the answer
tokens alone where the model's output layer is a plain projection (engine/loss.py HeadLoss; a chunk of tokens at a
time with --loss_chunk_tokens). With the policy's (pi) and the reference's (ref):

    loss = -log sigmoid(beta * ((pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)))

and a step's loss is the mean over its pairs, all ranks and micro-batches. The rewards are beta * (pi - ref) of each
answer, their margin the chosen's less the rejected's, and the accuracy the share of pairs whose chosen reward is the
higher (a tie counts half: a policy that is still its reference scores 50%).

The reference's log-probabilities are computed before training (engine/logprobs.py scored_logps: the reference model,
or a LoRA run's base with its adapters switched off) and kept with the checkpoint; a step reads them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_opt.data.pairs import Pairs
from fsdp_opt.engine.logprobs import micro_logps, scored_logps, unit_sequences
from fsdp_opt.engine.loss import HeadLoss
from fsdp_opt.engine.microbatches import MicroLoss, StepLoss
from fsdp_opt.runtime.distributed import DistEnv

STATS = ("loss", "rewards_chosen", "rewards_rejected", "accuracy")  # sums over pairs, in this order


def dpo_terms(pi: torch.Tensor, ref: torch.Tensor, beta: float) -> torch.Tensor:
    """[len(STATS), pairs] per pair: loss, chosen reward, rejected reward, correct (1, a tie 0.5, else 0).
    `pi`, `ref`: [2 x pairs] summed log-probabilities, chosen then rejected of each pair."""
    chosen = beta * (pi[0::2] - ref[0::2])
    rejected = beta * (pi[1::2] - ref[1::2])
    loss = -F.logsigmoid(chosen - rejected)
    correct = (chosen > rejected).float() + 0.5 * (chosen == rejected).float()
    return torch.stack([loss, chosen.detach(), rejected.detach(), correct.detach()])


class PairLoss(StepLoss):
    """--method dpo's step (engine/step.py): each micro-batch's pairs, their summed answer log-probabilities against
    the reference's, the loss a mean over the step's pairs. `reference`: the reference's log-probabilities of each
    training sequence (2 per pair)."""

    names = STATS

    def __init__(
        self, pairs: Pairs, reference: torch.Tensor, beta: float, head: HeadLoss | None, device: torch.device
    ) -> None:
        self.pairs, self.reference, self.beta, self.head, self.device = pairs, reference, beta, head, device

    def loss(self, model: nn.Module, members: list[int]) -> MicroLoss:
        pi, out = micro_logps(model, self.pairs, members, self.device, self.head)
        ref = self.reference[unit_sequences(members, 2)].to(self.device)
        terms = dpo_terms(pi, ref, self.beta)
        return MicroLoss(terms[0].sum(), terms[1:].sum(1).detach(), out)

    def record(self, sums: dict[str, float], step, seconds: float) -> dict[str, float | int]:  # noqa: ANN001
        """The step's means over its pairs."""
        pairs = max(1, step.loss_units)
        chosen, rejected = sums["rewards_chosen"] / pairs, sums["rewards_rejected"] / pairs
        return {
            "pairs": step.loss_units,
            "rewards_chosen": chosen,
            "rewards_rejected": rejected,
            "margin": chosen - rejected,
            "accuracy": sums["accuracy"] / pairs,
        }


def evaluate_pairs(
    model: nn.Module, pairs: Pairs, reference: torch.Tensor, beta: float, batch_size: int, env: DistEnv
) -> dict[str, float]:
    """The DPO metrics of the policy on these pairs against the reference's log-probabilities."""
    pi = scored_logps(model, pairs, batch_size, env)
    terms = dpo_terms(pi, reference, beta)
    n = terms.shape[1]
    loss, chosen, rejected, accuracy = (terms[i].sum().item() / n for i in range(len(STATS)))
    return {
        "loss": loss,
        "rewards_chosen": chosen,
        "rewards_rejected": rejected,
        "margin": chosen - rejected,
        "accuracy": accuracy,
        "pairs": n,
    }
