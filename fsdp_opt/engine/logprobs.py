"""Log-probabilities of answers, the one helper every method that compares models reads (DPO's pairs, KTO's unpaired
rows, GRPO's completions), and a reference model's, kept by key.

- `token_logps` / `head_logps`: each position's log-probability of its next token, fp32, from the logits (or, where
  the model's output layer is a plain projection, from the final hidden states at the targets only: engine/loss.py
  HeadLoss), at a temperature.
- `sequence_logps`: their sums per sequence of a packed micro-batch.
- `scored_logps`: every sequence of a set of units (a DPO pair: its two answers; a KTO row: its completion and its
  mismatched one), in eval mode, each rank a share of the micro-batches, the whole on every rank.
- `Reference`: a reference model's sums by unit key (a dataset row; for KTO a pair of items), what a checkpoint keeps
  so that a resumed session runs the reference no more.

A set of units answers `keys` ([units] or [units, k] integers, one unit's identity), `per_unit` (its sequences),
`len()`, `fits(units, batch_size)` and `micro(units, device)` (a packed micro-batch and each position's sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_opt.data.blocks import IGNORE_INDEX
from fsdp_opt.data.sequences import held_out_micro_batches, rank_rounds
from fsdp_opt.engine.loss import HeadLoss, head_forward, next_token_targets
from fsdp_opt.runtime.distributed import DistEnv


class Units(Protocol):
    """What `scored_logps` and `Reference` read of a set of units (data/pairs.py Pairs, data/unpaired.py's sets)."""

    keys: torch.Tensor
    per_unit: int

    def __len__(self) -> int: ...

    def fits(self, units: list[int], batch_size: int) -> bool: ...

    def micro(self, units: list[int], device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]: ...


def token_logps(
    out: torch.Tensor, labels: torch.Tensor, head: HeadLoss | None, temperature: float = 1.0
) -> torch.Tensor:
    """Each position's log-probability of its next token (0 where there is no target), fp32, [batch, length], from the
    logits divided by `temperature` (GRPO's completions were drawn that way)."""
    targets = next_token_targets(labels)
    if head is None:
        logits = out.reshape(-1, out.shape[-1]).float()
        if temperature != 1.0:
            logits = logits / temperature
        flat = -F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none")
        return flat.view(targets.shape)
    return head.token_logps(out, labels, temperature).view(targets.shape)


def head_logps(
    model: nn.Module, head: HeadLoss | None, batch: dict[str, torch.Tensor], temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """token_logps of one forward of `model` on `batch` (with `head`, the output layer at the targets only), and the
    forward's output (the logits, or with `head` the final hidden states)."""
    out = head_forward(model, head, batch)
    return token_logps(out, batch["labels"], head, temperature), out


def sequence_logps(logps: torch.Tensor, slot: torch.Tensor, sequences: int) -> torch.Tensor:
    """[sequences] sums of the token log-probabilities of each sequence (slot: each position's sequence, -1 none)."""
    # the log-probability at position t is of the token at t + 1: it belongs to that token's sequence
    owner = F.pad(slot[:, 1:], (0, 1), value=-1)
    # positions of no sequence go to one more slot, dropped: no data-dependent indexing (a fake tensor has no data)
    owner = torch.where(owner >= 0, owner, sequences).reshape(-1)
    sums = torch.zeros(sequences + 1, dtype=torch.float32, device=logps.device).index_add(0, owner, logps.reshape(-1))
    return sums[:sequences]


def micro_logps(
    model: nn.Module, units: Units, members: list[int], device: torch.device, head: HeadLoss | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed answer log-probabilities of these units' sequences (per_unit of each, in order), one forward, and
    the forward's output (the logits, or with `head` the final hidden states)."""
    batch, slot = units.micro(members, device)
    logps, out = head_logps(model, head, batch)
    return sequence_logps(logps, slot, units.per_unit * len(members)), out


def unit_sequences(members: list[int], per_unit: int) -> torch.Tensor:
    """The sequences of these units, in order (unit p's are per_unit * p + k)."""
    return torch.tensor([per_unit * p + k for p in members for k in range(per_unit)], dtype=torch.long)


@torch.no_grad()
def scored_logps(model: nn.Module, units: Units, batch_size: int, env: DistEnv) -> torch.Tensor:
    """[per_unit x units] summed answer log-probabilities of every unit's sequences, in eval mode; every rank runs the
    same number of forwards and gets the whole result. The output layer runs at the answer tokens only where the model
    allows it (HeadLoss), as in a training step: a prompt never gets its vocabulary-wide logits."""
    head = HeadLoss.for_run(model, 0)
    was_training = model.training
    model.eval()
    found = torch.zeros(units.per_unit * len(units), dtype=torch.float32, device=env.device)
    try:
        for members in rank_rounds(held_out_micro_batches(units, batch_size), env.rank, env.world_size):
            sums, _ = micro_logps(model, units, members, env.device, head)
            if members:
                found[unit_sequences(members, units.per_unit).to(env.device)] = sums
    finally:
        model.train(was_training)
    if env.world_size > 1:
        dist.all_reduce(found)  # each sequence is one rank's
    return found.cpu()


def _keys(index: torch.Tensor) -> list[Any]:
    """Unit keys as dictionary keys: a row number, or a tuple of them."""
    return index.tolist() if index.dim() == 1 else [tuple(k) for k in index.tolist()]


@dataclass
class Reference:
    """A reference model's summed answer log-probabilities of each unit's sequences, by unit key (DPO: a pair's
    dataset row; KTO: the item whose prompt and the item whose completion make the sequence): what a checkpoint keeps
    so that a resumed session does not run the reference again."""

    index: torch.Tensor  # [units] or [units, k]: each unit's key
    logps: torch.Tensor  # [units, per_unit] (fp32)

    def for_pairs(self, units: Units) -> torch.Tensor:
        """[per_unit x len(units)] in the units' order."""
        at = {k: n for n, k in enumerate(_keys(self.index))}
        rows = [at[k] for k in _keys(units.keys)]
        return self.logps[rows].reshape(-1)

    def covers(self, units: Units) -> bool:
        have = set(_keys(self.index))
        return self.logps.shape[1] == units.per_unit and all(k in have for k in _keys(units.keys))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"index": self.index.clone(), "logps": self.logps.clone()}

    @classmethod
    def from_state(cls, state: dict | None) -> Reference | None:
        return None if not state else cls(state["index"], state["logps"])

    @classmethod
    def scored(cls, model: nn.Module, units: Units, batch_size: int, env: DistEnv) -> Reference:
        """The model's log-probabilities of these units (scored_logps), by their keys."""
        return cls(units.keys.clone(), scored_logps(model, units, batch_size, env).view(-1, units.per_unit))
