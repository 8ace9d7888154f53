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
from fsdp_opt.engine.microbatches import run_micro_batches
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


class PairLoss:
    """--method dpo's step (engine/step.py StepLoss): each micro-batch's pairs, their summed answer log-probabilities
    against the reference's, the loss a mean over the step's pairs (each micro-batch's sum divided by the step's
    global count of pairs). `reference`: the reference's log-probabilities of each training sequence (2 per pair)."""

    names = STATS

    def __init__(self, reference: torch.Tensor, beta: float) -> None:
        self.reference, self.beta = reference, beta

    def prepare(self, s, step) -> None:  # noqa: ANN001
        pass

    def accumulate(self, s, step, scale: float) -> torch.Tensor:  # noqa: ANN001
        env = s.env
        weight = scale / max(1, step.loss_units)
        stats = torch.zeros(len(STATS), device=env.device, dtype=torch.float32)

        def loss_of(i: int):  # noqa: ANN202
            members = step.micro_batches[i]
            pi, out = micro_logps(s.model, s.blocks, members, env.device, s.head_loss)
            if not members:  # a filler micro-batch: no pair, but the same backward (and collectives) as every rank's,
                # the output layer's included (its log-probabilities of no tokens)
                return pi.sum() * 0.0 * weight, None, out
            terms = dpo_terms(pi, self.reference[self._seqs(members)].to(env.device), self.beta)
            return terms[0].sum() * weight, terms.sum(1).detach(), out

        run_micro_batches(s.model, len(step.micro_batches), loss_of, sync_each=s.reduce_each_microbatch, sums=stats)
        return stats

    def first_loss(self, s, first) -> torch.Tensor:  # noqa: ANN001
        """The first micro-batch's summed pair loss and its pairs (this rank's)."""
        total = torch.zeros(2, device=s.env.device, dtype=torch.float32)
        members = first.micro_batches[0] if first is not None else []
        pi, _ = micro_logps(s.model, s.blocks, members, s.env.device, s.head_loss)
        if members:
            total[0] = dpo_terms(pi, self.reference[self._seqs(members)].to(s.env.device), self.beta)[0].sum()
            total[1] = len(members)
        return total

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

    @staticmethod
    def _seqs(members: list[int]) -> torch.Tensor:
        return unit_sequences(members, 2)


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
