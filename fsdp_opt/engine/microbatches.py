"""A step's micro-batches on one rank, forward and backward: the loop every method's step (and the planner's simulation
of a step) runs, written once.

FSDP2 reduces the gradients only after the last micro-batch (--reduce_every_microbatch: after each): the sync flag is
set here and nowhere else. A method gives the loss of micro-batch i, already weighted for the step (its share of
the step's mean, times the fp16 loss scale), what that micro-batch adds to the step's sums, and anything that must
stay alive through the backward (the forward's output, as the memory plan counts it). A rank whose share of the step
has fewer micro-batches than another's runs filler ones (no targets, the same forward and backward, so every rank
takes part in every collective): the method's loss of a filler is 0 times its output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# micro-batch i -> (the weighted loss its backward takes, what it adds to the sums or None, what backward keeps alive)
MicroLoss = Callable[[int], tuple[torch.Tensor, torch.Tensor | None, Any]]


def run_micro_batches(
    model: nn.Module,
    count: int,
    loss_of: MicroLoss,
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
