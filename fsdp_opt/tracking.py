"""What a run reports: metrics.jsonl (the contract), tokens/s and MFU, the progress bar, the summary."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

METRICS_FILE = "metrics.jsonl"
# One JSON object per optimizer step, in this order. Tests and tools read this tuple.
METRICS_FIELDS = (
    "step",  # global optimizer step, after this update (1-based, continues across sessions)
    "epoch",  # epoch of the current slice, 0-based
    "loss",  # mean loss over every target token of the step, all micro-batches and ranks
    "lr",
    "grad_norm",  # global L2 norm of the unscaled gradients, before clipping
    "loss_scale",  # fp16 loss scale used for the step (1.0 without scaling)
    "tokens",  # target tokens of the step, all ranks
    "tokens_per_second",
    "elapsed",  # seconds since this session's training started
    "skipped",  # true when the step was skipped for a non-finite gradient
    "skipped_steps",  # skipped steps so far in the run
)

# Dense fp16/bf16 tensor-core peaks from vendor datasheets, by substring of the device name.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "A10G": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "V100": 125e12,
    "T4": 65e12,
}


class MetricsWriter:
    """Appends to output_dir/metrics.jsonl (rank 0 only); never truncates."""

    def __init__(self, output_dir: str | os.PathLike, enabled: bool):
        self.path = Path(output_dir) / METRICS_FILE
        self.enabled = enabled

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        missing = [f for f in METRICS_FIELDS if f not in record]
        if missing:
            raise KeyError(f"metrics record lacks {missing}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(output_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _unique_params(model: nn.Module) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        seen.setdefault(id(p), p)
    return list(seen.values())


def count_params(model: nn.Module) -> int:
    """Parameters of the full model (works on a meta or a sharded model: counts global shapes)."""
    return sum(p.numel() for p in _unique_params(model))


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6N + 12*L*H*Q*T (PaLM appendix B), N = non-embedding params + lm_head."""
    config = model.config
    embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    head = model.get_output_embeddings()
    n = count_params(model) - embedding + (head.weight.numel() if head is not None else 0)
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    return 6.0 * n + 12.0 * layers * heads * head_dim * seq_len


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_FLOPS.items():
        if key in name:
            return value
    return None


def peak_memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):
        return None


class Progress:
    """A tqdm bar on rank 0 showing loss and tokens/s; silent elsewhere."""

    def __init__(self, enabled: bool, total: int, desc: str):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, dynamic_ncols=True, mininterval=1.0)

    def update(self, loss: float, tokens_per_second: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_second:,.0f}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def format_summary(items: dict[str, Any]) -> str:
    width = max(len(k) for k in items)
    return "\n".join(f"  {k:<{width}} : {v}" for k, v in items.items())
