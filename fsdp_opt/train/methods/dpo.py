"""--method dpo: preference pairs against a reference model (engine/dpo.py has the loss; train/reference.py the
reference pass)."""

from __future__ import annotations

import time
from typing import Any

from fsdp_opt.base import ConfigError
from fsdp_opt.config.parse import Config
from fsdp_opt.data.formats import Rows, RowSpec
from fsdp_opt.data.pairs import PairPlan, pairs_from_rows
from fsdp_opt.engine.dpo import PairLoss, evaluate_pairs
from fsdp_opt.engine.logprobs import Reference
from fsdp_opt.runtime.distributed import DistEnv, print0
from fsdp_opt.train import reference
from fsdp_opt.train.methods.base import Method, words
from fsdp_opt.train.session import Session


class Dpo(Method):
    shown = ("margin", "accuracy")
    state_key = "dpo"
    eval_logged = ("loss", "rewards_chosen", "rewards_rejected", "margin", "accuracy")

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.ref_name: str | None = None
        self.found: list[Reference | None] = [None, None]
        self.eval_reference = None
        self.kept: dict[str, Any] | None = None

    def check_rows(self, spec: RowSpec) -> None:
        if spec.format not in self.spec.rows:
            raise ConfigError(
                f"--method {self.name}: the rows are {words(spec)}, not preference pairs; name the "
                "answers' columns with --chosen_column and --rejected_column"
            )

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
    ):  # noqa: ANN001, ANN201
        return pairs_from_rows(
            rows, spec, tokenizer, max_length=max_length, packing=packing, attention=attention, pattern=pattern
        )

    def eval_packing(self, packing: str) -> str:
        return packing  # a pair's two sequences as in training

    def plan(self, config: Config, env: DistEnv, sequences, batch_size: int, accum_steps: int) -> PairPlan:  # noqa: ANN001
        return PairPlan(
            sequences,
            batch_size=batch_size,
            accum_steps=accum_steps,
            rank=env.rank,
            world_size=env.world_size,
            seed=config.train.seed,
        )

    def describe(self, sequences, packing_words: str, max_length: int) -> str:  # noqa: ANN001
        return f"{len(sequences)} preference pairs (2 sequences each, {packing_words} of {max_length} tokens)"

    def before_model(
        self, data, env: DistEnv, payload: dict[str, Any] | None, precision: str, tokenizer, layout
    ) -> None:  # noqa: ANN001
        """The reference pass, before the trainable model exists (unless the reference is that model)."""
        self.ref_name, self.found = reference.prepare(
            self.config, env, payload, self.state_key, data.blocks, data.eval_blocks, precision, tokenizer
        )

    def after_model(self, s: Session) -> None:
        self._use(
            s, reference.finish(self.ref_name, self.found, s.model, s.env, s.layout.batch_size, s.blocks, s.eval_blocks)
        )

    def _use(self, s: Session, found: list[Reference | None]) -> None:
        s.loss = PairLoss(found[0].for_pairs(s.blocks), self.config.method.beta)
        self.eval_reference = found[1].for_pairs(s.eval_blocks) if s.eval_blocks is not None else None
        self.kept = reference.record(self.ref_name, self.config.method.beta, found)

    def summary(self, s: Session) -> str:
        return f"{self.name}, beta {self.config.method.beta:g}, reference: {self.ref_name}"

    def state(self) -> dict[str, Any] | None:
        return self.kept

    def evaluate(self, s: Session) -> dict[str, Any]:
        """The held-out pairs' loss, rewards and accuracy against the reference."""
        started = time.perf_counter()
        result = evaluate_pairs(
            s.model, s.eval_blocks, self.eval_reference, self.config.method.beta, s.layout.batch_size, s.env
        )
        result["seconds"] = round(time.perf_counter() - started, 3)
        print0(
            f"eval at step {s.state.global_step}: loss {result['loss']:.4f}, accuracy {result['accuracy']:.1%}, "
            f"margin {result['margin']:.4f} on rows {s.eval_label} ({result['pairs']:,} pairs, "
            f"{result['seconds']:.1f} s)"
        )
        return result

    def further_range(self, s: Session) -> str | None:
        if self.ref_name != reference.ADAPTERS_OFF:
            return f"--method {self.name} scores a range with its reference model before the trainable model is built"
        return None

    def switch_range(self, s: Session, data) -> None:  # noqa: ANN001
        """The adapters-off reference of the new range's pairs (the adapters trained so far switched off)."""
        self.ref_name = reference.ADAPTERS_OFF
        self._use(
            s,
            reference.finish(
                reference.ADAPTERS_OFF, [None, None], s.model, s.env, s.layout.batch_size, data.blocks, data.eval_blocks
            ),
        )

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
        """The reference's log-probabilities of the held-out pairs, once, before the models (a LoRA run's
        adapters-off reference is its base)."""
        name = reference_name or model_name
        name = model_name if name == reference.ADAPTERS_OFF else name
        scored = reference.score_model(
            name, env, precision, tokenizer, batch_size, held, policy=model_name, strategy=strategy, seed=seed
        )
        self.eval_reference = scored[0].for_pairs(held)
        return name

    def scored_what(self, sequences, packing: str, max_length: int, train_on: str) -> str:  # noqa: ANN001
        return f"{len(sequences)} preference pairs against the reference, the loss on their answers"

    def score(self, model, held, batch_size: int, env: DistEnv) -> dict[str, Any]:  # noqa: ANN001
        return evaluate_pairs(model, held, self.eval_reference, self.config.method.beta, batch_size, env)

    def score_line(self, result: dict[str, Any]) -> str:
        return f"DPO loss {result['loss']:.4f}, accuracy {result['accuracy']:.1%}, margin {result['margin']:.4f}"

    @staticmethod
    def table(results: dict[str, Any]) -> list[str]:
        lines = [
            f"Held-out preference pairs {results['rows']} of `{results['dataset']}` ({results['models'][0]['pairs']:,} "
            f"pairs), against the reference {results['reference']} (beta {results['beta']:g}):",
            "",
            "| model | DPO loss | accuracy | reward margin | chosen reward | rejected reward |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        return lines + [
            f"| {r['name']} | {r['loss']:.4f} | {r['accuracy']:.1%} | {r['margin']:.4f} | "
            f"{r['rewards_chosen']:.4f} | {r['rewards_rejected']:.4f} |"
            for r in results["models"]
        ]
