"""--method sft: the next-token loss on the targets of --train_on, over blocks of whole rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fsdp_opt.config.methods.sft import SFT
from fsdp_opt.data.blocks import Blocks, StepPlan, rows_to_blocks
from fsdp_opt.engine.evaluation import evaluate_loss
from fsdp_opt.engine.loss import TokenLoss
from fsdp_opt.runtime.distributed import DistEnv
from fsdp_opt.train.methods.base import Method, PlanInput, RunParts, SequenceInput


class Sft(Method):
    spec = SFT

    def sequences(self, made: SequenceInput) -> Blocks:
        """Blocks of tokens."""
        p = made.packing
        return rows_to_blocks(
            made.rows,
            made.spec,
            made.tokenizer,
            train_on=made.train_on,
            max_length=p.max_length,
            packing=p.packing,
            attention=p.attention,
            pattern=p.pattern,
        )

    def plan(self, sequences: Blocks, layout: PlanInput) -> StepPlan:
        return StepPlan(sequences, **vars(layout))

    def loss(self, parts: RunParts) -> TokenLoss:
        return TokenLoss(parts.sequences, parts.head, parts.env.device)

    def scorer(self, parts: RunParts) -> HeldOutLoss:
        return HeldOutLoss(parts.held_out, parts.batch_size, parts.env)


@dataclass
class HeldOutLoss:
    """The held-out blocks' token-mean loss and perplexity."""

    blocks: Blocks
    batch_size: int
    env: DistEnv
    logged = ("loss", "perplexity")

    def score(self, model: Any) -> dict[str, Any]:  # noqa: ANN401
        return evaluate_loss(model, self.blocks, self.batch_size, self.env)

    def line(self, result: dict[str, Any]) -> str:
        return f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} ({result['tokens']:,} tokens)"

    def what(self) -> str:
        return f"{len(self.blocks)} blocks of {self.blocks.max_length} tokens"

    def table(self, results: dict[str, Any]) -> list[str]:
        lines = [
            f"Held-out rows {results['rows']} of `{results['dataset']}` ({results['models'][0]['tokens']:,} target "
            "tokens):",
            "",
            "| model | eval loss | perplexity |",
            "| --- | --- | --- |",
        ]
        return lines + [f"| {r['name']} | {r['loss']:.4f} | {r['perplexity']:.2f} |" for r in results["models"]]
