"""What a run prints as it goes: the progress bar, the summary table, and the memory peaks at the end."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fsdp_opt.base import gib
from fsdp_opt.runtime.hostmem import peak_rss_bytes


class Progress:
    """A tqdm bar on rank 0 showing loss and tokens/s; silent elsewhere."""

    def __init__(self, enabled: bool, total: int, desc: str):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, dynamic_ncols=True, mininterval=1.0)

    def update(self, loss: float, tokens_per_second: float, **more: float) -> None:
        """`more`: further values of the step to show (--method dpo: its reward margin and accuracy)."""
        if self.bar is not None:
            shown = {k: f"{v:.3f}" for k, v in more.items()}
            self.bar.set_postfix(loss=f"{loss:.4f}", **shown, trained_tok_s=f"{tokens_per_second:,.0f}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def format_summary(items: dict[str, Any]) -> str:
    width = max(len(k) for k in items)
    return "\n".join(f"  {k:<{width}} : {v}" for k, v in items.items())


def gpu_memory_line(env) -> str | None:  # noqa: ANN001 - a distributed.DistEnv
    if env.device.type != "cuda":
        return None
    return (
        f"GPU memory peak on rank {env.rank}: {gib(torch.cuda.max_memory_allocated(env.device))} "
        f"allocated, {gib(torch.cuda.max_memory_reserved(env.device))} reserved"
    )


def host_peaks_line(world_size: int) -> str:
    """Every rank's peak host RSS so far, gathered to one line (a collective: every rank calls it)."""
    peaks = [peak_rss_bytes()]
    if world_size > 1:
        peaks = [0] * world_size
        dist.all_gather_object(peaks, peak_rss_bytes())
    return "host RAM peak per rank: " + ", ".join(gib(p, unit=False) for p in peaks) + " GiB"
