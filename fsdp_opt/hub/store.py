"""The Hugging Face Hub as the checkpoint store: the repo, background uploads, and finding a checkpoint to resume.

Repo layout (`--hf_repo user/name`):
  checkpoints/<name>.pt          one full checkpoint per save (a sharded checkpoint is a folder of that name)
  fsdp_opt_index.json            what each checkpoint is: global step, epoch, slice, loss, date
  metrics.jsonl                  the step log of every session so far (a new machine continues it)
  README.md                      the model card, rewritten from the index after every push
  config.json, model.safetensors, tokenizer files ...   the final model, with --export_hf

Uploads run in the background (uploads.py). Only rank 0 talks to the Hub. The token is huggingface_hub's own (HF_TOKEN or `hf auth login`); this module
never reads, prints or stores it.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fsdp_opt.base import CheckpointError, ConfigError
from fsdp_opt.checkpoint.files import checkpoint_step, find_checkpoint, latest_checkpoint
from fsdp_opt.checkpoint.names import SUFFIX, parse_name
from fsdp_opt.checkpoint.read import read_checkpoint
from fsdp_opt.checkpoint.weightsfile import SUFFIX as WEIGHTS_SUFFIX
from fsdp_opt.checkpoint.weightsfile import WEIGHTS_DIR, checkpoint_of, weights_name
from fsdp_opt.data.pin import PIN_KEY
from fsdp_opt.hub.retry import CONNECT_S, IO_S, describe, is_transient, set_timeouts, status_code, with_retries

CKPT_DIR = "checkpoints"

INDEX_FILE = "fsdp_opt_index.json"

CARD_FILE = "README.md"

METRICS_IN_REPO = "metrics.jsonl"  # every session's step log, appended to in turn


def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------- reading the repo


class HubStore:
    """One repo on the Hub (rank 0 only)."""

    def __init__(
        self,
        repo_id: str,
        retries: int = 3,
        backoff: float = 2.0,
        endpoint: str | None = None,
        io_timeout: float = IO_S,
    ) -> None:
        from huggingface_hub import HfApi

        self.repo_id = repo_id
        self.api = HfApi(endpoint=endpoint)  # endpoint None: HF_ENDPOINT or huggingface.co
        self.retries, self.backoff = retries, backoff
        set_timeouts(CONNECT_S, io_timeout)

    def _call(self, fn: Callable[[], Any]) -> Any:
        return with_retries(fn, self.retries, self.backoff)

    def file_url(self, path_in_repo: str, revision: str = "main") -> str:
        return f"{self.api.endpoint}/{self.repo_id}/resolve/{revision}/{path_in_repo}"

    def ensure_repo(self, private: bool, retries: int | None = None) -> bool:
        """Create the repo if it is missing. False when the Hub cannot be reached now (uploads try again later)."""
        tries = self.retries if retries is None else retries
        try:
            with_retries(
                lambda: self.api.create_repo(self.repo_id, private=private, exist_ok=True), tries, self.backoff
            )
            return True
        except Exception as exc:  # noqa: BLE001
            if status_code(exc) in (401, 403):
                raise ConfigError(
                    f"--hf_repo {self.repo_id}: the Hub refused to create or open the repo ({describe(exc)}). "
                    "Set HF_TOKEN to a token with write access, or run `hf auth login`."
                ) from None
            if not is_transient(exc):
                raise ConfigError(f"--hf_repo {self.repo_id}: {describe(exc)}") from None
            return False

    def files(self) -> list[str]:
        """Every file path in the repo; [] when the repo does not exist yet."""
        from huggingface_hub.errors import RepositoryNotFoundError

        try:
            return list(self._call(lambda: self.api.list_repo_files(self.repo_id)))
        except RepositoryNotFoundError:
            return []

    def read_index(self, files: list[str] | None = None) -> dict[str, Any]:
        files = self.files() if files is None else files
        if INDEX_FILE not in files:
            return {"checkpoints": {}}
        with tempfile.TemporaryDirectory() as tmp:
            try:
                index = json.loads(self.fetch(INDEX_FILE, Path(tmp) / INDEX_FILE).read_text())
            except ValueError:
                return {"checkpoints": {}}
        index.setdefault("checkpoints", {})
        return index

    def checkpoints(self, files: list[str] | None = None) -> dict[str, str]:
        """Checkpoint name -> its path in the repo (under checkpoints/, or at the root as older repos have them)."""
        files = self.files() if files is None else files
        found: dict[str, str] = {}
        for f in files:
            parts = f.split("/")
            if parts[0] == CKPT_DIR and len(parts) >= 2 and parse_name(parts[1]):
                found[parts[1]] = f"{CKPT_DIR}/{parts[1]}"
            elif len(parts) == 1 and f.endswith(SUFFIX) and parse_name(f):
                found.setdefault(f, f)
        return found

    def weights(self, files: list[str] | None = None) -> dict[str, str]:
        """Weights file name -> its path in the repo (weights/<name>.safetensors)."""
        files = self.files() if files is None else files
        prefix = f"{WEIGHTS_DIR}/"
        return {
            f[len(prefix) :]: f
            for f in files
            if f.startswith(prefix) and f.endswith(WEIGHTS_SUFFIX) and f.count("/") == 1
        }

    def lfs_at_head(self) -> dict[str, str]:
        """Path -> sha256 of every file the head keeps in LFS storage."""
        from huggingface_hub.errors import RepositoryNotFoundError

        try:
            entries = self._call(lambda: list(self.api.list_repo_tree(self.repo_id, recursive=True)))
        except RepositoryNotFoundError:
            return {}
        return {e.path: e.lfs.sha256 for e in entries if getattr(e, "lfs", None) is not None}

    def purge(self, shas: set[str]) -> int:
        """Permanently delete these LFS objects from the repo's storage (history included); returns their bytes."""
        if not shas:
            return 0
        found = [
            f for f in self._call(lambda: list(self.api.list_lfs_files(self.repo_id))) if {f.file_oid, f.oid} & shas
        ]
        if found:
            self._call(lambda: self.api.permanently_delete_lfs_files(self.repo_id, found))
        return sum(f.size for f in found)

    def used_storage(self) -> int | None:
        """Bytes the repo's storage holds (deleted files' objects included until purged), as the Hub reports it."""
        info = self._call(lambda: self.api.model_info(self.repo_id, expand=["usedStorage"]))
        return getattr(info, "used_storage", None)

    def latest(self) -> tuple[str, int] | None:
        files = self.files()
        index = self.read_index(files)["checkpoints"]
        scored = []
        for name in self.checkpoints(files):
            step = index.get(name, {}).get("global_step")
            if step is None:
                parsed = parse_name(name)
                step = parsed["step"] if parsed and parsed["step"] is not None else -1
            scored.append((int(step), name))
        scored = [s for s in scored if s[0] >= 0]
        if not scored:
            return None
        step, name = max(scored)
        return name, step

    def fetch(self, path_in_repo: str, dest: Path) -> Path:
        """One repo file to `dest`, appearing there whole (downloaded beside it, then renamed)."""
        from huggingface_hub import hf_hub_download

        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=dest.parent) as staging:
            got = self._call(
                lambda: hf_hub_download(
                    self.repo_id, path_in_repo, local_dir=staging, endpoint=self.api.endpoint, token=self.api.token
                )
            )
            Path(got).rename(dest)
        return dest

    def download(self, name: str, out_dir: Path) -> Path:
        """Fetch checkpoint `name` into out_dir/name (a file or a sharded folder); the rename makes it appear whole."""
        from huggingface_hub import snapshot_download

        files = self.files()
        where = self.checkpoints(files).get(name)
        if where is None:
            raise KeyError(name)
        dest = out_dir / name
        if where in files:
            return self.fetch(where, dest)
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=out_dir) as staging:
            self._call(
                lambda: snapshot_download(
                    self.repo_id,
                    allow_patterns=[f"{where}/*"],
                    local_dir=staging,
                    endpoint=self.api.endpoint,
                    token=self.api.token,
                )
            )
            (Path(staging) / where).rename(dest)
        return dest


def _timed(download: Callable[[], Path]) -> Path:
    """Run a download and say how many bytes came in how long."""
    started = time.perf_counter()
    path = download()
    seconds = time.perf_counter() - started
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
    print(
        f"downloaded {path.name}: {size / 1e9:,.2f} GB in {seconds:.1f} s ({size / 1e6 / max(seconds, 1e-9):,.0f} MB/s)"
    )
    return path


def newest_checkpoint(
    out_dir: Path, repo_id: str | None, retries: int = 3, flag: str = "--resume_file latest", strict: bool = False
) -> tuple[str, int, Path | None] | None:
    """(name, global step, local path or None) of the checkpoint with the highest global step in output_dir and, with
    repo_id, the Hub repo; a local copy wins a tie. A repo that cannot be read: with a local checkpoint, a warning
    (or with `strict`, an error: the caller must not guess), without one an error. None: no checkpoint anywhere."""
    local = latest_checkpoint(out_dir)
    found = None if local is None else (local.name, checkpoint_step(local), local)
    if not repo_id:
        return found
    try:
        remote = HubStore(repo_id, retries=retries).latest()
    except Exception as exc:  # noqa: BLE001 - network, auth: one line
        if local is None or strict:
            raise CheckpointError(f"{flag}: cannot read the Hub repo {repo_id}: {describe(exc)}") from None
        print(f"warning: cannot read the Hub repo {repo_id} ({describe(exc)}); using {local}")
        return found
    if remote is not None and (found is None or remote[1] > found[1]):
        return remote[0], remote[1], None
    return found


def newest_pin(newest: tuple[str, int, Path | None], repo_id: str | None, retries: int = 3) -> dict[str, Any] | None:
    """The data pin of the newest checkpoint (newest_checkpoint's answer): a local one's, read from its file (mapped,
    not loaded), or the Hub index entry's. None when it has none or it cannot be read: the caller reads the data's own
    metadata instead."""
    name, _, path = newest
    try:
        if path is not None:
            return read_checkpoint(path).get(PIN_KEY)
        return HubStore(repo_id, retries=retries).read_index()["checkpoints"].get(name, {}).get(PIN_KEY)
    except Exception:  # noqa: BLE001 - only a shortcut: without it the split's metadata is read
        return None


def resume_pin(name: str, out_dir: Path, repo_id: str | None, retries: int = 3) -> dict[str, Any] | None:
    """--resume_file's data pin without reading the checkpoint whole or downloading it: a local file's (mapped), or
    the repo's index entry for the name ("latest": the newest one's). None when neither says, or on any error (a
    shortcut only: the run checks the pin again once it has read the checkpoint)."""
    try:
        if name == "latest":
            newest = newest_checkpoint(out_dir, repo_id, retries)
            return newest_pin(newest, repo_id, retries) if newest else None
        for path in (Path(name), out_dir / name):
            if path.exists():
                return newest_pin((path.name, 0, path), None)
        return newest_pin((Path(name).name, 0, None), repo_id, retries) if repo_id else None
    except Exception:  # noqa: BLE001
        return None


def find_resume(name: str, out_dir: Path, repo_id: str | None, retries: int = 3, flag: str = "--resume_file") -> Path:
    """--resume_file: a path, then a name in output_dir, then a checkpoint of --hf_repo (downloaded to output_dir).

    `latest` is the highest global step among output_dir and the repo; a local copy wins a tie.
    """
    if name == "latest":
        newest = newest_checkpoint(out_dir, repo_id, retries, f"{flag} latest")
        if newest is None:
            where = f"{out_dir} or in the Hub repo {repo_id}" if repo_id else str(out_dir)
            raise CheckpointError(f"{flag} latest: no checkpoint in {where}")
        if newest[2] is not None:
            return newest[2]
        name = newest[0]
        print(f"latest checkpoint is {name} (global step {newest[1]}) in the Hub repo {repo_id}; downloading")
        try:
            return _timed(lambda: HubStore(repo_id, retries=retries).download(name, out_dir))
        except Exception as exc:  # noqa: BLE001 - network, auth: one line
            raise CheckpointError(
                f"{flag} latest: cannot download {name} from the Hub repo {repo_id}: {describe(exc)}"
            ) from None
    if not repo_id:
        return find_checkpoint(out_dir, name, flag)
    try:
        return find_checkpoint(out_dir, name, flag)
    except CheckpointError as local_miss:
        local_error = str(local_miss)
    store = HubStore(repo_id, retries=retries)
    try:
        files = store.files()
        remote_names = store.checkpoints(files)
        if name in remote_names:
            print(f"downloading {name} from the Hub repo {repo_id}")
            return _timed(lambda: store.download(name, out_dir))
        weights = store.weights(files).get(name if name.endswith(WEIGHTS_SUFFIX) else weights_name(name))
        if weights is not None:
            print(
                f"only the weights of {checkpoint_of(weights)} are left in the Hub repo {repo_id} (--hub_keep_full "
                f"retired its full state); downloading {weights}"
            )
            return _timed(lambda: store.fetch(weights, out_dir / Path(weights).name))
        listing = ", ".join(sorted(remote_names)[:10]) or "none"
        raise CheckpointError(f"{local_error}; not in the Hub repo {repo_id} either (checkpoints there: {listing})")
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - network, auth: one line
        raise CheckpointError(f"{flag} {name}: cannot read the Hub repo {repo_id}: {describe(exc)}") from None


def read_resume(
    resume_file: str | None, out_dir: Path, hf_repo: str | None = None, retries: int = 3
) -> dict[str, Any] | None:
    """Rank 0: find the checkpoint (path, output_dir, then the Hub repo) and read it."""
    if not resume_file:
        return None

    path = find_resume(resume_file, out_dir, hf_repo, retries)
    payload = read_checkpoint(path)
    payload["_path"] = str(path)
    return payload
