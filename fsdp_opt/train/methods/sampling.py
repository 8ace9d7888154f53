"""What the methods that sample completions share (GRPO, RLOO, distillation): prompt rows as their sequences, the
steps over prompts (a generation may feed several), and the sampler their losses draw completions with. GRPO and RLOO
score groups of completions (`GroupMethod`: the rewards and advantages on top); distillation compares each with a
teacher (train/methods/distill.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fsdp_opt.data.prompts import PromptPlan, Prompts, generation_slices, prompts_from_rows
from fsdp_opt.engine.groups import GroupSettings
from fsdp_opt.engine.grpo import GroupLoss
from fsdp_opt.engine.rollout import Sampler, held_out_rewards
from fsdp_opt.engine.scoring import Scoring
from fsdp_opt.runtime.distributed import DistEnv
from fsdp_opt.train.methods.base import Method, PlanInput, RunParts, SequenceInput


class SamplingMethod(Method):
    """A method whose steps sample completions of prompt rows."""

    def sequences(self, made: SequenceInput) -> Prompts:
        return prompts_from_rows(
            made.rows, made.tokenizer, made.packing, max_completion_length=self.settings.max_completion_length
        )

    def plan(self, sequences: Prompts, layout: PlanInput) -> PromptPlan:
        settings = self.settings
        return PromptPlan(
            sequences,
            **vars(layout),
            generations=settings.completions_per_prompt,
            slices=generation_slices(getattr(settings, "steps_per_generation", None), layout.accum_steps),
            iterations=getattr(settings, "num_iterations", 1),
        )

    def sampler(self, parts: RunParts, prompts: Prompts, scoring: Scoring | None = None) -> Sampler:
        """What the run's completions of `prompts` are sampled (and scored) with."""
        components = parts.components
        return Sampler(
            components.decoding,
            prompts,
            parts.tokenizer,
            components.decoder,
            parts.head,
            generations=self.settings.completions_per_prompt,
            mask_truncated=getattr(self.settings, "mask_truncated_completions", False),
            scoring=scoring,
        )


class GroupMethod(SamplingMethod):
    """A method that scores a group of completions of each prompt with reward functions and pushes each up or down
    against its group (GRPO, RLOO): the step's loss is engine/grpo.py's, at the method's settings."""

    def group_settings(self, parts: RunParts) -> GroupSettings:
        """The flags as a step reads them."""
        raise NotImplementedError

    def loss(self, parts: RunParts) -> GroupLoss:
        settings = self.group_settings(parts)
        scoring = Scoring(settings, parts.components.beside if self.settings.uses_reference else None)
        sampler = self.sampler(parts, parts.sequences, scoring)
        return GroupLoss(settings, sampler, parts.env.device, restored=parts.components.restored)

    def scorer(self, parts: RunParts) -> HeldOutRewards:
        settings = self.group_settings(parts)
        return HeldOutRewards(self.sampler(parts, parts.held_out, Scoring(settings)), parts.env)

    def common(self, parts: RunParts) -> dict[str, Any]:
        """The group settings both methods take from their flags and components alike."""
        settings, components = self.settings, parts.components
        return dict(
            **vars(components.decoding),
            generations=settings.num_generations,
            epsilon=settings.epsilon,
            epsilon_high=settings.clip_high,
            beta=settings.beta,
            mask_truncated=settings.mask_truncated_completions,
            rewards=components.rewards,
            weights=components.weights,
        )


@dataclass
class HeldOutRewards:
    """One greedy completion of each held-out prompt, scored: the mean reward, in total and per function."""

    sampler: Sampler
    env: DistEnv

    @property
    def logged(self) -> tuple[str, ...]:
        return ("reward", *(f"reward_{r.label}" for r in self.sampler.scoring.settings.rewards))

    def score(self, model: Any) -> dict[str, Any]:  # noqa: ANN401
        """The held-out reward, and (under `samples`) the completions it scored, every rank's, in row order."""
        return held_out_rewards(model, self.sampler, self.env)

    def line(self, result: dict[str, Any]) -> str:
        per = ", ".join(f"{k[len('reward_') :]} {v:.3f}" for k, v in result.items() if k.startswith("reward_"))
        return (
            f"mean reward {result['reward']:.4f} ({per}) of a greedy completion of each of {result['prompts']} prompts"
        )

    def what(self) -> str:
        sampler = self.sampler
        return (
            f"{len(sampler.prompts)} prompts, one greedy completion each of up to "
            f"{sampler.decoding.sampling.max_new_tokens} tokens, scored by "
            f"{', '.join(r.label for r in sampler.scoring.settings.rewards)}"
        )

    def table(self, results: dict[str, Any]) -> list[str]:
        names = [k for k in results["models"][0] if k.startswith("reward_")]
        lines = [
            f"Held-out prompts {results['rows']} of `{results['dataset']}` ({results['models'][0]['prompts']:,} "
            "prompts), one greedy completion each:",
            "",
            "| model | mean reward | " + " | ".join(n[len("reward_") :] for n in names) + " |",
            "| --- | --- |" + " --- |" * len(names),
        ]
        return lines + [
            f"| {r['name']} | {r['reward']:.4f} | " + " | ".join(f"{r[n]:.4f}" for n in names) + " |"
            for r in results["models"]
        ]
