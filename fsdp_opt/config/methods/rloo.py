"""--method rloo: REINFORCE Leave-One-Out on prompt rows (TRL 1.16's RLOOTrainer loss and defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_opt.config.methods.base import (
    IN_GROUPS,
    GroupFlags,
    MethodSpec,
    method_flag,
)


@dataclass
class RlooFlags(GroupFlags):
    beta: float = method_flag(
        0.05,
        "The weight of the KL penalty in the reward: each completion's reward less beta x the sum over its tokens of "
        "its log-probability ratio to the reference model (0: no reference model).",
    )
    num_generations: int = method_flag(2, "Completions sampled per prompt (G, a group).")
    normalize_advantages: bool = method_flag(
        False, "Each generation's advantages less their mean, divided by their std (plus 1e-4)."
    )

    def describe(self) -> str:
        ref = f"KL in the reward, beta {self.beta:g}" if self.uses_reference else "beta 0 (no reference model)"
        return f"{self.num_generations} completions per prompt, leave-one-out baseline, {ref}"


RLOO = MethodSpec(
    name="rloo",
    flags=RlooFlags,
    summary="rloo: REINFORCE Leave-One-Out on prompt rows: --num_generations completions of each prompt, sampled from "
    "the policy and scored by --reward (less the KL to the reference), each pushed up or down by its reward less the "
    "mean of the others' in its group, through a clipped ratio of its summed log-probabilities (TRL's loss).",
    **IN_GROUPS,
)
