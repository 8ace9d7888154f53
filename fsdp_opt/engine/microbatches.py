"""A step's micro-batches on one rank, forward and backward: the loop every method's step (and the planner's simulation
of a step) runs, written once; and what a method's loss gives that loop (`StepLoss`, `MicroLoss`).

FSDP2 reduces the gradients only after the last micro-batch (--reduce_every_microbatch: after each): the sync flag is
set here and nowhere else. A method gives the loss of micro-batch i, already weighted for the step (its share of
the step's mean, times the fp16 loss scale), what that micro-batch adds to the step's sums, and anything that must
stay alive through the backward (the forward's output, as the memory plan counts it). A rank whose share of the step
has fewer micro-batches than another's runs filler ones (no targets, the same forward and backward, so every rank
takes part in every collective): the method's loss of a filler is 0 times its output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn


class MicroLoss(NamedTuple):
    """One micro-batch's part of a step: its summed loss (with the gradient), what it adds to the loss's other sums
    (detached; None: nothing), and what must stay alive through its backward (the forward's output, as the memory plan
    counts it)."""

    total: torch.Tensor
    stats: torch.Tensor | None = None
    output: Any = None


class StepLoss:
    """What a method computes in a step, which train_step runs without asking which method it is."""

    names: tuple[str, ...] = ("loss",)  # the sums a step keeps: the loss's first, then what `MicroLoss.stats` holds

    def prepare(self, run: Any, step: Any) -> None:  # noqa: ANN401 - engine/step.py StepRun, StepBatch
        """The phase before the forward (a method that samples: the step's completions)."""

    def micro_batches(self, step: Any) -> list[Any]:  # noqa: ANN401
        """This rank's micro-batches of the step, as many on every rank."""
        return step.micro_batches

    def denominator(self, step: Any) -> float:  # noqa: ANN401
        """What the step's summed loss is divided by (all ranks): the step's loss units by default."""
        return step.loss_units

    def loss(self, model: nn.Module, micro: Any) -> MicroLoss:
        raise NotImplementedError

    def record(self, sums: dict[str, float], step: Any, seconds: float) -> dict[str, Any]:  # noqa: ANN401
        """The method's metrics fields of the step from its sums over the ranks."""
        return {}

    def state(self, env: Any) -> dict[str, Any]:  # noqa: ANN401 - runtime/distributed.py DistEnv
        """What a checkpoint keeps of the step (every rank calls it: a generation in progress, gathered)."""
        return {}

    def completions(self) -> list[dict[str, Any]]:
        """This rank's completions the step trained for the first time (completions.jsonl), for a method that
        samples them."""
        return []


# micro-batch i -> (the weighted loss its backward takes, what it adds to the sums or None, what backward keeps alive)
LossOf = Callable[[int], tuple[torch.Tensor, torch.Tensor | None, Any]]


def run_micro_batches(
    model: nn.Module,
    count: int,
    loss_of: LossOf,
    *,
    sync_each: bool = False,
    sums: torch.Tensor | None = None,
    after: Callable[[int], None] | None = None,
) -> None:
    """Micro-batches 0 .. count-1: each one's forward (`loss_of`), its backward, its sums added; `after(i)` once its
    backward is done (the simulation measures the gradients held between micro-batches there)."""
    for i in range(count):
        if not sync_each:
            model.set_requires_gradient_sync(i == count - 1)
        loss, added, keep = loss_of(i)
        loss.backward()
        if added is not None and sums is not None:
            sums += added
        del loss, keep
        if after is not None:
            after(i)
