"""--method grpo: completions sampled from the policy for prompt rows, scored by reward functions, each pushed up or
down against its group (engine/grpo.py has the loss; engine/rollout.py the sampling and scoring)."""

from __future__ import annotations

from fsdp_opt.config.methods.grpo import GRPO
from fsdp_opt.engine.groups import GroupSettings
from fsdp_opt.train.methods.base import RunParts
from fsdp_opt.train.methods.sampling import GroupMethod


class Grpo(GroupMethod):
    spec = GRPO

    def group_settings(self, parts: RunParts) -> GroupSettings:
        settings = self.settings
        return GroupSettings(
            **self.common(parts),
            loss_type=settings.loss_type,
            scale_rewards=settings.scale_rewards,
            delta=settings.delta,
            level=settings.importance_sampling_level,
        )
