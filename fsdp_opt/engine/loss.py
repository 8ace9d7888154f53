"""The next-token loss: over the whole logits, or over the vocabulary in chunks of tokens (`--loss_chunk_tokens`).

With `--loss_chunk_tokens N` the model's forward stops before its output projection and returns the final
hidden states. The projection and the cross-entropy then run N tokens at a time, each chunk under activation
checkpointing: forward keeps only the chunk's scalar loss, backward recomputes one chunk's logits at a time.
For opt-1.3b (vocabulary 50,272) a micro-batch of 4 x 512 tokens otherwise holds its logits in fp16, an fp32 copy,
the log-softmax and the fp32 gradient at once (about 1.3 GiB); in chunks of 1024 tokens that is a few hundred MB.
The price is the projection computed twice (about 2.6% more FLOPs per token for opt-1.3b).

The projection weight is read after the forward, from the FSDP root unit, which keeps its weights gathered from
forward to backward (`reshard_after_forward=False`); its gradient then reaches the same reduce-scatter as before.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fsdp_opt.base import ConfigError
from fsdp_opt.data.blocks import IGNORE_INDEX

# Config fields of models whose logits are more than `hidden @ W.T`: those keep the whole-logits loss.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """Each position's target is the next position's label; the last position gets none.

    The labels move one place left rather than the logits: slicing the logits would cost a copy of them in
    forward and a zero-filled tensor of their full size in backward.
    """
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over the targets; fp32 for the softmax."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), next_token_targets(labels).reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )  # fmt: skip


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


class ChunkedLoss:
    """Next-token cross-entropy summed over the targets, computed `chunk_tokens` tokens at a time."""

    def __init__(self, model: nn.Module, chunk_tokens: int):
        head = model.get_output_embeddings()
        config = getattr(model, "config", None)
        transforms = [k for k in _LOGIT_TRANSFORMS if getattr(config, k, None) not in (None, 1, 1.0)]
        if not isinstance(head, nn.Linear) or head.bias is not None or transforms:
            why = f"its logits use {transforms[0]}" if transforms else "its output layer is not a Linear without bias"
            raise ConfigError(f"--loss_chunk_tokens: not available for this model ({why}); use 0")
        self.head, self.chunk_tokens = head, chunk_tokens

    @contextmanager
    def hidden_states(self) -> Iterator[None]:
        """Inside, the model's `.logits` output is its final hidden states (the projection is skipped)."""
        self.head.forward = _passthrough
        try:
            yield
        finally:
            del self.head.forward

    def loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Call after the forward, while the root unit's weights are still gathered."""
        targets = next_token_targets(labels).reshape(-1)
        flat = hidden.reshape(-1, hidden.shape[-1])
        weight = self.head.weight
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        # split (not slicing) so backward joins the chunks' gradients once instead of zero-filling per chunk.
        for h, t in zip(flat.split(self.chunk_tokens), targets.split(self.chunk_tokens)):
            total = total + checkpoint(_chunk_loss, h, weight, t, use_reentrant=False, preserve_rng_state=False)
        return total

    def token_logps(self, hidden: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Each position's log-probability of its next token (0 without a target), flat, fp32, of the logits divided
        by `temperature`: DPO's per-sequence sums and GRPO's per-token ratios, one chunk's logits at a time."""
        targets = next_token_targets(labels).reshape(-1)
        flat = hidden.reshape(-1, hidden.shape[-1])
        parts = [checkpoint(_chunk_logps, h, self.head.weight, t, temperature, use_reentrant=False,
                            preserve_rng_state=False)
                 for h, t in zip(flat.split(self.chunk_tokens), targets.split(self.chunk_tokens))]  # fmt: skip
        return torch.cat(parts)
