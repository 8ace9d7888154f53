"""--method sft: the next-token loss on the targets of --train_on, over blocks of whole rows."""

from __future__ import annotations

import time
from typing import Any

from fsdp_opt.config.parse import Config
from fsdp_opt.data.blocks import StepPlan, rows_to_blocks
from fsdp_opt.data.formats import Rows, RowSpec
from fsdp_opt.engine.evaluation import evaluate_loss
from fsdp_opt.engine.step import TokenLoss
from fsdp_opt.runtime.distributed import DistEnv, print0
from fsdp_opt.train.methods.base import Method
from fsdp_opt.train.session import Session


class Sft(Method):
    eval_logged = ("loss", "perplexity")

    def sequences(
        self,
        rows: Rows,
        spec: RowSpec,
        tokenizer,
        *,
        train_on: str,
        max_length: int,
        packing: str,
        attention: str,
        pattern,
    ) -> Any:  # noqa: ANN001
        """Blocks of tokens."""
        return rows_to_blocks(
            rows,
            spec,
            tokenizer,
            train_on=train_on,
            max_length=max_length,
            packing=packing,
            attention=attention,
            pattern=pattern,
        )

    def eval_packing(self, packing: str) -> str:
        """docs and pad give the same per-row losses; docs in fewer blocks."""
        return "concat" if packing == "concat" else "docs"

    def plan(self, config: Config, env: DistEnv, sequences: Any, batch_size: int, accum_steps: int) -> StepPlan:
        return StepPlan(
            sequences,
            batch_size=batch_size,
            accum_steps=accum_steps,
            rank=env.rank,
            world_size=env.world_size,
            seed=config.train.seed,
        )

    def describe(self, sequences: Any, packing_words: str, max_length: int) -> str:
        return f"{len(sequences)} {packing_words} of {max_length} tokens"

    def after_model(self, s: Session) -> None:
        s.loss = TokenLoss()

    def evaluate(self, s: Session) -> dict[str, Any]:
        started = time.perf_counter()
        result = evaluate_loss(s.model, s.eval_blocks, s.layout.batch_size, s.env)
        result["seconds"] = round(time.perf_counter() - started, 3)
        print0(
            f"eval at step {s.state.global_step}: loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} "
            f"on rows {s.eval_label} ({result['tokens']:,} tokens, {result['seconds']:.1f} s)"
        )
        return result

    def scored_what(self, sequences: Any, packing: str, max_length: int, train_on: str) -> str:
        return (
            f"{len(sequences)} blocks of {max_length} tokens ({packing}), loss on "
            f"{'every token' if train_on == 'all' else 'the answers'}"
        )

    def score(self, model, held, batch_size: int, env: DistEnv) -> dict[str, Any]:  # noqa: ANN001
        return evaluate_loss(model, held, batch_size, env)

    def score_line(self, result: dict[str, Any]) -> str:
        return f"eval loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}"

    @staticmethod
    def table(results: dict[str, Any]) -> list[str]:
        lines = [
            f"Held-out rows {results['rows']} of `{results['dataset']}` ({results['models'][0]['tokens']:,} target "
            "tokens):",
            "",
            "| model | eval loss | perplexity |",
            "| --- | --- | --- |",
        ]
        return lines + [f"| {r['name']} | {r['loss']:.4f} | {r['perplexity']:.2f} |" for r in results["models"]]
