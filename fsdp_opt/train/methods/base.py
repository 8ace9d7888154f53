"""What a training method is to the run: one definition a method, made from its settings (its own flags class,
config/methods/), of a few builders that the data side, the run and `evaluate` each call without asking which method
it is:

- `sequences`: a slice's checked rows as what its steps read (blocks of tokens, preference pairs, items, prompts);
- `plan`: the global batches of the slice's epochs, and this rank's share of each;
- `loss`: the step's loss (engine/microbatches.py StepLoss: its micro-batches, its denominator, the summed loss of a
  micro-batch), from the run's parts and the components setup built for the method (train/components.py);
- `scorer`: how held-out sequences are scored (at a save, and by `python -m fsdp_opt.evaluate`).

The spec (config/methods/) says the rest: the rows it trains on, what setup builds for it (a reference pass, a model
kept beside, a generator, reward functions), its metrics fields, the planner's phases, dropout. The micro-batch loop,
the components' lifecycles and the checkpoint's state are the run's, written once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from fsdp_opt.config.methods import MethodSpec
from fsdp_opt.config.methods.base import Flags
from fsdp_opt.data.formats import Rows, RowSpec
from fsdp_opt.data.pairs import UnitPlan
from fsdp_opt.data.sequences import Packing
from fsdp_opt.engine.loss import HeadLoss
from fsdp_opt.engine.microbatches import StepLoss
from fsdp_opt.runtime.distributed import DistEnv


@dataclass(frozen=True)
class SequenceInput:
    """What a slice's sequences are made of: its checked rows, their format, the tokenizer, which tokens train, and
    how sequences are laid into micro-batches."""

    rows: Rows
    spec: RowSpec
    tokenizer: PreTrainedTokenizerBase
    train_on: str
    packing: Packing


@dataclass(frozen=True)
class PlanInput:
    """What a plan is laid out for: the micro-batch, the accumulation, this rank among the ranks, the seed."""

    batch_size: int
    accum_steps: int
    rank: int
    world_size: int
    seed: int


@dataclass(frozen=True)
class RunParts:
    """What a method's loss and scorer are made of: the ranks, the model's config and tokenizer, the output layer run
    at the targets (None: whole logits), the slice's sequences and held-out ones, the micro-batch, and the components
    setup built for the method (train/components.py)."""

    env: DistEnv
    model_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    head: HeadLoss | None
    sequences: Any
    held_out: Any | None
    batch_size: int
    components: Any


class Scorer(Protocol):
    """How held-out sequences are scored: by the run at each save, and by `python -m fsdp_opt.evaluate` for each
    model it compares."""

    logged: tuple[str, ...]  # the result's fields W&B gets

    def score(self, model: Any) -> dict[str, Any]: ...  # noqa: ANN401 - every rank

    def line(self, result: dict[str, Any]) -> str: ...

    def what(self) -> str: ...  # what it scores, in words

    def table(self, results: dict[str, Any]) -> list[str]: ...  # the evaluate report's table of the models scored


@dataclass
class AgainstReference:
    """What the held-out scorers of the methods with a reference (DPO, KTO) share: the reference's name, the
    micro-batch and the ranks."""

    reference_name: str
    batch_size: int
    env: DistEnv

    def against(self) -> str:
        return f"against the reference {self.reference_name}"


class Method(ABC):
    """A training method: its spec, its settings, and its builders."""

    spec: MethodSpec

    def __init__(self, settings: Flags) -> None:
        self.settings = settings

    @property
    def name(self) -> str:
        return self.spec.name

    @abstractmethod
    def sequences(self, made: SequenceInput) -> Any:
        """A slice's checked rows as what its steps read."""

    def plan(self, sequences: Any, layout: PlanInput) -> Any:
        """The global batches of the slice's epochs, and this rank's share of each: whole units laid into
        micro-batches as many as fit each (data/pairs.py UnitPlan)."""
        return UnitPlan(sequences, **vars(layout))

    @abstractmethod
    def loss(self, parts: RunParts) -> StepLoss:
        """The step's loss."""

    @abstractmethod
    def scorer(self, parts: RunParts) -> Scorer:
        """How the held-out sequences (`parts.held_out`) are scored."""
