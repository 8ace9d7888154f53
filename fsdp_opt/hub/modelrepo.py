"""An exported folder pushed as a Hub model repo in one commit, through the Hub's passing faults as checkpoints are
(hub/retry.py): `AutoModelForCausalLM.from_pretrained("user/name")` loads it. A repo the token cannot write ends in
one line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd

from fsdp_opt.base import ConfigError
from fsdp_opt.hub.retry import describe, with_retries
from fsdp_opt.hub.store import CARD_FILE, HubStore


def read_chain_index(
    repo_id: str | None, retries: int = 2, log: Callable[[str], None] = print
) -> dict[str, Any] | None:
    """The checkpoint repo's index (fsdp_opt_index.json), or None when there is no repo or the Hub does not answer."""
    if not repo_id:
        return None
    try:
        index = HubStore(repo_id, retries=retries, backoff=1.0).read_index()
    except Exception as exc:  # noqa: BLE001 - the card then says what the checkpoint itself records
        log(
            f"note: the chain's index in {repo_id} cannot be read ({describe(exc)}); the card uses the checkpoint's own record"
        )
        return None
    return index if index.get("checkpoints") else None


def push_folder(
    repo_id: str,
    folder: Path,
    card: str,
    *,
    private: bool,
    retries: int = 5,
    log: Callable[[str], None] = print,
) -> str:
    """Every file of `folder` and the card as README.md, one commit to the model repo; returns the commit id."""
    store = HubStore(repo_id, retries=retries)
    flag = f"--push_to_hub {repo_id}"
    try:
        ready = store.ensure_repo(private)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace(f"--hf_repo {repo_id}", flag)) from None
    if not ready:
        raise ConfigError(f"{flag}: the Hub cannot be reached; the exported folder is kept: {folder}")
    ops = [
        CommitOperationAdd(f.relative_to(folder).as_posix(), str(f))
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f.name != CARD_FILE
    ]
    ops.append(CommitOperationAdd(CARD_FILE, card.encode()))
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())

    def note(attempt: int, delay: float, exc: BaseException) -> None:
        log(f"hub: push to {repo_id} failed ({describe(exc)}); retry {attempt}/{retries} in {delay:.0f} s")

    try:
        info = with_retries(
            lambda: store.api.create_commit(repo_id, ops, commit_message="fsdp-opt: exported model"),
            retries,
            store.backoff,
            note,
            conflicts=True,
        )
    except Exception as exc:  # noqa: BLE001 - one line, the folder kept
        raise ConfigError(
            f"{flag}: the Hub refused the push ({describe(exc)}); the exported folder is kept: {folder}"
        ) from None
    log(f"hub: pushed {len(ops)} files ({size / 1e9:,.2f} GB) to {repo_id} (commit {info.oid[:8]})")
    return info.oid
