"""--method grpo: Group Relative Policy Optimization on prompt rows (TRL 1.16's GRPOTrainer loss and defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_opt.base import ConfigError
from fsdp_opt.config.methods.base import (
    IN_GROUPS,
    GroupFlags,
    MethodSpec,
    method_flag,
)

GRPO_LOSSES = ("dapo", "grpo", "dr_grpo", "bnpo")


@dataclass
class GrpoFlags(GroupFlags):
    loss_type: str = method_flag(
        "dapo",
        "What the step's summed token losses are divided by. dapo: the step's completion tokens, all ranks; grpo: each "
        "completion's own tokens (a mean per completion), then the completions; dr_grpo: completions x "
        "--max_completion_length; bnpo: each micro-batch's completion tokens.",
        choices=GRPO_LOSSES,
    )
    scale_rewards: str = method_flag(
        "group",
        "An advantage is its reward less its group's mean, divided by the std of its group (group), of the step's "
        "rewards (batch), or by nothing (none); plus 1e-4.",
        choices=("group", "batch", "none"),
    )
    delta: float | None = method_flag(
        None,
        "The two-sided clip's upper bound on the probability ratio (TRL's delta, INTELLECT-2; off by default); above "
        "1 + --epsilon_high.",
    )
    importance_sampling_level: str = method_flag(
        "token",
        "The probability ratio per token (token), or per completion (sequence: the exp of the mean of its tokens' "
        "log-ratios, GSPO).",
        choices=("token", "sequence"),
    )

    def check(self) -> None:
        super().check()
        if self.loss_type not in GRPO_LOSSES:
            raise ConfigError(f"--loss_type {self.loss_type}: not for --method grpo (one of {', '.join(GRPO_LOSSES)})")
        if self.delta is not None and not self.delta > 1 + self.clip_high:
            raise ConfigError(
                f"--delta {self.delta}: must be above 1 + --epsilon_high ({1 + self.clip_high:g}): it bounds the ratio "
                "from above where the clip does not"
            )

    def describe(self) -> str:
        ref = f"beta {self.beta:g}" if self.uses_reference else "beta 0 (no reference model)"
        return f"{self.num_generations} completions per prompt, loss {self.loss_type}, {ref}"


GRPO = MethodSpec(
    name="grpo",
    flags=GrpoFlags,
    summary="grpo: Group Relative Policy Optimization on prompt rows: --num_generations completions of each prompt, "
    "sampled from the policy, scored by --reward, each pushed up or down by its reward against its group's (TRL's "
    "loss).",
    **IN_GROUPS,
)
