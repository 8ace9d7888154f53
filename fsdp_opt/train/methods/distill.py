"""--method distill: on-policy distillation. Each step samples a completion of each prompt from the model (the
sampler GRPO's steps use, not scored), and pulls the model's next-token distributions on those completions toward the
teacher's, a model setup keeps beside (engine/distill.py has the loss)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fsdp_opt.config.methods.distill import DISTILL
from fsdp_opt.data.prompts import Prompts
from fsdp_opt.engine.distill import DistillLoss
from fsdp_opt.runtime.distributed import DistEnv
from fsdp_opt.train.methods.base import RunParts
from fsdp_opt.train.methods.sampling import SamplingMethod


class Distill(SamplingMethod):
    spec = DISTILL

    def loss(self, parts: RunParts) -> DistillLoss:
        sampler = self.sampler(parts, parts.sequences)
        return DistillLoss(sampler, parts.components.beside, self.settings.beta, parts.env.device)

    def scorer(self, parts: RunParts) -> HeldOutDivergence:
        return HeldOutDivergence(self.loss(parts), parts.held_out, parts.batch_size, parts.env)


@dataclass
class HeldOutDivergence:
    """One greedy completion of each held-out prompt: the mean divergence per completion token from the teacher."""

    loss: DistillLoss
    prompts: Prompts
    batch_size: int
    env: DistEnv
    logged = ("divergence", "entropy")

    def score(self, model: Any) -> dict[str, Any]:  # noqa: ANN401
        return self.loss.held_out(model, self.prompts, self.env, self.batch_size)

    def line(self, result: dict[str, Any]) -> str:
        return (
            f"divergence from the teacher {result['divergence']:.4f} per token of a greedy completion of each of "
            f"{result['prompts']} prompts ({result['tokens']:,} tokens)"
        )

    def what(self) -> str:
        return f"{len(self.prompts)} prompts, one greedy completion each, against the teacher"

    def table(self, results: dict[str, Any]) -> list[str]:
        lines = [
            f"Held-out prompts {results['rows']} of `{results['dataset']}` ({results['models'][0]['prompts']:,} "
            "prompts), one greedy completion each, against the teacher:",
            "",
            "| model | divergence per token | entropy |",
            "| --- | --- | --- |",
        ]
        return lines + [f"| {r['name']} | {r['divergence']:.4f} | {r['entropy']:.4f} |" for r in results["models"]]
