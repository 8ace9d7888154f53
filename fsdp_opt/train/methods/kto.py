"""--method kto: rows labelled desirable or not, each completion against a reference model and a KL estimate
(engine/kto.py has the loss; data/unpaired.py the items and their mismatched sequences; train/reference.py the
reference pass, DPO's, built by setup as the spec asks).

The reference scores, before training, every item's own sequence and every mismatched one the session's micro-batches
will read (data/unpaired.py `reference_units`: they follow from the layout and the epochs the session trains); a
resumed session whose reference and micro-batches are the checkpoint's reads them from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fsdp_opt.config.methods.kto import KTO
from fsdp_opt.data.unpaired import Unpaired, items_from_rows
from fsdp_opt.engine.kto import UnpairedLoss, evaluate_items
from fsdp_opt.train.methods.base import AgainstReference, Method, RunParts, SequenceInput


class Kto(Method):
    spec = KTO

    def sequences(self, made: SequenceInput) -> Unpaired:
        return items_from_rows(made.rows, made.spec, made.tokenizer, made.packing)

    def loss(self, parts: RunParts) -> UnpairedLoss:
        reference = parts.components.reference
        by_pair = by_unit(reference.units, reference.found[0])
        own = torch.tensor([by_pair[(i, i)] for i in range(len(parts.sequences))])
        mismatched = {p: v for p, v in by_pair.items() if p[0] != p[1]}
        return UnpairedLoss(parts.sequences, own, mismatched, self.settings, parts.head, parts.env)

    def scorer(self, parts: RunParts) -> HeldOutItems:
        reference = parts.components.reference
        held = by_unit(reference.held, reference.found[1])
        return HeldOutItems(
            reference.name, parts.batch_size, parts.env, items=parts.held_out, reference=held, settings=self.settings
        )


def by_unit(units, found) -> dict[tuple[int, int], float]:  # noqa: ANN001
    """A reference's log-probabilities of scored units (data/unpaired.py Scored), by (prompt item, completion item)."""
    return dict(zip(units.pairs, found.for_pairs(units).tolist()))


@dataclass
class HeldOutItems(AgainstReference):
    """The held-out items' KTO loss, rewards and KL estimate against the reference's log-probabilities, each
    micro-batch's KL estimate as in training."""

    items: Unpaired
    reference: dict[tuple[int, int], float]
    settings: Any
    logged = ("loss", "rewards_chosen", "rewards_rejected", "margin", "kl")

    def score(self, model: Any) -> dict[str, Any]:  # noqa: ANN401
        settings = self.settings
        return evaluate_items(
            model,
            self.items,
            self.reference,
            settings.beta,
            settings.loss_type,
            settings.weights,
            self.batch_size,
            self.env,
        )

    def line(self, result: dict[str, Any]) -> str:
        return (
            f"KTO loss {result['loss']:.4f}, reward desirable {shown(result['rewards_chosen'])}, undesirable "
            f"{shown(result['rewards_rejected'])}, margin {shown(result['margin'])}, KL {result['kl']:.4f} "
            f"({result['items']:,} items)"
        )

    def what(self) -> str:
        return f"{len(self.items)} items {self.against()}, each micro-batch's KL estimate as in training"

    def table(self, results: dict[str, Any]) -> list[str]:
        lines = [
            f"Held-out items {results['rows']} of `{results['dataset']}` ({results['models'][0]['items']:,} items), "
            f"{self.against()} (beta {self.settings.beta:g}):",
            "",
            "| model | KTO loss | reward margin | desirable reward | undesirable reward | KL |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        return lines + [
            f"| {r['name']} | {r['loss']:.4f} | {shown(r['margin'])} | {shown(r['rewards_chosen'])} | "
            f"{shown(r['rewards_rejected'])} | {r['kl']:.4f} |"
            for r in results["models"]
        ]


def shown(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
