"""Direct Preference Optimization (--method dpo): a pair's loss from the summed log-probabilities of its answers.

A sequence's log-probability is the sum of its answer tokens' log-probabilities, in fp32 from the logits of the answer
tokens alone where the model's output layer is a plain projection (engine/loss.py HeadLoss; a chunk of tokens at a
time with --loss_chunk_tokens). With the policy's (pi) and the reference's (ref):

    loss = -log sigmoid(beta * ((pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)))

and a step's loss is the mean over its pairs, all ranks and micro-batches. The rewards are beta * (pi - ref) of each
answer, their margin the chosen's less the rejected's, and the accuracy the share of pairs whose chosen reward is the
higher (a tie counts half: a policy that is still its reference scores 50%).

The reference's log-probabilities are computed before training (reference_logps: the reference model, or a LoRA run's
base with its adapters switched off) and kept with the checkpoint; a step reads them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_opt.data.blocks import IGNORE_INDEX
from fsdp_opt.data.pairs import Pairs
from fsdp_opt.engine.loss import HeadLoss, head_forward, next_token_targets
from fsdp_opt.engine.microbatches import run_micro_batches
from fsdp_opt.runtime.distributed import DistEnv

STATS = ("loss", "rewards_chosen", "rewards_rejected", "accuracy")  # sums over pairs, in this order


def token_logps(
    out: torch.Tensor, labels: torch.Tensor, head: HeadLoss | None, temperature: float = 1.0
) -> torch.Tensor:
    """Each position's log-probability of its next token (0 where there is no target), fp32, [batch, length], from the
    logits divided by `temperature` (GRPO's completions were drawn that way)."""
    targets = next_token_targets(labels)
    if head is None:
        logits = out.reshape(-1, out.shape[-1]).float()
        if temperature != 1.0:
            logits = logits / temperature
        flat = -F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none")
        return flat.view(targets.shape)
    return head.token_logps(out, labels, temperature).view(targets.shape)


def head_logps(
    model: nn.Module, head: HeadLoss | None, batch: dict[str, torch.Tensor], temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """token_logps of one forward of `model` on `batch` (with `head`, the output layer at the targets only), and the
    forward's output (the logits, or with `head` the final hidden states)."""
    out = head_forward(model, head, batch)
    return token_logps(out, batch["labels"], head, temperature), out


def sequence_logps(logps: torch.Tensor, slot: torch.Tensor, sequences: int) -> torch.Tensor:
    """[sequences] sums of the token log-probabilities of each sequence (slot: each position's sequence, -1 none)."""
    # the log-probability at position t is of the token at t + 1: it belongs to that token's sequence
    owner = F.pad(slot[:, 1:], (0, 1), value=-1)
    # positions of no sequence go to one more slot, dropped: no data-dependent indexing (a fake tensor has no data)
    owner = torch.where(owner >= 0, owner, sequences).reshape(-1)
    sums = torch.zeros(sequences + 1, dtype=torch.float32, device=logps.device).index_add(0, owner, logps.reshape(-1))
    return sums[:sequences]


def dpo_terms(pi: torch.Tensor, ref: torch.Tensor, beta: float) -> torch.Tensor:
    """[len(STATS), pairs] per pair: loss, chosen reward, rejected reward, correct (1, a tie 0.5, else 0).
    `pi`, `ref`: [2 x pairs] summed log-probabilities, chosen then rejected of each pair."""
    chosen = beta * (pi[0::2] - ref[0::2])
    rejected = beta * (pi[1::2] - ref[1::2])
    loss = -F.logsigmoid(chosen - rejected)
    correct = (chosen > rejected).float() + 0.5 * (chosen == rejected).float()
    return torch.stack([loss, chosen.detach(), rejected.detach(), correct.detach()])


def micro_logps(
    model: nn.Module, pairs: Pairs, members: list[int], device: torch.device, head: HeadLoss | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed answer log-probabilities of these pairs' sequences (chosen, rejected of each), one forward, and
    the forward's output (the logits, or with `head` the final hidden states)."""
    batch, slot = pairs.micro(members, device)
    logps, out = head_logps(model, head, batch)
    return sequence_logps(logps, slot, 2 * len(members)), out


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
        return torch.tensor([2 * p + k for p in members for k in (0, 1)])


@dataclass
class Reference:
    """The reference model's summed answer log-probabilities of each sequence of a slice's pairs (and of its
    held-out pairs), by dataset row: what a checkpoint keeps so that a resumed session does not run the reference
    again."""

    index: torch.Tensor  # [pairs] dataset row of each pair
    logps: torch.Tensor  # [pairs, 2] chosen, rejected (fp32)

    def for_pairs(self, pairs: Pairs) -> torch.Tensor:
        """[2 x len(pairs)] in the pairs' order: chosen then rejected of each."""
        at = {int(i): k for k, i in enumerate(self.index)}
        rows = [at[int(i)] for i in pairs.index]
        return self.logps[rows].reshape(-1)

    def covers(self, pairs: Pairs) -> bool:
        have = set(self.index.tolist())
        return all(int(i) in have for i in pairs.index)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"index": self.index.clone(), "logps": self.logps.clone()}

    @classmethod
    def from_state(cls, state: dict | None) -> Reference | None:
        return None if not state else cls(state["index"], state["logps"])


def _rank_micro(pairs: Pairs, batch_size: int, env: DistEnv) -> tuple[list[list[int]], int]:
    """The pairs in their own order, laid into micro-batches; this rank's share, padded so every rank runs as many."""
    micro: list[list[int]] = [[]]
    for p in range(len(pairs)):
        if micro[-1] and not pairs.fits(micro[-1] + [p], batch_size):
            micro.append([])
        micro[-1].append(p)
    rounds = -(-len(micro) // env.world_size)
    grid = micro + [[] for _ in range(rounds * env.world_size - len(micro))]
    return [grid[r * env.world_size + env.rank] for r in range(rounds)], rounds


@torch.no_grad()
def pair_logps(model: nn.Module, pairs: Pairs, batch_size: int, env: DistEnv) -> torch.Tensor:
    """[2 x pairs] summed answer log-probabilities of every pair (chosen, rejected), in eval mode; every rank runs the
    same number of forwards and gets the whole result. The output layer runs at the answer tokens only where the model
    allows it (HeadLoss), as in a training step: a pair's prompt never gets its vocabulary-wide logits."""
    head = HeadLoss.for_run(model, 0)
    was_training = model.training
    model.eval()
    found = torch.zeros(pairs.sequences, dtype=torch.float32, device=env.device)
    try:
        for members in _rank_micro(pairs, batch_size, env)[0]:
            sums, _ = micro_logps(model, pairs, members, env.device, head)
            if members:
                seqs = torch.tensor([2 * p + k for p in members for k in (0, 1)], device=env.device)
                found[seqs] = sums
    finally:
        model.train(was_training)
    if env.world_size > 1:
        dist.all_reduce(found)  # each sequence is one rank's
    return found.cpu()


def evaluate_pairs(
    model: nn.Module, pairs: Pairs, reference: torch.Tensor, beta: float, batch_size: int, env: DistEnv
) -> dict[str, float]:
    """The DPO metrics of the policy on these pairs against the reference's log-probabilities."""
    pi = pair_logps(model, pairs, batch_size, env)
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


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base alone: every LoRA layer's adapters switched off (peft's flag), then back on."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    # NOTE: the flag itself, not enable_adapters(): that also flips requires_grad of the adapters FSDP holds.
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, was in zip(layers, before):
            m._disable_adapters = was
