"""On-policy distillation (--method distill): a step's prepare phase samples one completion of each of its prompts from
the model (the same sampler as GRPO's: engine/rollout.py, each completion's draws keyed by the seed, the step, its row), then each micro-batch of completions runs the model and the teacher, and every completion token's
next-token distributions are compared. TRL 1.16's DistillationTrainer loss:

- the completions are engine/rollout.py's, as GRPO samples them, one of each prompt and not scored;
- the distributions are the softmax of each model's logits divided by --temperature, fp32;
- per completion token, the generalized Jensen-Shannon divergence of --beta: with the mixture m = (1 - beta) p_model +
  beta p_teacher, beta KL(p_teacher || m) + (1 - beta) KL(p_model || m); at beta 0 the forward KL(p_teacher ||
  p_model), at beta 1 the reverse KL(p_model || p_teacher) (those two limits in closed form: the mixture's would be 0);
- the tokens are a completion's own, up to and including its end; the loss is their sum over the step (all ranks, all
  micro-batches) divided by their count. The gradient reaches the model only: the teacher runs without it.

Every rank runs as many micro-batches (fillers where it has fewer completions) and the teacher's forward in each, so
the teacher's sharded collectives line up.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_opt.data.blocks import StepBatch
from fsdp_opt.data.prompts import Prompts
from fsdp_opt.engine.groups import reduce_sum
from fsdp_opt.engine.loss import HeadLoss, target_logits
from fsdp_opt.engine.microbatches import MicroLoss, StepLoss
from fsdp_opt.engine.rollout import Generation, Sampler, Slice, held_out, micro_batches, pack_members, sample_generation
from fsdp_opt.runtime.distributed import DistEnv


def divergence(
    student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] generalized JSD of `beta` between the model's and the teacher's next-token distributions, from their [n,
    vocabulary] logits, and [n] the model's entropy (no gradient); fp32."""
    s = F.log_softmax(student.float() / temperature, dim=-1)
    t = F.log_softmax(teacher.float() / temperature, dim=-1)
    if beta == 0.0:
        d = (t.exp() * (t - s)).sum(-1)
    elif beta == 1.0:
        d = (s.exp() * (s - t)).sum(-1)
    else:
        m = torch.logaddexp(s + math.log(1 - beta), t + math.log(beta))
        d = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
    with torch.no_grad():
        entropy = -(s.exp() * s).sum(-1)
    return d, entropy


@dataclass
class Models:
    """The trained model and the teacher, each with its output layer run at the completion tokens only where the
    model allows it (engine/loss.py HeadLoss; None: its whole logits, then those rows)."""

    model: nn.Module
    head: HeadLoss | None
    teacher: nn.Module
    teacher_head: HeadLoss | None


def micro_divergence(
    m: Models, batch: dict[str, torch.Tensor], beta: float, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One micro-batch's summed divergence over its completion tokens (with the model's gradient), their summed
    entropy, and the model's logits there (kept alive through the backward). A filler micro-batch has no completion
    token: its sums are 0, its backward (and every collective, the teacher's too) the same as every rank's."""
    student = target_logits(m.model, m.head, batch)
    with torch.no_grad():
        taught = target_logits(m.teacher, m.teacher_head, batch)
    d, entropy = divergence(student, taught, beta, temperature)
    return d.sum(), entropy.sum(), student


class DistillLoss(StepLoss):
    """--method distill's step (engine/step.py): the step's completions sampled (`sampler`: one of each prompt, not
    scored), then each micro-batch's divergence from `teacher` (sharded, frozen), the loss a mean over the step's
    completion tokens."""

    names = ("loss", "entropy")

    def __init__(self, sampler: Sampler, teacher: nn.Module, beta: float, device: torch.device) -> None:
        self.sampler, self.beta, self.device = sampler, beta, device
        self.models = Models(None, sampler.head, teacher, HeadLoss.for_run(teacher, 0))
        self.current: Slice | None = None
        self.generation: Generation | None = None

    @property
    def temperature(self) -> float:
        return self.sampler.decoding.sampling.temperature

    def prepare(self, run, step: StepBatch) -> None:  # noqa: ANN001
        """The step's completions, sampled from the model as it is now."""
        self.generation = sample_generation(run, step, self.sampler)
        self.current = self.generation.slices[0]

    def micro_batches(self, step: StepBatch) -> list[list[int]]:
        return self.current.micro

    def denominator(self, step: StepBatch) -> float:
        return self.current.totals["tokens"]

    def loss(self, model: nn.Module, members: list[int]) -> MicroLoss:
        batch, _ = pack_members(self.current, members, self.sampler.prompts, self.device)
        models = dataclasses.replace(self.models, model=model)
        total, entropy, logits = micro_divergence(models, batch, self.beta, self.temperature)
        return MicroLoss(total, entropy.detach().reshape(1), logits)

    def record(self, sums: dict[str, float], step: StepBatch, seconds: float) -> dict[str, Any]:
        t = self.current.totals
        completions = max(1.0, t["completions"])
        return {
            "tokens": int(t["tokens"]),
            "tokens_seen": int(t["seen"]),
            "completions": int(t["completions"]),
            "completion_length": t["generated"] / completions,
            "completion_length_max": int(t["length_max"]),
            "truncated": t["truncated"] / completions,
            "entropy": sums["entropy"] / max(1.0, t["tokens"]),
            "generation_share": min(1.0, t["generation_seconds"] / seconds) if seconds > 0 else 0.0,
            "generated_tokens_per_second": t["generated"] / max(1e-9, t["generation_seconds"]),
        }

    def completions(self) -> list[dict[str, Any]]:
        return self.current.records

    @torch.no_grad()
    def held_out(self, model: nn.Module, prompts: Prompts, env: DistEnv, batch_size: int) -> dict[str, Any]:
        """One greedy completion of each held-out prompt (this rank's share: every world_size-th), and the mean
        divergence per completion token from the teacher over them all, in eval mode."""
        was = model.training
        model.eval()
        sampler = dataclasses.replace(self.sampler, prompts=prompts)
        try:
            made = held_out(model, prompts, sampler, env)
            micro = micro_batches(made.sequences, batch_size, prompts, env)
            models = dataclasses.replace(self.models, model=model)
            local = torch.zeros(3, dtype=torch.float64, device=env.device)
            for members in micro:
                batch, _ = prompts.layout.pack(
                    [made.sequences[i] for i in members], [made.targets[i] for i in members], env.device
                )
                total, entropy, _ = micro_divergence(models, batch, self.beta, self.temperature)
                local += torch.stack(
                    [total, entropy, total.new_tensor(float(sum(sum(made.targets[i]) for i in members)))]
                ).double()
        finally:
            model.train(was)
        summed = reduce_sum(local, env)
        tokens = max(1.0, float(summed[2]))
        return {
            "divergence": float(summed[0]) / tokens,
            "entropy": float(summed[1]) / tokens,
            "prompts": len(prompts),
            "tokens": int(summed[2]),
        }
