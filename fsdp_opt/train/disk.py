"""Disk room for the next save: older checkpoints leave first (those the Hub holds before others), the newest only
once the Hub has it; and pruning to --keep_last after each save or upload."""

from __future__ import annotations

import shutil
from pathlib import Path

from fsdp_opt.checkpoint.files import checkpoint_step
from fsdp_opt.checkpoint.files import prune as ckpt_prune
from fsdp_opt.checkpoint.names import list_checkpoints
from fsdp_opt.checkpoint.room import Held, bytes_on_disk, choose
from fsdp_opt.runtime.distributed import print0
from fsdp_opt.train.session import Session


def make_room(session: Session, keep: Path) -> None:
    """Rank 0, before a save: remove local checkpoints until the new one fits the disk's free space and --disk_budget
    (room.choose: those the Hub has first, then older ones, the newest only once the Hub has it). What still does not
    fit is left to the save, which stops in one line when the disk is full; over --disk_budget alone it warns."""
    cc = session.config.checkpoint
    up = session.uploader
    with session.prune_lock:
        paths = sorted(
            (p for p in list_checkpoints(session.out_dir) if p != keep),
            key=lambda p: (checkpoint_step(p), p.stat().st_mtime),
        )
        state = {p: up.upload_state(p) if up is not None else None for p in paths}
        held = [
            Held(
                p,
                bytes_on_disk(p),
                on_hub=up is not None and up.is_on_hub(p),
                uploading=state[p] == "uploading",
                queued=state[p] in ("waiting", "uploading"),
            )
            for p in paths
        ]
        session.out_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(session.out_dir).free
        plan = choose(
            held, session.position.last_save_bytes or save_bytes_estimate(session), free, cc.disk_budget_bytes
        )
        why = f"{plan.needed / 1e9:,.2f} GB needed, {free / 1e9:,.2f} GB free" + (
            f", --disk_budget {cc.disk_budget}" if cc.disk_budget_bytes is not None else ""
        )
        for h in plan.remove:
            on_hub = h.on_hub
            if h is plan.remove[-1] and plan.wait_for_newest:
                print0(f"waiting for the upload of {h.path.name} before removing it to make room ({why})")
                on_hub = up.wait_for(h.path, session.config.hub.hub_wait_seconds)
                if not on_hub:
                    break  # the only copy of the newest checkpoint: kept; the save says in one line what is missing
            if h.path.is_dir():
                shutil.rmtree(h.path, ignore_errors=True)
            else:
                h.path.unlink(missing_ok=True)
            if up is not None and not on_hub:
                up.drop(h.path)
            where = "the Hub has it" if on_hub else "a newer checkpoint is kept"
            print0(f"removed {h.path} ({h.bytes / 1e9:,.2f} GB; {where}) to make room for the next save: {why}")
    if plan.fits_disk and not plan.fits_budget:
        print0(
            f"warning: --disk_budget {cc.disk_budget}: the checkpoints in {session.out_dir} and the next save need about "
            f"{(plan.used_after + plan.needed) / 1e9:,.2f} GB; nothing more can be removed (the newest is not on "
            "the Hub); saving anyway"
        )


def save_bytes_estimate(session: Session) -> int:
    """The first save's size before one is measured: fp32 weights (+ AdamW's two moments) of what trains."""
    trainable = sum(p.numel() for p in session.params)
    return (12 if session.config.checkpoint.save_optimizer else 4) * trainable + 2**20


def prune(session: Session, keep: Path) -> None:
    """--keep_last, rank 0. With --hf_repo a file goes only once the Hub has it (called again after each push)."""
    keep_last = session.config.checkpoint.keep_last
    may_delete = session.uploader.is_on_hub if session.uploader is not None else None
    with session.prune_lock:
        for old in ckpt_prune(session.out_dir, keep_last, keep=keep, may_delete=may_delete):
            print0(f"removed {old} (--keep_last {keep_last})")
