"""--method reward: a reward model, a sequence classifier of one label trained on preference pairs (TRL 1.16's
RewardTrainer: engine/pairwise.py has the loss). Each answer of a pair is one whole text with its prompt, as TRL
tokenizes it; the model's head (model/loader.py) is the spec's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fsdp_opt.config.methods.reward import REWARD
from fsdp_opt.data.pairs import Pairs, pairs_from_rows
from fsdp_opt.engine.pairwise import PairScoreLoss, evaluate_scores
from fsdp_opt.runtime.distributed import DistEnv
from fsdp_opt.train.methods.base import Method, RunParts, SequenceInput


class Reward(Method):
    spec = REWARD

    def sequences(self, made: SequenceInput) -> Pairs:
        return pairs_from_rows(made.rows, made.spec, made.tokenizer, made.packing, whole=True)

    def loss(self, parts: RunParts) -> PairScoreLoss:
        return PairScoreLoss(parts.sequences, self.settings.center_rewards_coefficient, parts.env)

    def scorer(self, parts: RunParts) -> HeldOutScores:
        return HeldOutScores(parts.held_out, self.settings.center_rewards_coefficient, parts.batch_size, parts.env)


@dataclass
class HeldOutScores:
    """The held-out pairs' loss, the share the model ranks right, and their scores."""

    pairs: Pairs
    coefficient: float | None
    batch_size: int
    env: DistEnv
    logged = ("loss", "accuracy", "margin", "mean_reward")

    def score(self, model: Any) -> dict[str, Any]:  # noqa: ANN401
        return evaluate_scores(model, self.pairs, self.coefficient, self.batch_size, self.env)

    def line(self, result: dict[str, Any]) -> str:
        return (
            f"reward model loss {result['loss']:.4f}, accuracy {result['accuracy']:.1%}, margin {result['margin']:.4f} "
            f"({result['pairs']:,} pairs)"
        )

    def what(self) -> str:
        return f"{len(self.pairs)} preference pairs, each answer scored"

    def table(self, results: dict[str, Any]) -> list[str]:
        lines = [
            f"Held-out preference pairs {results['rows']} of `{results['dataset']}` ({results['models'][0]['pairs']:,} "
            "pairs), each answer scored:",
            "",
            "| model | loss | accuracy | margin | lowest score | mean score | highest score |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        return lines + [
            f"| {r['name']} | {r['loss']:.4f} | {r['accuracy']:.1%} | {r['margin']:.4f} | {r['min_reward']:.4f} | "
            f"{r['mean_reward']:.4f} | {r['max_reward']:.4f} |"
            for r in results["models"]
        ]
