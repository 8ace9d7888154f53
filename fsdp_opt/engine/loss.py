"""The next-token loss: from the model's whole logits, or from its final hidden states with the output layer run by the
loss itself (HeadLoss): at the positions that have a target alone, and with `--loss_chunk_tokens N`, N of them at a
time.

A prompt, a chat's question, a padded tail or a GRPO prompt has no target: its logits are never needed. HeadLoss
stops the model's forward before its output projection and runs it on the target positions only, so a chat or DPO
micro-batch computes the vocabulary-wide logits, their fp32 copy, the log-softmax and its gradient for its answer
tokens alone. Finding those positions reads the labels once per micro-batch (a host sync on a GPU). The held-out
loss (engine/evaluation.py) and DPO's reference and held-out passes (engine/logprobs.py scored_logps) run the layer the same
way, without gradients.

With `--loss_chunk_tokens N` the projection and the cross-entropy run N target tokens at a time, each chunk under
activation checkpointing: forward keeps only the chunk's scalar loss, backward recomputes one chunk's logits at a
time. For opt-1.3b (vocabulary 50,272) a micro-batch of 4 x 512 target tokens otherwise holds their logits' fp32
copy, the log-softmax and its gradient at once (the plan: 1.15 GiB); in chunks of 256 tokens, 0.19 GiB. The price is
the projection computed twice (about 2.6% more FLOPs per token for opt-1.3b).

The projection weight is read after the forward, from the FSDP root unit, which keeps its weights gathered from
forward to backward (`reshard_after_forward=False`); its gradient then reaches the same reduce-scatter as before.
A model whose logits are more than `hidden @ W.T` (a bias, a softcap, a scale) keeps its whole logits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fsdp_opt.base import ConfigError
from fsdp_opt.data.blocks import IGNORE_INDEX, Blocks, model_inputs
from fsdp_opt.engine.microbatches import MicroLoss, StepLoss
from fsdp_opt.model.families import head_refusal


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """Each position's target is the next position's label; the last position gets none.

    The labels move one place left rather than the logits: slicing the logits would cost a copy of them in
    forward and a zero-filled tensor of their full size in backward.
    """
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over the targets; fp32 for the softmax."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        next_token_targets(labels).reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = hidden @ weight.t()
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _chunk_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()
    if temperature != 1.0:
        logits = logits / temperature
    return -F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")


def _passthrough(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


class HeadLoss:
    """Next-token cross-entropy (and log-probabilities) from the final hidden states: the output layer at the target
    positions only (`select`), `chunk_tokens` of them at a time when that is not 0.

    `select=False` runs every position, as if each had a target: the memory plan's simulation (planner/simulate.py),
    whose fake tensors hold no labels to select by, measures that worst case."""

    def __init__(self, model: nn.Module, chunk_tokens: int = 0, select: bool = True):
        why = head_refusal(model)
        if why:
            raise ConfigError(f"--loss_chunk_tokens: not available for this model ({why}); use 0")
        self.head, self.chunk_tokens, self.select = model.get_output_embeddings(), chunk_tokens, select

    @classmethod
    def for_run(cls, model: nn.Module, chunk_tokens: int, select: bool = True) -> HeadLoss | None:
        """A run's loss: in chunks when asked (refused, as a flag error, for a model whose logits are not a plain
        projection); else the output layer at the targets where the model allows it; else None (whole logits)."""
        if chunk_tokens or head_refusal(model) is None:
            return cls(model, chunk_tokens, select)
        return None

    @contextmanager
    def hidden_states(self) -> Iterator[None]:
        """Inside, the model's `.logits` output is its final hidden states (the projection is skipped)."""
        self.head.forward = _passthrough
        try:
            yield
        finally:
            del self.head.forward

    def _at_targets(
        self, hidden: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The hidden states and targets of the positions the loss reads, flat, and those positions (None: all)."""
        targets = next_token_targets(labels).reshape(-1)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if not self.select:
            return flat, targets, None
        rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
        if rows.numel() == targets.numel():
            return flat, targets, None
        # an empty selection still runs the projection (on no rows): every rank's output layer gets a gradient
        return flat.index_select(0, rows), targets.index_select(0, rows), rows

    def _pieces(self, flat: torch.Tensor, targets: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if not self.chunk_tokens:
            yield flat, targets
            return
        # split (not slicing) so backward joins the chunks' gradients once instead of zero-filling per chunk.
        yield from zip(flat.split(self.chunk_tokens), targets.split(self.chunk_tokens))

    def _run(self, fn, *args):  # noqa: ANN001, ANN002, ANN202
        if not self.chunk_tokens:
            return fn(*args)
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)

    def logits_at_targets(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[targets, vocabulary] logits of the positions that predict a target, the output layer run at those rows
        only (the whole vocabulary: a divergence between two models' distributions reads all of it)."""
        flat, _, _ = self._at_targets(hidden, labels)
        return flat @ self.head.weight.t()

    def loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Call after the forward, while the root unit's weights are still gathered."""
        flat, targets, _ = self._at_targets(hidden, labels)
        weight = self.head.weight
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        for h, t in self._pieces(flat, targets):
            total = total + self._run(_chunk_loss, h, weight, t)
        return total

    def token_logps(self, hidden: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Each position's log-probability of its next token (0 without a target), flat, fp32, of the logits divided
        by `temperature`: DPO's per-sequence sums and GRPO's per-token ratios."""
        flat, targets, rows = self._at_targets(hidden, labels)
        parts = [self._run(_chunk_logps, h, self.head.weight, t, temperature) for h, t in self._pieces(flat, targets)]
        found = torch.cat(parts) if len(parts) > 1 else parts[0]
        if rows is None:
            return found
        return torch.zeros(hidden.shape[0] * hidden.shape[1], dtype=found.dtype, device=found.device).index_copy(
            0, rows, found
        )


def head_forward(model: nn.Module, head: HeadLoss | None, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One forward of `model` on `batch`: its logits, or with `head` its final hidden states (the projection left to
    the loss)."""
    with head.hidden_states() if head else nullcontext():
        return model(**model_inputs(batch)).logits


def target_logits(model: nn.Module, head: HeadLoss | None, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """One forward of `model` on `batch`: the [targets, vocabulary] logits of the positions that predict a target, in
    order (with `head`, the output layer runs at those positions only)."""
    out = head_forward(model, head, batch)
    if head is not None:
        return head.logits_at_targets(out, batch["labels"])
    on = (next_token_targets(batch["labels"]) != IGNORE_INDEX).reshape(-1)
    return out.reshape(-1, out.shape[-1])[on]


def forward_loss_sum(
    model: nn.Module, head: HeadLoss | None, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """head_forward's output and the summed loss of the batch's targets (with `head`, the output layer at the targets
    only)."""
    out = head_forward(model, head, batch)
    loss = head.loss_sum(out, batch["labels"]) if head else causal_lm_loss_sum(out, batch["labels"])
    return out, loss


class TokenLoss(StepLoss):
    """--method sft's step: the token-mean cross-entropy of the targets, each micro-batch's sum divided by the step's
    global count of target tokens (engine/step.py)."""

    def __init__(self, blocks: Blocks, head: HeadLoss | None, device: torch.device) -> None:
        self.blocks, self.head, self.device = blocks, head, device

    def loss(self, model: nn.Module, micro: torch.Tensor) -> MicroLoss:
        # NOTE: the output stays referenced through backward, as the memory plan and its simulation count it
        out, total = forward_loss_sum(model, self.head, self.blocks.batch(micro, self.device))
        return MicroLoss(total, None, out)


def member_sums(per_token: torch.Tensor, labels: torch.Tensor, slot: torch.Tensor, members: int) -> torch.Tensor:
    """[members] a per-position value summed over each member's completion tokens (the positions that predict
    them)."""
    on, owner = completion_positions(labels, slot)
    index = torch.where(on, owner, members).reshape(-1)
    values = torch.where(on, per_token, torch.zeros_like(per_token)).reshape(-1)
    return torch.zeros(members + 1, dtype=values.dtype, device=values.device).index_add(0, index, values)[:members]


def completion_positions(labels: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, length] where a completion token is predicted (the loss's positions), and the member whose token it
    is (-1: none): the log-probability at t is of the token at t + 1."""
    owner = F.pad(slot[:, 1:], (0, 1), value=-1)
    return (next_token_targets(labels) != IGNORE_INDEX) & (owner >= 0), owner
