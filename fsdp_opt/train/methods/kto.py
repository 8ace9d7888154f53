"""--method kto: rows labelled desirable or not, each completion against a reference model and a KL estimate
(engine/kto.py has the loss; data/unpaired.py the items and their mismatched sequences; train/reference.py the
reference pass, DPO's).

The reference scores, before training, every item's own sequence and every mismatched one the session's micro-batches
will read (they follow from the layout and the epochs the session trains); a resumed session whose reference and
micro-batches are the checkpoint's reads them from there.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fsdp_opt.base import ConfigError
from fsdp_opt.checkpoint.resume import position, slice_key
from fsdp_opt.config.parse import Config
from fsdp_opt.data.formats import Rows, RowSpec
from fsdp_opt.data.pairs import PairPlan
from fsdp_opt.data.unpaired import Scored, Unpaired, held_out_micro_batches, items_from_rows, scored_pairs
from fsdp_opt.engine.kto import UnpairedLoss, evaluate_items
from fsdp_opt.engine.logprobs import Reference
from fsdp_opt.runtime.distributed import DistEnv, broadcast_object, print0
from fsdp_opt.train import reference
from fsdp_opt.train.methods.base import Method, words
from fsdp_opt.train.session import Session


class Kto(Method):
    shown = ("margin", "kl")
    state_key = "kto"
    eval_logged = ("loss", "rewards_chosen", "rewards_rejected", "margin", "kl")

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.ref_name: str | None = None
        self.found: list[Reference | None] = [None, None]
        self.scored: list[Scored | None] = [None, None]
        self.eval_reference: dict[tuple[int, int], float] | None = None
        self.kept: dict[str, Any] | None = None
        self.batch_size = 1

    @property
    def weights(self) -> tuple[float, float]:
        m = self.config.method
        return m.desirable_weight, m.undesirable_weight

    # ------------------------------------------------------------ rows -> sequences

    def check_rows(self, spec: RowSpec) -> None:
        if not all(p.format in self.spec.rows for p in spec.parts or (spec,)):
            raise ConfigError(
                f"--method {self.name}: the rows are {words(spec)}, not unpaired rows; give a prompt, a completion "
                "and a label column of true/false (--data_format unpaired), or preference rows"
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
    ) -> Unpaired:  # noqa: ANN001
        return items_from_rows(
            rows, spec, tokenizer, max_length=max_length, packing=packing, attention=attention, pattern=pattern
        )

    def eval_packing(self, packing: str) -> str:
        return packing  # each held-out micro-batch's KL estimate as training forms it

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
        good = int(sequences.labels.sum())
        return (
            f"{len(sequences)} items ({good} desirable, {len(sequences) - good} undesirable; {packing_words} of "
            f"{max_length} tokens)"
        )

    # ------------------------------------------------------------ setup

    def before_model(
        self, data, env: DistEnv, payload: dict[str, Any] | None, precision: str, tokenizer, layout
    ) -> None:  # noqa: ANN001
        """The reference pass, before the trainable model exists (unless the reference is that model): the items'
        own sequences and the mismatched ones of the micro-batches this session trains, and the held-out ones."""
        self.batch_size = layout.batch_size
        first = broadcast_object(self._first_epoch(data, payload, tokenizer) if env.is_main else None)
        plan = self.plan(self.config, env, data.blocks, layout.batch_size, layout.accum_steps)
        epochs = 1 if self.config.data.range_size is not None else self.config.train.num_epochs
        micro = [m for e in range(first, first + epochs) for m in plan.micro_batches(e)]
        self.scored = [Scored(data.blocks, scored_pairs(data.blocks, micro)), self._held_out(data.eval_blocks)]
        self.ref_name, self.found = reference.prepare(
            self.config, env, payload, self.state_key, *self.scored, precision, tokenizer, layout.batch_size
        )

    def _first_epoch(self, data, payload: dict[str, Any] | None, tokenizer) -> int:  # noqa: ANN001
        """Rank 0: the epoch this session starts in (a checkpoint of the same slice: its own, or the next)."""
        if payload is None:
            return self.config.train.initial_epoch
        here = slice_key(
            self.config, data.end_idx, len(data.blocks), data.spec.key(data.train_on), tokenizer.chat_template
        )
        return position(self.config, payload, here, len(data.blocks))[0].epoch

    def _held_out(self, items: Unpaired | None) -> Scored | None:
        if items is None:
            return None
        return Scored(items, scored_pairs(items, held_out_micro_batches(items, self.batch_size)))

    def after_model(self, s: Session) -> None:
        found = reference.finish(
            self.ref_name, self.found, s.model, s.env, s.layout.batch_size, *self.scored, self.name
        )
        self._use(s, found)

    def _use(self, s: Session, found: list[Reference | None]) -> None:
        m = self.config.method
        train, held = self.scored
        by_pair = dict(zip(train.pairs, found[0].for_pairs(train).tolist()))
        own = torch.tensor([by_pair[(i, i)] for i in range(len(s.blocks))])
        mismatched = {p: v for p, v in by_pair.items() if p[0] != p[1]}
        s.loss = UnpairedLoss(own, mismatched, m.beta, m.loss_type, self.weights)
        self.eval_reference = dict(zip(held.pairs, found[1].for_pairs(held).tolist())) if held is not None else None
        self.kept = reference.record(self.ref_name, m.beta, found)

    def summary(self, s: Session) -> str:
        m = self.config.method
        weights = f", weights {m.desirable_weight:g}/{m.undesirable_weight:g}" if self.weights != (1.0, 1.0) else ""
        return f"{self.name}, loss {m.loss_type}, beta {m.beta:g}{weights}, reference: {self.ref_name}"

    def state(self) -> dict[str, Any] | None:
        return self.kept

    def evaluate(self, s: Session) -> dict[str, Any]:
        """The held-out items' loss, rewards and KL estimate against the reference."""
        m = self.config.method
        started = time.perf_counter()
        result = evaluate_items(
            s.model, s.eval_blocks, self.eval_reference, m.beta, m.loss_type, self.weights, self.batch_size, s.env
        )
        result["seconds"] = round(time.perf_counter() - started, 3)
        print0(
            f"eval at step {s.state.global_step}: {self.score_line(result)} on rows {s.eval_label} ({result['seconds']:.1f} s)"
        )
        return result

    def further_range(self, s: Session) -> str | None:
        if self.ref_name != reference.ADAPTERS_OFF:
            return f"--method {self.name} scores a range with its reference model before the trainable model is built"
        return None

    def switch_range(self, s: Session, data) -> None:  # noqa: ANN001
        """The adapters-off reference of the new range's sequences (the adapters trained so far switched off)."""
        self.ref_name = reference.ADAPTERS_OFF
        micro = s.plan.micro_batches(s.state.epoch)
        self.scored = [Scored(data.blocks, scored_pairs(data.blocks, micro)), self._held_out(data.eval_blocks)]
        found = reference.finish(
            reference.ADAPTERS_OFF, [None, None], s.model, s.env, s.layout.batch_size, *self.scored, self.name
        )
        self._use(s, found)

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
        """The reference's log-probabilities of the held-out sequences, once, before the models (a LoRA run's
        adapters-off reference is its base)."""
        name = reference_name or model_name
        name = model_name if name == reference.ADAPTERS_OFF else name
        self.batch_size = batch_size
        units = self._held_out(held)
        scored = reference.score_model(
            name,
            env,
            precision,
            tokenizer,
            batch_size,
            units,
            policy=model_name,
            strategy=strategy,
            seed=seed,
            label=self.name,
        )
        self.eval_reference = dict(zip(units.pairs, scored[0].for_pairs(units).tolist()))
        return name

    def scored_what(self, sequences, packing: str, max_length: int, train_on: str) -> str:  # noqa: ANN001
        return f"{len(sequences)} items against the reference, each micro-batch's KL estimate as in training"

    def score(self, model, held, batch_size: int, env: DistEnv) -> dict[str, Any]:  # noqa: ANN001
        m = self.config.method
        return evaluate_items(model, held, self.eval_reference, m.beta, m.loss_type, self.weights, batch_size, env)

    def score_line(self, result: dict[str, Any]) -> str:
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
        return (
            f"KTO loss {result['loss']:.4f}, reward desirable {fmt(result['rewards_chosen'])}, undesirable "
            f"{fmt(result['rewards_rejected'])}, margin {fmt(result['margin'])}, KL {result['kl']:.4f} "
            f"({result['items']:,} items)"
        )

    @staticmethod
    def table(results: dict[str, Any]) -> list[str]:
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
        lines = [
            f"Held-out items {results['rows']} of `{results['dataset']}` ({results['models'][0]['items']:,} items), "
            f"against the reference {results['reference']} (beta {results['beta']:g}):",
            "",
            "| model | KTO loss | reward margin | desirable reward | undesirable reward | KL |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        return lines + [
            f"| {r['name']} | {r['loss']:.4f} | {fmt(r['margin'])} | {fmt(r['rewards_chosen'])} | "
            f"{fmt(r['rewards_rejected'])} | {r['kl']:.4f} |"
            for r in results["models"]
        ]
