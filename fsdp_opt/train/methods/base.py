"""What a training method is to the run: one object per run, made from the flags, that the run and the step call at
fixed points without asking which method it is.

- rows -> sequences: the row formats it trains on (checked against the columns), what a slice's rows become (blocks,
  preference pairs, prompts), the order of a slice's steps;
- setup: the model's config before it is built (dropout), the LoRA settings, work before the trainable model exists
  (DPO's reference pass) and after (the adapters-off reference, a reference kept beside the policy);
- the step: an engine StepLoss (engine/step.py), whose prepare phase and micro-batch loss train_step runs;
- what is logged: its metrics fields beyond the common ones (tracking/metrics), and those the progress bar shows;
- what is kept: its state in every checkpoint (under its own key);
- evaluation at a save, the summary's line, and the chain's rule for a further range in the same session.

SFT is this base class; DPO and GRPO override what they change.
"""

from __future__ import annotations

import time
from typing import Any

from fsdp_opt.base import ConfigError
from fsdp_opt.config.parse import Config
from fsdp_opt.config.specs import METHOD_SPECS
from fsdp_opt.data.blocks import StepPlan, rows_to_blocks
from fsdp_opt.data.formats import Rows, RowSpec
from fsdp_opt.engine.evaluation import evaluate_loss
from fsdp_opt.engine.step import StepLoss, TokenLoss
from fsdp_opt.runtime.distributed import DistEnv, print0


class Method:
    """--method sft, and what every method does unless it says otherwise."""

    shown: tuple[str, ...] = ()  # fields the progress bar shows beside the loss
    state_key: str | None = None  # where its state goes in a checkpoint's payload

    def __init__(self, config: Config) -> None:
        self.config = config
        self.name = config.method.method
        self.spec = config.method.spec

    @property
    def fields(self) -> tuple[str, ...]:
        """metrics.jsonl fields beyond METRICS_FIELDS (tracking/metrics): the spec's."""
        return self.spec.fields

    def check(self) -> None:
        """What the method's flags name is there (every rank): before anything is taken or built."""

    # ------------------------------------------------------------ rows -> sequences

    def check_rows(self, spec: RowSpec) -> None:
        """The rows' format (found from the columns) against the formats this method trains on: one line if not. A
        mixture's sources may differ in format: each must be one of them."""
        if all(p.format in self.spec.rows for p in spec.parts or (spec,)):
            return
        owner = next((m for m, t in METHOD_SPECS.items() if spec.format in t.rows), None)
        then = f": train them with --method {owner}" if owner else f"; it trains on {self.spec.what}"
        raise ConfigError(f"--method {self.name}: the rows are {words(spec)}{then}")

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
        """A slice's checked rows as what its steps read (here: blocks of tokens)."""
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
        """How the held-out rows fill their blocks: docs and pad give the same per-row losses; docs in fewer."""
        return "concat" if packing == "concat" else "docs"

    def plan(self, config: Config, env: DistEnv, sequences: Any, batch_size: int, accum_steps: int) -> StepPlan:
        """The global batches of the slice's epochs, and this rank's share of each."""
        return StepPlan(
            sequences,
            batch_size=batch_size,
            accum_steps=accum_steps,
            rank=env.rank,
            world_size=env.world_size,
            seed=config.train.seed,
        )

    def describe(self, sequences: Any, packing_words: str, max_length: int) -> str:
        """What the slice became, for the summary's data line."""
        return f"{len(sequences)} {packing_words} of {max_length} tokens"

    # ------------------------------------------------------------ setup

    def model_config(self, model_config) -> None:  # noqa: ANN001
        """The model's config before anything is built (a method that compares forwards of one model turns dropout
        off)."""

    def lora(self, lc):  # noqa: ANN001, ANN201
        """The LoRA settings the run builds its adapters with."""
        return lc

    def before_model(
        self, session_inputs: Any, env: DistEnv, payload: dict[str, Any] | None, precision: str, tokenizer, layout
    ) -> None:  # noqa: ANN001
        """Work before the trainable model exists (every rank), once the layout (planner/layout.py: the micro-batch,
        the accumulation) is decided."""

    def after_model(self, s) -> None:  # noqa: ANN001 - a train.session.Session
        """Work once the model is built and the session made, before a resumed state is loaded: the step's loss."""
        s.loss = TokenLoss()

    # ------------------------------------------------------------ the run

    def summary(self, s) -> str:  # noqa: ANN001
        return self.name

    def state(self) -> dict[str, Any] | None:
        """What checkpoints keep of the method (under `state_key`)."""
        return None

    def evaluate(self, s) -> dict[str, Any]:  # noqa: ANN001
        """--eval_rows at a save (every rank): the result, which rank 0 prints and logs."""
        started = time.perf_counter()
        result = evaluate_loss(s.model, s.eval_blocks, s.layout.batch_size, s.env)
        result["seconds"] = round(time.perf_counter() - started, 3)
        print0(
            f"eval at step {s.state.global_step}: loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} "
            f"on rows {s.eval_label} ({result['tokens']:,} tokens, {result['seconds']:.1f} s)"
        )
        return result

    eval_logged: tuple[str, ...] = ("loss", "perplexity")  # what W&B gets of an evaluation

    def after_step(self, s, record: dict[str, Any]) -> None:  # noqa: ANN001
        """After each optimizer step (every rank), once its record is written."""

    def at_save(self, s) -> None:  # noqa: ANN001
        """At each save (every rank), before the checkpoint is gathered."""

    # ------------------------------------------------------------ python -m fsdp_opt.evaluate

    def before_scoring(
        self,
        held,
        env: DistEnv,
        precision: str,
        tokenizer,
        batch_size: int,
        model_name: str,
        reference_name: str | None,
        strategy: str,
        seed: int,
        model_config=None,
    ) -> str | None:  # noqa: ANN001
        """Before the models are scored on the held-out sequences: what they are scored against (the name), if any."""
        return None

    def scored_what(self, sequences: Any, packing: str, max_length: int, train_on: str) -> str:
        """What `python -m fsdp_opt.evaluate` scores the models on, in words."""
        return (
            f"{len(sequences)} blocks of {max_length} tokens ({packing}), loss on "
            f"{'every token' if train_on == 'all' else 'the answers'}"
        )

    def score(self, model, held, batch_size: int, env: DistEnv) -> dict[str, Any]:  # noqa: ANN001
        """One model's result on the held-out sequences (every rank)."""
        return evaluate_loss(model, held, batch_size, env)

    def score_line(self, result: dict[str, Any]) -> str:
        return f"eval loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}"

    @staticmethod
    def table(results: dict[str, Any]) -> list[str]:
        """The report's table of the models scored."""
        lines = [
            f"Held-out rows {results['rows']} of `{results['dataset']}` ({results['models'][0]['tokens']:,} target "
            "tokens):",
            "",
            "| model | eval loss | perplexity |",
            "| --- | --- | --- |",
        ]
        return lines + [f"| {r['name']} | {r['loss']:.4f} | {r['perplexity']:.2f} |" for r in results["models"]]

    def further_range(self, s) -> str | None:  # noqa: ANN001
        """Why the session cannot start the chain's next range itself (None: it can)."""
        return None

    def switch_range(self, s, data) -> None:  # noqa: ANN001
        """A further range in the same session: what the method needs of its rows (before its first step)."""


def words(spec: RowSpec) -> str:
    """A row format in words, with its columns."""
    if spec.format == "mixed":
        kinds = dict.fromkeys(words(p).split(" (")[0] for p in spec.parts)
        return f"a mixture of {' and '.join(kinds)} (column {', '.join(spec.columns)})"
    kind = {
        "text": "text",
        "messages": "conversations",
        "prompt_completion": "prompt/completion pairs",
        "preference": "preference pairs",
        "prompt": "prompts",
        "unpaired": "unpaired rows",
    }[spec.format]
    return f"{kind} (column {', '.join(spec.columns)})"


__all__ = ["Method", "StepLoss", "words"]
