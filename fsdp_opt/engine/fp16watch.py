"""fp16 guardrails: a T4 has no bf16, and a model pretrained in bf16 can overflow fp16's range (65,504).

- `overflow_probe`: one forward of the first micro-batch, before training, for a model whose config says bfloat16;
  a non-finite loss gives one line of advice instead of hours of skipped steps.
- `SkipWatch`: the share of skipped (overflowed) steps over a window, for metrics.jsonl and W&B; a warning when more
  than 1 step in 20 is skipped or the loss scale falls below 1; a stop, in one line, when every step of a window of
  50 overflowed. The skips before the first step that goes through are the loss scale finding its level (it starts
  at 65,536 and halves until the gradients fit fp16): they count in the share, and in the stop, but not in the
  warning. Every rank takes the same skip decision (the global gradient norm), so they stop at the same step.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from fsdp_opt.base import ConfigError

WARN_WINDOW, WARN_SKIPS = 20, 1  # more than 1 skipped step in 20: warn

STOP_WINDOW = 50  # every step of 50 skipped: stop


class Fp16Overflow(ConfigError):
    """Training cannot go on in fp16: every step overflows."""


def trained_in_bf16(model_config: Any) -> bool:
    # `dtype`, not `torch_dtype`: transformers 5 reads the old name with a deprecation warning on every run
    dtype = getattr(model_config, "dtype", None)
    return str(dtype).replace("torch.", "") == "bfloat16"


def overflow_probe(
    bf16_pretrained: bool, precision: str, forward_loss: Callable[[], torch.Tensor], model_name: str
) -> str | None:
    """For a bf16-pretrained model (`trained_in_bf16` of its config as read, before the engine sets its dtype)
    trained in fp16: the forward loss of the first micro-batch (every rank calls this: the forward is collective).
    Returns the line to print: that the loss is finite, or a warning with the advice when it is not. None when the
    probe does not apply."""
    if precision != "fp16" or not bf16_pretrained:
        return None
    with torch.no_grad():
        loss = float(forward_loss())
    if math.isfinite(loss):
        return (
            f"fp16 probe: {model_name} was pretrained in bfloat16; its first batch is finite in fp16 (loss {loss:.4f})"
        )
    return (
        f"warning: {model_name} was pretrained in bfloat16 and overflows fp16 on the first batch (non-finite loss): "
        "fp16 cannot hold its activations. Use a GPU with bf16 (compute capability 8.0 or more) with --precision "
        "bf16, --precision fp32, or a model trained in fp16/fp32"
    )


class SkipWatch:
    """Counts skipped steps over the last windows; says when to warn and when to stop."""

    def __init__(self) -> None:
        self.recent: deque[bool] = deque(maxlen=STOP_WINDOW)
        self.warned_at = -WARN_WINDOW  # steps seen when the last warning was given
        self.seen = 0
        self.warned_scale = False
        self.calibrated: deque[bool] = deque(maxlen=WARN_WINDOW)  # the steps since the first that went through

    def observe(self, skipped: bool, scale: float) -> tuple[float, str | None, str | None]:
        """(skipped share of the last WARN_WINDOW steps, a warning or None, a reason to stop or None)."""
        self.recent.append(skipped)
        self.seen += 1
        if self.calibrated or not skipped:
            self.calibrated.append(skipped)
        window = list(self.recent)[-WARN_WINDOW:]
        rate = sum(window) / len(window)
        warning = None
        if len(self.recent) == STOP_WINDOW and all(self.recent):
            stop = (
                f"fp16: all of the last {STOP_WINDOW} steps overflowed (loss scale now {scale:.3g}); nothing has "
                "trained since. The model does not fit fp16's range: use --precision bf16 on a GPU that has it, or "
                "--precision fp32"
            )
            return rate, None, stop
        since = list(self.calibrated)
        if sum(since) > WARN_SKIPS and self.seen - self.warned_at >= WARN_WINDOW:
            self.warned_at = self.seen
            warning = (
                f"warning: fp16: {sum(since)} of the last {len(since)} steps overflowed and were skipped "
                f"(loss scale {scale:.3g})"
            )
        if scale < 1 and not self.warned_scale:
            self.warned_scale = True
            warning = (
                f"warning: fp16: the loss scale fell to {scale:.3g}, below 1: the loss itself overflows fp16, "
                "not only its gradients"
            )
        return rate, warning, None
