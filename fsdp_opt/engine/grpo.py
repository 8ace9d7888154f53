"""A group's policy loss (--method grpo, rloo): a step's prepare phase samples --num_generations completions of each
of its prompts from the policy, scores them with the reward functions, and turns the rewards into advantages
(engine/rollout.py: a generation, which may feed several steps); then the same micro-batches, optimizer step and
checkpoint as any method.

RLOO (TRL 1.16's RLOOTrainer) is this loss with its own three rules: the advantage is the reward less the mean of the
others' in its group (--normalize_advantages: then the generation's, standardized), the KL is in the reward (beta x
the completion's summed log-ratio of the policy at sampling to the reference, no KL term in the loss), and the ratio
is the exp of the completion's summed log-ratio (`level` sequence_sum), averaged over the step's completions (the
grpo loss type, each completion's loss being the same at each of its tokens).

TRL 1.16's GRPOTrainer loss:

- advantages: A = (r - mean of its group) / (std of its group + 1e-4), the std with Bessel's correction
  (--scale_rewards group; batch: the std of the generation's rewards on all ranks; none: no division); r is the
  weighted sum of the reward functions' values; a completion whose every reward is None has no r, stays out of its
  group's mean and std, and gets A = 0;
- the ratio rho = exp(logp - old): old is the log-probability the completion was sampled with when its generation is
  trained on more than once (--num_iterations, --steps_per_generation), else logp.detach() (1 in value, A grad logp
  in gradient); at --importance_sampling_level sequence (GSPO) the exp of the mean of the completion's tokens'
  log-ratios, one rho per completion;
- per token of a completion: -min(rho' A, clip(rho, 1 - eps, 1 + eps_high) A) + beta rho k3, with rho' = min(rho,
  --delta) where --delta is set (the two-sided clip) and k3 = exp(ref - logp) - (ref - logp) - 1 (the factor rho on
  it is TRL 1.16's default, use_bias_correction_kl); log-probabilities of the logits divided by the temperature, fp32;
- the mask: a completion's tokens up to and including its end; none of a completion that never ended, with
  --mask_truncated_completions;
- --loss_type: dapo divides the summed token losses by the generation's completion tokens (all ranks) over the steps
  it feeds; grpo averages each completion's token mean over the step's completions; dr_grpo divides by completions x
  --max_completion_length; bnpo divides each micro-batch's sum by its own tokens (and by the step's micro-batches);
- the clip's share, as TRL logs it: of the completion tokens (completions at sequence level) where rho < 1 - eps with
  A < 0 (clip_ratio/low_mean), rho > 1 + eps_high with A > 0 (high_mean), either (region_mean).

A step's completions are packed into micro-batches as DPO packs its pairs (data/sequences.py): every sequence a
document of its own. Each rank generates and scores its own prompts (a prompt's group stays on one rank); the
statistics that span ranks (token and completion counts, the batch std, the metrics) are all-reduced.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_opt.data.blocks import GenerationSlot, StepBatch
from fsdp_opt.engine.groups import GroupSettings
from fsdp_opt.engine.logprobs import head_logps
from fsdp_opt.engine.loss import completion_positions
from fsdp_opt.engine.microbatches import MicroLoss, StepLoss
from fsdp_opt.engine.rollout import Generation, Sampler, Slice, pack_members, sample_generation
from fsdp_opt.runtime.distributed import print0

CLIPS = ("low", "high", "region")  # the clip's shares the metrics log (TRL's clip_ratio/*_mean)


def policy_terms(
    logp: torch.Tensor,
    old: torch.Tensor | None,
    member_adv: torch.Tensor,
    on: torch.Tensor,
    owner: torch.Tensor,
    cfg: GroupSettings,
    reference: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """TRL 1.16's per-token GRPO loss on a packed micro-batch of completions: [batch, length] loss (0 off the
    completions), its KL term's rho k3 (beta > 0, else None), and the clip's counts [low, high, region, of how many].
    `member_adv`: each completion's advantage; `owner`: the completion each position belongs to (-1: none)."""
    members = member_adv.numel()
    zero = torch.zeros_like(logp)
    adv = torch.where(on, member_adv.to(logp.device)[owner.clamp(min=0)], zero)
    log_ratio = logp - (logp.detach() if old is None else old.to(logp.device))
    if cfg.level in ("sequence", "sequence_sum"):
        index = torch.where(on, owner, members).reshape(-1)  # off the completions: one more slot, dropped
        sums = torch.zeros(members + 1, device=logp.device).index_add(
            0, index, torch.where(on, log_ratio, zero).reshape(-1)
        )
        if cfg.level == "sequence":  # GSPO: the mean of its tokens' log-ratios
            counts = torch.zeros(members + 1, device=logp.device).index_add(0, index, on.float().reshape(-1))
            per_member = torch.exp(sums[:members] / counts[:members].clamp(min=1.0))
        else:  # RLOO: their sum
            per_member = torch.exp(sums[:members])
        weight = per_member[owner.clamp(min=0)]
    else:
        weight = torch.exp(log_ratio)
    kl = None
    if cfg.beta > 0 and reference is not None and not cfg.kl_in_reward:
        d = reference.to(logp.device) - logp
        kl = torch.where(on, (torch.exp(d) - d - 1) * weight, zero)
    clipped = torch.clamp(weight, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
    if cfg.delta is not None:
        weight = torch.clamp(weight, max=cfg.delta)
    loss = -torch.min(weight * adv, clipped * adv)
    if kl is not None:
        loss = loss + cfg.beta * kl
    with torch.no_grad():
        if cfg.level != "token":  # one ratio per completion: counted per completion
            w = per_member if cfg.delta is None else torch.clamp(per_member, max=cfg.delta)
            a, counted = member_adv.to(logp.device), torch.ones_like(per_member)
        else:
            w, a, counted = weight, adv, on.float()
        low = ((w < 1 - cfg.epsilon) & (a < 0)).float() * counted
        high = ((w > 1 + cfg.epsilon_high) & (a > 0)).float() * counted
        clips = torch.stack([low.sum(), high.sum(), torch.maximum(low, high).sum(), counted.sum()])
    return torch.where(on, loss, zero), kl, clips


class GroupLoss(StepLoss):
    """--method grpo's and rloo's step (engine/step.py). `sampler`: what a generation is sampled and scored with;
    `restored`: the generation a checkpoint saved between its steps (this rank's part)."""

    names = ("loss", "kl", *(f"clip_{c}" for c in CLIPS), "clip_count")

    def __init__(
        self, settings: GroupSettings, sampler: Sampler, device: torch.device, restored: Generation | None = None
    ) -> None:
        self.settings, self.sampler, self.device = settings, sampler, device
        self.generation = restored
        self.current: Slice | None = None
        self.slot: GenerationSlot | None = None

    # ------------------------------------------------------------ the prepare phase

    def prepare(self, run, step: StepBatch) -> None:  # noqa: ANN001
        """The step's slice of its generation: sampled now when the step opens one (or when a resumed session
        lacks the one it was inside), else the one kept."""
        slot, g = step.generation, self.generation
        if slot.index == 0 or g is None or (g.epoch, g.begin) != (step.epoch, slot.begin):
            if slot.index > 0:
                print0(
                    f"step {slot.index + 1} of a generation whose completions this session does not have (the "
                    "checkpoint was saved on another number of ranks, or before it kept them): sampling it again "
                    "from the model as it is now"
                )
            self.generation = sample_generation(run, step, self.sampler)
        self.slot, self.current = slot, self.generation.slices[slot.slice]

    @property
    def pending(self) -> bool:
        """Whether the generation has steps left after the current one (a checkpoint then keeps it)."""
        return self.slot is not None and self.slot.index + 1 < self.slot.count

    # ------------------------------------------------------------ the micro-batches

    def micro_batches(self, step: StepBatch) -> list[Any]:
        return list(enumerate(self.current.micro))

    def denominator(self, step: StepBatch) -> float:
        return 1.0  # each position's loss is divided by what its --loss_type says (`_weights`)

    def loss(self, model: nn.Module, item: tuple[int, list[int]]) -> MicroLoss:
        i, members = item
        current, cfg = self.current, self.settings
        batch, slot = pack_members(current, members, self.sampler.prompts, self.device)
        logp, _ = head_logps(model, self.sampler.head, batch, cfg.sampling.temperature)
        on, owner = completion_positions(batch["labels"], slot)
        member_adv = current.advantages[torch.tensor(members, dtype=torch.long)]
        reference = current.reference[i] if current.reference else None
        old = current.old[i] if current.old else None
        loss, kl, clips = policy_terms(logp, old, member_adv, on, owner, cfg, reference)
        total = (loss * self._weights(on, owner, members, current, i)).sum()
        kl_sum = kl.sum().detach() if kl is not None else total.new_zeros(())
        return MicroLoss(total, torch.cat([kl_sum.reshape(1), clips]))

    def _weights(self, on: torch.Tensor, owner: torch.Tensor, members: list[int], c: Slice, micro: int) -> torch.Tensor:
        """What each position's loss is divided by, for --loss_type (0 where nothing is predicted)."""
        cfg, t, on = self.settings, c.totals, on.float()
        if cfg.loss_type == "dapo":  # the generation's tokens, rescaled to one step of those it feeds (TRL's)
            g = self.generation
            return on / max(1.0, g.tokens / len(g.slices))
        if cfg.loss_type == "dr_grpo":
            return on / (max(1.0, t["completions"]) * cfg.sampling.max_new_tokens)
        if cfg.loss_type == "bnpo":
            micro_total = len(c.micro) * max(1, dist.get_world_size() if dist.is_initialized() else 1)
            return on / (max(1.0, c.micro_tokens[micro]) * micro_total)
        # grpo: each completion's token mean, averaged over the step's completions
        per_seq = torch.tensor([max(1, sum(c.targets[i])) for i in members], dtype=torch.float32, device=on.device)
        return on / (per_seq[owner.clamp(min=0)] * max(1.0, t["completions"]))

    def record(self, sums: dict[str, float], step: StepBatch, seconds: float) -> dict[str, Any]:
        """The step's metrics: rewards, completion lengths, the KL, the clip's shares, generation's share."""
        t, cfg, g, slot = self.current.totals, self.settings, self.generation, self.slot
        completions = max(1.0, t["completions"])
        sampled_here = slot.index == 0
        kl = None
        if cfg.beta > 0:
            kl = (t["log_ratio"] if cfg.kl_in_reward else sums["kl"]) / max(1.0, t["tokens"])
        out: dict[str, Any] = {
            "tokens": int(t["tokens"]),
            "tokens_seen": int(t["seen"]),
            "completions": int(t["completions"]),
            "reward": t["reward_sum"] / max(1.0, t["reward_count"]),
            "reward_std": t["reward_std"],
            **{f"reward_{r.label}": t[f"reward_{r.label}"] for r in cfg.rewards},
            "completion_length": t["generated"] / completions,
            "completion_length_max": int(t["length_max"]),
            "truncated": t["truncated"] / completions,
            "zero_std_groups": t["zero_std"] / completions,
            "kl": kl,
            "generation_share": min(1.0, g.seconds / seconds) if seconds > 0 and sampled_here else 0.0,
            "generated_tokens_per_second": g.generated / max(1e-9, g.seconds),
            "iteration": slot.iteration + 1,
            **{f"clip_ratio/{c}_mean": sums[f"clip_{c}"] / max(1.0, sums["clip_count"]) for c in CLIPS},
        }
        if self.current.source_tokens is not None:  # a mixture: beside source_rows (the step plan's)
            out["source_tokens"] = self.current.source_tokens
        return out

    def state(self, env) -> dict[str, Any]:  # noqa: ANN001
        """Saved between the steps of a generation: the generation itself, every rank's part."""
        if not self.pending:
            return {}
        mine = self.generation.state()
        parts = [mine]
        if env.world_size > 1:
            parts = [None] * env.world_size
            dist.all_gather_object(parts, mine)
        return {"generation": {"ranks": parts}}

    def completions(self) -> list[dict[str, Any]]:
        """The step's completions the first time they train (completions.jsonl)."""
        return self.current.records if self.slot is not None and self.slot.iteration == 0 else []
