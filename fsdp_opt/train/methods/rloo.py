"""--method rloo: REINFORCE Leave-One-Out (TRL 1.16's RLOOTrainer) through the group loss (engine/grpo.py): each
completion's advantage its reward less the mean of the others' of its group, the KL to the reference in the reward,
the ratio the exp of the completion's summed log-ratio, the loss averaged over the step's completions."""

from __future__ import annotations

from fsdp_opt.config.methods.rloo import RLOO
from fsdp_opt.engine.groups import GroupSettings
from fsdp_opt.train.methods.base import RunParts
from fsdp_opt.train.methods.sampling import GroupMethod


class Rloo(GroupMethod):
    spec = RLOO

    def group_settings(self, parts: RunParts) -> GroupSettings:
        return GroupSettings(
            **self.common(parts),
            loss_type="grpo",  # each completion's loss is the same at each of its tokens: the mean over completions
            scale_rewards="none",
            level="sequence_sum",
            baseline="leave_one_out",
            normalize=self.settings.normalize_advantages,
            kl_in_reward=True,
        )
