"""--method dpo: preference pairs against a reference model (engine/dpo.py has the loss; train/reference.py the
reference pass, built by setup as the spec asks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fsdp_opt.config.methods.dpo import DPO
from fsdp_opt.data.pairs import Pairs, pairs_from_rows
from fsdp_opt.engine.dpo import PairLoss, evaluate_pairs
from fsdp_opt.train.methods.base import AgainstReference, Method, RunParts, SequenceInput


class Dpo(Method):
    spec = DPO

    def sequences(self, made: SequenceInput) -> Pairs:
        return pairs_from_rows(made.rows, made.spec, made.tokenizer, made.packing)

    def loss(self, parts: RunParts) -> PairLoss:
        reference = parts.components.reference.found[0].for_pairs(parts.sequences)
        return PairLoss(parts.sequences, reference, self.settings.beta, parts.head, parts.env.device)

    def scorer(self, parts: RunParts) -> HeldOutPairs:
        reference = parts.components.reference
        return HeldOutPairs(
            reference.name,
            parts.batch_size,
            parts.env,
            pairs=parts.held_out,
            reference=reference.found[1].for_pairs(parts.held_out),
            beta=self.settings.beta,
        )


@dataclass
class HeldOutPairs(AgainstReference):
    """The held-out pairs' DPO loss, rewards and accuracy against the reference's log-probabilities."""

    pairs: Pairs
    reference: torch.Tensor
    beta: float
    logged = ("loss", "rewards_chosen", "rewards_rejected", "margin", "accuracy")

    def score(self, model: Any) -> dict[str, Any]:  # noqa: ANN401
        return evaluate_pairs(model, self.pairs, self.reference, self.beta, self.batch_size, self.env)

    def line(self, result: dict[str, Any]) -> str:
        return (
            f"DPO loss {result['loss']:.4f}, accuracy {result['accuracy']:.1%}, margin {result['margin']:.4f} "
            f"({result['pairs']:,} pairs)"
        )

    def what(self) -> str:
        return f"{len(self.pairs)} preference pairs {self.against()}, the loss on their answers"

    def table(self, results: dict[str, Any]) -> list[str]:
        lines = [
            f"Held-out preference pairs {results['rows']} of `{results['dataset']}` ({results['models'][0]['pairs']:,} "
            f"pairs), {self.against()} (beta {self.beta:g}):",
            "",
            "| model | DPO loss | accuracy | reward margin | chosen reward | rejected reward |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        return lines + [
            f"| {r['name']} | {r['loss']:.4f} | {r['accuracy']:.1%} | {r['margin']:.4f} | "
            f"{r['rewards_chosen']:.4f} | {r['rewards_rejected']:.4f} |"
            for r in results["models"]
        ]
