"""Checkpoints on disk: finding one by name or "latest", the newest by global step, and pruning to --keep_last."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from fsdp_opt.base import CheckpointError
from fsdp_opt.checkpoint.names import STEP_KEY, list_checkpoints, parse_name
from fsdp_opt.checkpoint.read import read_checkpoint


def checkpoint_step(path: Path) -> int:
    parsed = parse_name(path.name)
    if parsed and parsed["step"] is not None:
        return parsed["step"]
    try:
        payload = read_checkpoint(path)
        return int(payload[STEP_KEY])
    except Exception:  # noqa: BLE001 - an unreadable file is never "latest"
        return -1


def latest_checkpoint(output_dir: Path) -> Path | None:
    scored = [(checkpoint_step(p), p.stat().st_mtime, p) for p in list_checkpoints(output_dir)]
    scored = [s for s in scored if s[0] >= 0]
    return max(scored)[2] if scored else None


def find_checkpoint(output_dir: Path, name: str, flag: str = "--resume_file") -> Path:
    """A path, a name inside output_dir, or `latest` (highest global step in output_dir)."""
    if name == "latest":
        found = latest_checkpoint(output_dir)
        if found is None:
            raise CheckpointError(f"{flag} latest: no checkpoint in {output_dir}")
        return found
    as_path = Path(name).expanduser()
    if as_path.exists():
        return as_path
    inside = output_dir / name
    if inside.exists():
        return inside
    present = [p.name for p in list_checkpoints(output_dir)]
    listing = ", ".join(present[:10]) if present else "none"
    raise CheckpointError(f"{flag} {name}: not found as a path or in {output_dir} (checkpoints there: {listing})")


def prune(output_dir: Path, keep_last: int, keep: Path, may_delete: Callable[[Path], bool] | None = None) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints (by global step). Never `keep`, the one just written,
    and never one that `may_delete` refuses (with --hf_repo: one that is not on the Hub yet)."""
    if keep_last <= 0:
        return []
    ranked = []
    for p in list_checkpoints(output_dir):
        try:
            ranked.append((checkpoint_step(p), p.stat().st_mtime, p))
        except FileNotFoundError:  # removed meanwhile
            continue
    ranked.sort(reverse=True)
    removed = []
    for _, _, p in ranked[keep_last:]:
        if p.resolve() == keep.resolve() or (may_delete is not None and not may_delete(p)):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed
