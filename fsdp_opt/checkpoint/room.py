"""Which local checkpoints go before a save so that the new one fits: the disk's free space and --disk_budget.

A pure decision over what the output folder holds, so it can be tested apart from the files. Order: older checkpoints
the Hub already has (oldest first), then older ones it does not have (the newest supersedes them), and last the newest
one itself, only once the Hub has it: the newest complete checkpoint always exists somewhere. A checkpoint being
uploaded right now is not touched, the newest excepted (the caller waits for its upload to end first).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MARGIN = 1.02  # the new checkpoint's size is known to within its metadata; 2% more is asked for


def bytes_on_disk(path: Path) -> int:
    """A checkpoint file's or folder's size; 0 once it is gone."""
    try:
        if path.is_dir():
            return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return path.stat().st_size
    except OSError:
        return 0


@dataclass(frozen=True)
class Held:
    path: Path
    bytes: int
    on_hub: bool = False
    uploading: bool = False  # its upload is running now: its file is being read
    queued: bool = False  # its upload waits its turn (or runs): the Hub will have it once that ends


@dataclass
class Room:
    remove: list[Held]
    needed: int  # bytes the new checkpoint needs
    free_after: int  # the disk's free bytes once `remove` are gone
    used_after: int  # checkpoint bytes left in the folder
    fits_disk: bool
    fits_budget: bool
    wait_for_newest: bool = False  # the newest must go and its upload is still running: wait for it, then remove


def choose(held: list[Held], needed: int, free: int, budget: int | None) -> Room:
    """`held`: the checkpoints in the folder, oldest first (by global step, then time). `needed`: the new
    checkpoint's bytes."""
    needed = int(needed * MARGIN)
    used = sum(h.bytes for h in held)

    def fits(free_now: int, used_now: int) -> tuple[bool, bool]:
        return needed <= free_now, budget is None or used_now + needed <= budget

    older, newest = held[:-1], held[-1:]
    order = [h for h in older if h.on_hub and not h.uploading] + [h for h in older if not h.on_hub and not h.uploading]
    order += [h for h in newest if h.on_hub or h.queued]
    remove: list[Held] = []
    for h in order:
        if all(fits(free, used)):
            break
        remove.append(h)
        free += h.bytes
        used -= h.bytes
    disk_ok, budget_ok = fits(free, used)
    wait = bool(remove) and remove[-1] in newest and not remove[-1].on_hub
    return Room(remove, needed, free, used, disk_ok, budget_ok, wait)
