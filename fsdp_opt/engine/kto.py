"""Kahneman-Tversky Optimization (--method kto): each item's loss from its completion's summed log-probability against
the reference's, and a KL estimate from its micro-batch's mismatched completions (data/unpaired.py). TRL 1.16's
KTOTrainer, with the policy's (pi) and the reference's (ref) summed completion log-probabilities:

    r = pi(completion) - ref(completion)
    z = max(0, mean over the ranks of [mean over the rank's micro-batch of pi(mismatched) - ref(mismatched)])
    kto:                 desirable 1 - sigmoid(beta (r - z)),   undesirable 1 - sigmoid(beta (z - r))
    apo_zero_unpaired:   desirable 1 - sigmoid(beta r),         undesirable sigmoid(beta r)       (no z)

each weighted by --desirable_weight or --undesirable_weight. z carries no gradient: the policy's log-probabilities of
the mismatched sequences are a forward without gradients (in train mode, as TRL's), and every rank's micro-batch i is
averaged with the others' micro-batch i (a rank with a filler there, no items, is not counted). A step's loss is the
mean over its items, all ranks and micro-batches: TRL's mean of its micro-batches' means where each holds as many
items (--packing pad). The rewards are beta x r of each item, the metrics their means over the desirable and the
undesirable items.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fsdp_opt.data.sequences import held_out_micro_batches
from fsdp_opt.data.unpaired import Scored, Unpaired, scored_pairs
from fsdp_opt.engine.logprobs import head_logps, micro_logps, scored_logps, sequence_logps
from fsdp_opt.engine.loss import HeadLoss
from fsdp_opt.engine.microbatches import MicroLoss, StepLoss
from fsdp_opt.runtime.distributed import DistEnv

WITHOUT_KL = "apo_zero_unpaired"  # the --loss_type with no KL estimate (TRL's calculate_KL off)
# sums over items (and over micro-batch rounds for the last two), in this order
STATS = ("loss", "desirable", "undesirable", "rewards_chosen", "rewards_rejected", "kl", "kl_rounds")


def kto_terms(
    pi: torch.Tensor,
    ref: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    beta: float,
    loss_type: str,
    weights: tuple[float, float],
) -> torch.Tensor:
    """[5, items] per item: weighted loss, is desirable, is undesirable, reward if desirable, reward if undesirable.
    `pi`, `ref`: [items] summed completion log-probabilities; `desirable`: [items] bool; `kl`: the estimate z."""
    r = pi - ref
    if loss_type == WITHOUT_KL:
        good, bad = 1 - torch.sigmoid(beta * r), torch.sigmoid(beta * r)
    else:  # kto
        good, bad = 1 - torch.sigmoid(beta * (r - kl)), 1 - torch.sigmoid(beta * (kl - r))
    loss = torch.where(desirable, weights[0] * good, weights[1] * bad)
    d = desirable.float()
    reward = beta * r.detach()
    return torch.stack([loss, d, 1 - d, reward * d, reward * (1 - d)])


class UnpairedLoss(StepLoss):
    """--method kto's step (engine/step.py): each micro-batch's KL estimate (a forward without gradients of its
    mismatched sequences, reduced over the ranks), then its items' loss against the reference's log-probabilities, the
    loss a mean over the step's items. `own`: the reference's log-probability of each item's sequence; `mismatched`: of
    each (prompt item, completion item) the step's micro-batches read."""

    names = STATS

    def __init__(
        self,
        items: Unpaired,
        own: torch.Tensor,
        mismatched: dict[tuple[int, int], float],
        settings,  # noqa: ANN001 - config/methods/kto.py KtoFlags
        head: HeadLoss | None,
        env: DistEnv,
    ) -> None:
        self.items, self.own, self.mismatched, self.head, self.env = items, own, mismatched, head, env
        self.beta, self.loss_type, self.weights = settings.beta, settings.loss_type, settings.weights

    def _ref(self, a: int, b: int) -> float:
        """The reference's log-probability of item a's prompt with item b's completion (a micro-batch of one item:
        its own)."""
        return float(self.own[a]) if a == b else self.mismatched[(a, b)]

    def kl(self, model: nn.Module, members: list[int]) -> tuple[torch.Tensor, bool]:
        """The KL estimate z of this micro-batch round (every rank calls it), and whether any rank had items."""
        env = self.env
        found = torch.zeros(2, device=env.device, dtype=torch.float32)
        if self.loss_type != WITHOUT_KL:
            with torch.no_grad():
                batch, slot = self.items.kl_micro(members, env.device)
                logps, _ = head_logps(model, self.head, batch)
                pi = sequence_logps(logps, slot, len(members))
            if members:
                ref = torch.tensor([self._ref(a, b) for a, b in Unpaired.partners(members)], device=env.device)
                found[0], found[1] = (pi - ref).mean(), 1.0
        elif members:
            found[1] = 1.0
        if env.world_size > 1:
            dist.all_reduce(found)
        return (found[0] / found[1].clamp(min=1)).clamp(min=0), bool(found[1] > 0)

    def loss(self, model: nn.Module, members: list[int]) -> MicroLoss:
        env = self.env
        z, counted = self.kl(model, members)
        pi, out = micro_logps(model, self.items, members, env.device, self.head)
        kl_sums = torch.stack([z, torch.tensor(float(counted), device=env.device)]) / env.world_size
        index = torch.tensor(members, dtype=torch.long)
        ref, desirable = self.own[index].to(env.device), self.items.labels[index].to(env.device)
        terms = kto_terms(pi, ref, desirable, z, self.beta, self.loss_type, self.weights)
        return MicroLoss(terms[0].sum(), torch.cat([terms[1:].sum(1).detach(), kl_sums]), out)

    def record(self, sums: dict[str, float], step, seconds: float) -> dict[str, float | int | None]:  # noqa: ANN001
        """The step's means: the rewards over its desirable and its undesirable items, z over its rounds."""
        good, bad = round(sums["desirable"]), round(sums["undesirable"])
        chosen = sums["rewards_chosen"] / good if good else None
        rejected = sums["rewards_rejected"] / bad if bad else None
        return {
            "desirable": good,
            "undesirable": bad,
            "rewards_chosen": chosen,
            "rewards_rejected": rejected,
            "margin": chosen - rejected if good and bad else None,
            "kl": sums["kl"] / sums["kl_rounds"] if sums["kl_rounds"] else 0.0,
        }


def mismatched_of(items: Unpaired, reference: torch.Tensor, pairs: list[tuple[int, int]]) -> dict:
    """The reference's log-probabilities (in `pairs`' order) of the mismatched sequences, by (prompt, completion)."""
    return {p: float(v) for p, v in zip(pairs, reference.tolist()) if p[0] != p[1]}


@torch.no_grad()
def evaluate_items(
    model: nn.Module,
    items: Unpaired,
    reference: dict[tuple[int, int], float],
    beta: float,
    loss_type: str,
    weights: tuple[float, float],
    batch_size: int,
    env: DistEnv,
) -> dict[str, float]:
    """The KTO metrics of the policy on held-out items against the reference's log-probabilities (of every sequence
    of scored_pairs over the held-out micro-batches): each micro-batch's own z, as a training step's."""
    micro = held_out_micro_batches(items, batch_size)
    pairs = scored_pairs(items, micro)
    pi = dict(zip(pairs, scored_logps(model, Scored(items, pairs), batch_size, env).tolist()))
    sums, zs = torch.zeros(5), []
    for members in micro:
        z = 0.0
        if loss_type != WITHOUT_KL:
            z = max(0.0, sum(pi[p] - reference[p] for p in Unpaired.partners(members)) / len(members))
        zs.append(z)
        own = torch.tensor([pi[(i, i)] for i in members])
        ref = torch.tensor([reference[(i, i)] for i in members])
        terms = kto_terms(own, ref, items.labels[members], torch.tensor(z), beta, loss_type, weights)
        sums += terms.sum(1)
    n, good, bad = len(items), int(sums[1]), int(sums[2])
    chosen = float(sums[3]) / good if good else None
    rejected = float(sums[4]) / bad if bad else None
    return {
        "loss": float(sums[0]) / n,
        "rewards_chosen": chosen,
        "rewards_rejected": rejected,
        "margin": chosen - rejected if good and bad else None,
        "kl": sum(zs) / len(zs),
        "items": n,
        "desirable": good,
        "undesirable": bad,
    }
