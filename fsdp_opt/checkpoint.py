"""Checkpoints: names, the single-file format, atomic writes, save and resume.

A checkpoint is one `.pt` file that loads with `torch.load(path, weights_only=True)`: tensors and plain
values only. Rank 0 gathers the full state (every rank takes part in the gather) and writes it; on resume
rank 0 reads it and every rank receives its shards by broadcast, so host RAM holds one full copy.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .distributed import DistEnv
from .errors import CheckpointError

FORMAT = "fsdp-opt/1"
SUFFIX = ".pt"
# {tag}_{start}-{end}-epoch-{epoch}.pt, or ...-epoch-{epoch}-step-{global_step}.pt mid-epoch.
NAME_RE = re.compile(r"^(?P<tag>.+)_(?P<start>\d+)-(?P<end>\d+)-epoch-(?P<epoch>\d+)(?:-step-(?P<step>\d+))?\.pt$")
# Keys of the original script's checkpoints, kept so old readers still work.
MODEL_KEY, STEP_KEY, EPOCHS_KEY = "MODEL_STATE", "GLOBAL_STEP", "EPOCHS_RUN"


def checkpoint_name(tag: str, start: int, end: int, epoch: int, step: int | None = None) -> str:
    """`epoch` is 1-based: the epoch finished (or, with `step`, in progress)."""
    base = f"{tag}_{start}-{end}-epoch-{epoch}"
    return f"{base}-step-{step}{SUFFIX}" if step is not None else f"{base}{SUFFIX}"


def parse_name(name: str) -> dict[str, Any] | None:
    m = NAME_RE.match(Path(name).name)
    if not m:
        return None
    out: dict[str, Any] = {k: (int(v) if v is not None and k != "tag" else v) for k, v in m.groupdict().items()}
    return out


@dataclass
class TrainState:
    """Where the run is: what a resume restores besides model and optimizer."""

    global_step: int = 0
    epoch: int = 0  # 0-based epoch of the slice that `offset` points into
    offset: int = 0  # samples of that epoch already consumed

    def state_dict(self) -> dict[str, int]:
        return {"global_step": self.global_step, "epoch": self.epoch, "offset": self.offset}


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def atomic_save(obj: Any, path: Path) -> None:
    """Write to a temporary name in the same folder, fsync, then rename: never a half file under `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def gather_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """Full fp32 model (and optimizer) state on rank 0's CPU; empty elsewhere. Every rank must call it."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=opts)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=opts) if optimizer is not None else None
    return model_sd, optim_sd


def save_checkpoint(
    path: Path,
    env: DistEnv,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    state: TrainState,
    epochs_run: int,
    extra: dict[str, Any],
    save_optimizer: bool = True,
) -> dict[str, float] | None:
    """Gather on every rank, write on rank 0. Returns {'bytes', 'seconds'} on rank 0."""
    start = time.perf_counter()
    model_sd, optim_sd = gather_full_state(model, optimizer if save_optimizer else None)
    rngs: list[Any] = [None] * env.world_size
    if env.world_size > 1:
        dist.all_gather_object(rngs, rng_state())
    else:
        rngs = [rng_state()]
    info = None
    if env.is_main:
        payload = {
            "format": FORMAT,
            MODEL_KEY: model_sd,
            STEP_KEY: state.global_step,
            EPOCHS_KEY: epochs_run,
            "optimizer": optim_sd,
            "train_state": state.state_dict(),
            "rng": rngs,
            **extra,
        }
        atomic_save(payload, path)
        info = {"bytes": float(path.stat().st_size), "seconds": time.perf_counter() - start}
    del model_sd, optim_sd
    return info


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint of ours on CPU, refusing anything else with a one-line CheckpointError."""
    if not path.is_file():
        raise CheckpointError(f"--resume_file {path}: no such file")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        reason = str(exc).strip().splitlines()[0][:160]
        raise CheckpointError(
            f"--resume_file {path}: refused: it holds objects that need code to load ({reason})"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"--resume_file {path}: not a readable checkpoint, truncated or damaged ({reason})") from None
    if not isinstance(payload, dict) or MODEL_KEY not in payload:
        raise CheckpointError(f"--resume_file {path}: not an fsdp-opt checkpoint (no {MODEL_KEY})")
    return payload


def check_compatible(payload: dict[str, Any], model: nn.Module, path: Path) -> None:
    """The checkpoint's weights must have the names and shapes of `model` (a meta or sharded skeleton)."""
    expected = {k: tuple(v.shape) for k, v in get_model_state_dict(model).items()}
    got = {k: tuple(v.shape) for k, v in payload[MODEL_KEY].items()}
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing or unexpected:
        what = f"missing {missing[:2]}" if missing else f"unexpected {unexpected[:2]}"
        raise CheckpointError(f"--resume_file {path}: weights of another architecture ({what})")
    for k, shape in expected.items():
        if got[k] != shape:
            raise CheckpointError(
                f"--resume_file {path}: {k} has shape {list(got[k])}, the model has {list(shape)} "
                "(another model size or vocabulary)"
            )


def load_into(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    payload: dict[str, Any] | None,
    env: DistEnv,
    *,
    load_optimizer: bool,
) -> None:
    """Rank 0 holds `payload`; every rank ends with the same model and optimizer state."""
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, payload[MODEL_KEY] if env.is_main else {}, options=opts)
    if load_optimizer:
        set_optimizer_state_dict(model, optimizer, payload["optimizer"] if env.is_main else {}, options=opts)


def find_checkpoint(output_dir: Path, name: str) -> Path:
    """A path, a name inside output_dir, or `latest` (highest global step in output_dir)."""
    if name == "latest":
        found = latest_checkpoint(output_dir)
        if found is None:
            raise CheckpointError(f"--resume_file latest: no checkpoint in {output_dir}")
        return found
    as_path = Path(name).expanduser()
    if as_path.is_file():
        return as_path
    inside = output_dir / name
    if inside.is_file():
        return inside
    present = sorted(p.name for p in output_dir.glob(f"*{SUFFIX}")) if output_dir.is_dir() else []
    listing = ", ".join(present[:10]) if present else "none"
    raise CheckpointError(f"--resume_file {name}: not found as a path or in {output_dir} (checkpoints there: {listing})")


def checkpoint_step(path: Path) -> int:
    parsed = parse_name(path.name)
    if parsed and parsed["step"] is not None:
        return parsed["step"]
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(payload[STEP_KEY])
    except Exception:  # noqa: BLE001 - an unreadable file is never "latest"
        return -1


def latest_checkpoint(output_dir: Path) -> Path | None:
    if not output_dir.is_dir():
        return None
    candidates = [p for p in output_dir.glob(f"*{SUFFIX}") if parse_name(p.name)]
    scored = [(checkpoint_step(p), p.stat().st_mtime, p) for p in candidates]
    scored = [s for s in scored if s[0] >= 0]
    return max(scored)[2] if scored else None
