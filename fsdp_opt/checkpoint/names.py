"""Checkpoint names and keys: {tag}_{start}-{end}-epoch-{epoch}[-step-{step}].pt, the payload's keys (kept from the
original script so its readers still work), and listing the checkpoints of a folder."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

FORMAT = "fsdp-opt/1"

SUFFIX = ".pt"

# {tag}_{start}-{end}-epoch-{epoch}.pt, or ...-epoch-{epoch}-step-{global_step}.pt mid-epoch.
NAME_RE = re.compile(r"^(?P<tag>.+)_(?P<start>\d+)-(?P<end>\d+)-epoch-(?P<epoch>\d+)(?:-step-(?P<step>\d+))?(?:\.pt)?$")

META_FILE = "fsdp_opt_meta.pt"  # inside a sharded checkpoint folder: everything but the tensors of model and optimizer

# Keys of the original script's checkpoints, kept so old readers still work.
MODEL_KEY, STEP_KEY, EPOCHS_KEY = "MODEL_STATE", "GLOBAL_STEP", "EPOCHS_RUN"


def checkpoint_name(tag: str, start: int, end: int, epoch: int, step: int | None = None, sharded: bool = False) -> str:
    """`epoch` is 1-based: the epoch finished (or, with `step`, in progress). Sharded checkpoints are folders."""
    base = f"{tag}_{start}-{end}-epoch-{epoch}" + (f"-step-{step}" if step is not None else "")
    return base if sharded else base + SUFFIX


def parse_name(name: str) -> dict[str, Any] | None:
    m = NAME_RE.match(Path(name).name)
    if not m:
        return None
    out: dict[str, Any] = {k: (int(v) if v is not None and k != "tag" else v) for k, v in m.groupdict().items()}
    return out


def _is_checkpoint(p: Path) -> bool:
    if not NAME_RE.match(p.name) or p.name.startswith("."):
        return False
    return p.is_file() and p.suffix == SUFFIX or p.is_dir() and (p / META_FILE).is_file()


def list_checkpoints(output_dir: Path) -> list[Path]:
    return sorted(p for p in output_dir.iterdir() if _is_checkpoint(p)) if output_dir.is_dir() else []
