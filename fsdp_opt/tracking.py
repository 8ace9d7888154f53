"""What a run reports: metrics.jsonl (the contract), tokens/s and MFU, the progress bar, the summary."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .hostmem import peak_rss_bytes

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"  # one line per --eval_rows evaluation: step, epoch, rows, loss, perplexity, tokens, seconds
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
    "slice",  # the rows this session trains, "start-end"
    "skipped_rate",  # share of the last 20 steps (fewer at the start) skipped for a non-finite gradient (fp16 overflow)
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


def flops_per_token(model: nn.Module, seq_len: int, frozen_base: bool = False) -> float:
    """Training FLOPs per token: 6N + 12*L*H*Q*T (PaLM appendix B), N = non-embedding params + lm_head.

    With a frozen base (LoRA) no weight gradient is computed: 4N + 8*L*H*Q*T (the adapters' own FLOPs are left out)."""
    config = model.config
    embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    head = model.get_output_embeddings()
    n = count_params(model) - embedding + (head.weight.numel() if head is not None else 0)
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    per_matmul = 2.0 if frozen_base else 3.0  # forward, input gradient (, weight gradient)
    return 2.0 * per_matmul * n + 4.0 * per_matmul * layers * heads * head_dim * seq_len


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
    return peak_rss_bytes() or None


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


# ---------------------------------------------------------------- Weights & Biases (rank 0)


def wandb_key_configured() -> bool:
    """An API key in WANDB_API_KEY or in ~/.netrc for the W&B host (as `wandb login` leaves it). Never read out."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(flag: str) -> str:
    """The flag; for `auto`, W&B's own WANDB_MODE when set, else online with an API key and offline without."""
    if flag != "auto":
        return flag
    env = {"dryrun": "offline", "run": "online"}.get(os.environ.get("WANDB_MODE", ""), os.environ.get("WANDB_MODE", ""))
    if env in ("online", "offline", "disabled"):
        return env
    return "online" if wandb_key_configured() else "offline"


class WandbRun:
    """One W&B run per training run: the id travels in each checkpoint and is reused by the next session.

    Logs the flags (no secrets are flags), every metrics.jsonl record under train/, eval results under eval/,
    and each pushed checkpoint as an artifact that references its Hub file (no second upload). Any W&B failure
    prints one warning and turns logging off; training goes on.
    """

    def __init__(self, *, enabled: bool, project: str, mode: str, run_id: str | None, config: dict[str, Any], out_dir: Path):
        self.run = None
        self.run_id = run_id
        if not enabled:
            return
        mode = wandb_mode(mode)
        if mode == "disabled":
            return
        if mode == "online" and not wandb_key_configured():
            print("note: --wandb_mode online without a W&B API key (WANDB_API_KEY or `wandb login`); logging offline")
            mode = "offline"
        try:
            import wandb
        except ImportError:
            print("warning: wandb is not installed; W&B logging is off")
            return
        self.run_id = run_id or new_run_id()
        out_dir.mkdir(parents=True, exist_ok=True)
        for attempt in (mode, "offline") if mode == "online" else (mode,):
            try:
                settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, init_timeout=float(os.environ.get("WANDB_INIT_TIMEOUT", 60)))
                self.run = wandb.init(
                    project=project, id=self.run_id, resume="allow", mode=attempt, dir=str(out_dir), config=config, settings=settings
                )
                break
            except Exception as exc:  # noqa: BLE001 - no network, bad key: never fatal
                first = (str(exc).splitlines() or [type(exc).__name__])[0]
                try:
                    wandb.teardown()  # a failed start leaves W&B's service half-open; the next start needs a fresh one
                except Exception:  # noqa: BLE001
                    pass
                print(f"warning: W&B {attempt} start failed ({type(exc).__name__}: {first})"
                      + ("; logging offline instead" if attempt == "online" else "; W&B logging is off"))  # fmt: skip
        if self.run is not None:
            print(f"W&B run {self.run_id} ({attempt}) in project {project}; files under {out_dir / 'wandb'}")

    def _safely(self, what: str, fn) -> None:
        if self.run is None:
            return
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            print(f"warning: W&B {what} failed ({type(exc).__name__}); W&B logging is off")
            self.run = None

    def log_step(self, record: dict[str, Any]) -> None:
        values = {f"train/{k}": float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        self._safely("log", lambda: self.run.log(values, step=int(record["step"])))

    def log_eval(self, step: int, values: dict[str, float]) -> None:
        self._safely("log", lambda: self.run.log({f"eval/{k}": v for k, v in values.items()}, step=step))

    def log_checkpoint(self, name: str, url: str, metadata: dict[str, Any]) -> None:
        def log() -> None:
            import wandb

            artifact = wandb.Artifact(_artifact_name(name), type="model", metadata=metadata)
            artifact.add_reference(url, name=name, checksum=False)
            step = metadata.get("global_step")
            self.run.log_artifact(artifact, aliases=["latest"] + ([f"step-{step}"] if step is not None else []))

        self._safely("artifact", log)

    def finish(self) -> None:
        self._safely("finish", lambda: self.run.finish())
        self.run = None


def new_run_id() -> str:
    """Eight lowercase letters and digits, the form of W&B's own run ids."""
    import secrets
    import string

    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _artifact_name(checkpoint_name: str) -> str:
    """W&B artifact names allow letters, digits, '-', '_' and '.'."""
    import re

    return re.sub(r"[^\w.-]", "-", checkpoint_name)


def gpu_memory_line(env) -> str | None:  # noqa: ANN001 - a distributed.DistEnv
    if env.device.type != "cuda":
        return None
    return (f"GPU memory peak on rank {env.rank}: {torch.cuda.max_memory_allocated(env.device) / 2**30:.2f} GiB "
            f"allocated, {torch.cuda.max_memory_reserved(env.device) / 2**30:.2f} GiB reserved")  # fmt: skip


def host_peaks_line(world_size: int) -> str:
    """Every rank's peak host RSS so far, gathered to one line (a collective: every rank calls it)."""
    peaks = [peak_rss_bytes()]
    if world_size > 1:
        peaks = [0] * world_size
        dist.all_gather_object(peaks, peak_rss_bytes())
    return "host RAM peak per rank: " + ", ".join(f"{p / 2**30:.2f}" for p in peaks) + " GiB"
