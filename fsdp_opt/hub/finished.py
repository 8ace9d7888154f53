"""A range trained already: its epoch-end checkpoint found in --output_dir or in the Hub repo, with what it trained
with, so that a session asked to train it again says it is done (or that its settings changed) before it takes the
chain's lease or builds anything."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_opt.checkpoint.names import STEP_KEY, list_checkpoints, parse_name
from fsdp_opt.checkpoint.read import read_checkpoint
from fsdp_opt.checkpoint.weightsfile import checkpoint_of, weights_name
from fsdp_opt.data.pin import PIN_KEY
from fsdp_opt.hub.store import HubStore


@dataclass(frozen=True)
class Finished:
    """A range's epoch-end checkpoint: where, its global step, and what it trained with (the flags, the global batch,
    the data pin; None where a repo's index written by an older version does not say)."""

    name: str
    where: str  # "--output_dir DIR" or "the Hub repo ID"
    global_step: int | None
    config: dict[str, Any] | None
    global_batch: int | None
    pin: dict[str, Any] | None


def _finished(match: Callable[[dict[str, Any]], bool]) -> Callable[[str], bool]:
    def finished(name: str) -> bool:
        parsed = parse_name(name)
        return parsed is not None and parsed["step"] is None and match(parsed)

    return finished


def finished_here(match: Callable[[dict[str, Any]], bool], out_dir: Path) -> Finished | None:
    """The first epoch-end checkpoint of output_dir whose parsed name (names.parse_name) `match` accepts, its flags
    read from the file (mapped, not loaded); one that cannot be read raises (CheckpointError, naming it)."""
    finished = _finished(match)
    for path in list_checkpoints(out_dir):
        if finished(path.name):
            payload = read_checkpoint(path, "--output_dir")
            step = payload.get(STEP_KEY)
            return Finished(
                path.name,
                f"--output_dir {out_dir}",
                None if step is None else int(step),
                payload.get("config"),
                payload.get("global_batch"),
                payload.get(PIN_KEY),
            )
    return None


def finished_in_repo(match: Callable[[dict[str, Any]], bool], repo_id: str, retries: int = 1) -> Finished | None:
    """The same in the Hub repo: a full checkpoint, a weights file that outlived it, or an entry of the index, which
    holds its flags. A repo that cannot be read raises."""
    finished = _finished(match)
    store = HubStore(repo_id, retries=retries)
    files = store.files()
    index = store.read_index(files)["checkpoints"]
    names = [*index, *store.checkpoints(files), *(checkpoint_of(w) for w in store.weights(files))]
    name = next((n for n in names if finished(n)), None)
    if name is None:
        return None
    entry = index.get(name, {})
    return Finished(
        name,
        f"the Hub repo {repo_id}",
        entry.get("global_step"),
        entry.get("config"),
        entry.get("global_batch"),
        entry.get(PIN_KEY),
    )


def resume_found(name: str, out_dir: Path, repo_id: str | None, retries: int = 1) -> bool:
    """Whether --resume_file NAME is where the run will look for it (a path, output_dir, the repo's checkpoints or
    their weights files), without reading or downloading it: a range found trained is done only for a session whose
    flags hold, and a name found nowhere is that flag's own error, in its place."""
    if Path(name).expanduser().exists() or (out_dir / name).exists():
        return True
    if not repo_id:
        return False
    store = HubStore(repo_id, retries=retries)
    try:
        files = store.files()
    except Exception:  # noqa: BLE001 - the repo cannot be read now: where the run reads the name, it says so
        return True
    return name in store.checkpoints(files) or weights_name(name) in store.weights(files)
