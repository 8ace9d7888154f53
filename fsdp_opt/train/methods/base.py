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

`Method` is the interface: what every method must say (abstract: its sequences, its plan, its step's loss, its
held-out evaluation and how `python -m fsdp_opt.evaluate` scores it) and the hooks a method may leave as they are
(no-ops). SFT is one method among them (sft.py). The session a hook receives is train/session.py's `Session`.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from fsdp_opt.base import ConfigError
from fsdp_opt.config.parse import Config
from fsdp_opt.config.specs import METHOD_SPECS
from fsdp_opt.data.formats import Rows, RowSpec
from fsdp_opt.engine.step import StepLoss
from fsdp_opt.model.sources import without_dropout
from fsdp_opt.runtime.distributed import DistEnv, print0

if TYPE_CHECKING:  # the session a hook receives (train/session.py imports nothing of the methods)
    from fsdp_opt.train.session import Session


class Method(ABC):
    """A training method as the run calls it: what each method must say (abstract) and the hooks it may leave."""

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
        return None  # an optional hook: nothing unless a method says otherwise

    # ------------------------------------------------------------ rows -> sequences

    def check_rows(self, spec: RowSpec) -> None:
        """The rows' format (found from the columns) against the formats this method trains on: one line if not. A
        mixture's sources may differ in format: each must be one of them."""
        if all(p.format in self.spec.rows for p in spec.parts or (spec,)):
            return
        owner = next((m for m, t in METHOD_SPECS.items() if spec.format in t.rows), None)
        then = f": train them with --method {owner}" if owner else f"; it trains on {self.spec.what}"
        raise ConfigError(f"--method {self.name}: the rows are {words(spec)}{then}")

    @abstractmethod
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
        """A slice's checked rows as what its steps read (blocks of tokens, pairs, items, prompts)."""

    def eval_packing(self, packing: str) -> str:
        """How the held-out rows are packed (a method whose sequences stay whole: as training packs them)."""
        return packing

    @abstractmethod
    def plan(self, config: Config, env: DistEnv, sequences: Any, batch_size: int, accum_steps: int) -> Any:
        """The global batches of the slice's epochs, and this rank's share of each (data/blocks.py StepPlan's
        interface)."""

    @abstractmethod
    def describe(self, sequences: Any, packing_words: str, max_length: int) -> str:
        """What the slice became, for the summary's data line."""

    # ------------------------------------------------------------ setup

    def model_config(self, model_config) -> None:  # noqa: ANN001
        """The model's config before anything is built: dropout off where the spec has none (the loss compares
        forwards of one model), in one line saying why."""
        off = [] if self.spec.dropout else without_dropout(model_config)
        if off:
            print0(f"{self.name}: dropout off ({', '.join(off)}): {self.dropout_off_why}")

    dropout_off_why = "the policy is compared with its reference on the same forward"

    def lora(self, lc):  # noqa: ANN001, ANN201
        """The LoRA settings the run builds its adapters with: no adapter dropout either where the spec has none
        (unless --lora_dropout gives one)."""
        if self.spec.dropout or not lc.enabled or lc.lora_dropout is not None:
            return lc
        return dataclasses.replace(lc, lora_dropout=0.0)

    def before_model(
        self, session_inputs: Any, env: DistEnv, payload: dict[str, Any] | None, precision: str, tokenizer, layout
    ) -> None:  # noqa: ANN001
        """Work before the trainable model exists (every rank), once the layout (planner/layout.py: the micro-batch,
        the accumulation) is decided."""
        return None  # an optional hook: nothing unless a method says otherwise

    @abstractmethod
    def after_model(self, s: Session) -> None:
        """Work once the model is built and the session made, before a resumed state is loaded: at least the step's
        loss (`s.loss`, an engine/step.py StepLoss)."""

    # ------------------------------------------------------------ the run

    def summary(self, s: Session) -> str:
        return self.name

    def state(self) -> dict[str, Any] | None:
        """What checkpoints keep of the method (under `state_key`)."""
        return None

    @abstractmethod
    def evaluate(self, s: Session) -> dict[str, Any]:
        """--eval_rows at a save (every rank): the result, which rank 0 prints and logs."""

    eval_logged: tuple[str, ...] = ("loss",)  # what W&B gets of an evaluation

    def after_step(self, s: Session, record: dict[str, Any]) -> None:
        """After each optimizer step (every rank), once its record is written."""
        return None  # an optional hook: nothing unless a method says otherwise

    def at_save(self, s: Session) -> None:
        """At each save (every rank), before the checkpoint is gathered."""
        return None  # an optional hook: nothing unless a method says otherwise

    def further_range(self, s: Session) -> str | None:
        """Why the session cannot start the chain's next range itself (None: it can)."""
        return None

    def switch_range(self, s: Session, data) -> None:  # noqa: ANN001
        """A further range in the same session: what the method needs of its rows (before its first step)."""
        return None  # an optional hook: nothing unless a method says otherwise

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

    @abstractmethod
    def scored_what(self, sequences: Any, packing: str, max_length: int, train_on: str) -> str:
        """What `python -m fsdp_opt.evaluate` scores the models on, in words."""

    @abstractmethod
    def score(self, model, held, batch_size: int, env: DistEnv) -> dict[str, Any]:  # noqa: ANN001
        """One model's result on the held-out sequences (every rank)."""

    @abstractmethod
    def score_line(self, result: dict[str, Any]) -> str:
        """One model's result, in words."""

    @staticmethod
    @abstractmethod
    def table(results: dict[str, Any]) -> list[str]:
        """The report's table of the models scored."""


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
