"""Background uploads of checkpoints to the Hub repo: one at a time, retried, never fatal to training.

A new step checkpoint replaces a step checkpoint that is still waiting; epoch checkpoints and the exported
model always go. Each upload is one commit: the checkpoint, the index and the model card together.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fsdp_opt.checkpoint.export import weights_from_checkpoint
from fsdp_opt.checkpoint.room import bytes_on_disk as ckpt_bytes
from fsdp_opt.checkpoint.weightsfile import WEIGHTS_DIR, checkpoint_of, weights_name
from fsdp_opt.hub.retention import decide
from fsdp_opt.hub.store import (
    CARD_FILE,
    CKPT_DIR,
    INDEX_FILE,
    METRICS_IN_REPO,
    HubStore,
    describe,
    now_iso,
    with_retries,
)


@dataclass
class Upload:
    path: Path
    kind: str  # "step", "epoch" (never dropped) or "export" (the final model folder, to the repo root)
    entry: dict[str, Any] = field(default_factory=dict)
    status: str = "waiting"  # waiting, uploading, done, failed, superseded
    error: str = ""
    seconds: float = 0.0
    commit: str | None = None
    weights: Path | None = None  # its weights file, made for the push when --hub_keep_full is on
    weights_seconds: float = 0.0
    bytes: int = 0  # what the push sends: the checkpoint and its weights file
    lfs_before: dict[str, str] = field(default_factory=dict)  # the repo's LFS files before the push

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def path_in_repo(self) -> str:
        return "" if self.kind == "export" else f"{CKPT_DIR}/{self.name}"


class Uploader:
    """One upload at a time, in a background thread, so training never waits for the network."""

    def __init__(
        self,
        store: HubStore,
        render_card: Callable[[dict[str, Any]], str],
        *,
        run: dict[str, Any],
        private: bool,
        metrics: Path | None = None,
        retries: int,
        backoff: float = 2.0,
        on_uploaded: Callable[[Upload], None] | None = None,
        log: Callable[[str], None] = print,
        keep_full: int = 0,
    ) -> None:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()  # the training progress bar owns the console
        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # its retry notes; ours say the same once
        self.store, self.render_card = store, render_card
        self.private, self.retries, self.backoff = private, retries, backoff
        self.on_uploaded, self.log = on_uploaded, log
        self.repo_ready = store.ensure_repo(private, retries=1)  # unreachable: start training, retry with uploads
        files = self._try(store.files, []) if self.repo_ready else []
        self.index: dict[str, Any] = self._try(lambda: store.read_index(files), {"checkpoints": {}})
        self.index["run"] = run
        self.keep_full = keep_full  # --hub_keep_full; 0 keeps everything and deletes nothing
        # LFS objects this run removed from the head and has yet to delete from storage (a later session finishes).
        self.to_purge: set[str] = set(self.index.get("purge_pending", []))
        self.remote_names = set(store.checkpoints(files))
        self.metrics = metrics
        if metrics is not None and not metrics.exists() and METRICS_IN_REPO in files:
            # A new machine: continue the run's step log from the repo, so metrics.jsonl covers every session.
            self._try(lambda: store.fetch(METRICS_IN_REPO, metrics), None)
        self.jobs: list[Upload] = []
        self._done: list[Upload] = []
        self._warned: set[str] = set()
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._work, name="hub-uploads", daemon=True)
        self._thread.start()

    @staticmethod
    def _try(fn: Callable[[], Any], fallback: Any) -> Any:
        try:
            return fn()
        except Exception:  # noqa: BLE001 - an unreachable Hub at start is not fatal
            return fallback

    # -------------------------------------------------------- main-thread side

    def submit(self, path: Path, kind: str, entry: dict[str, Any]) -> Upload:
        job = Upload(Path(path), kind, entry)
        with self._cond:
            if kind == "step":
                for old in self.jobs:
                    if old.kind == "step" and old.status == "waiting":
                        old.status = "superseded"
                        self.log(f"hub: {old.name} is replaced by {job.name} before its upload started (kept locally)")
            self.jobs.append(job)
            self._cond.notify_all()
        return job

    def is_on_hub(self, path: Path) -> bool:
        """May --keep_last delete this local checkpoint? Only once it, or a newer checkpoint that replaced it, is up."""
        name = Path(path).name
        with self._cond:
            job = next((j for j in reversed(self.jobs) if j.name == name), None)
            if job is None:  # not written by this session: on the Hub if the repo had it at start
                return name in self.remote_names
            if job.status == "done":
                return True
            if job.status != "superseded":  # waiting, uploading or failed: the local file is the only copy
                return False
            return any(j.status == "done" and j.entry.get("global_step", -1) > job.entry.get("global_step", -1) for j in self.jobs)

    def upload_state(self, path: Path) -> str | None:
        """The status of this checkpoint's latest upload job in this session (None: not submitted here)."""
        with self._cond:
            job = next((j for j in reversed(self.jobs) if j.name == Path(path).name), None)
            return None if job is None else job.status

    def drop(self, path: Path) -> None:
        """A checkpoint removed for room before its upload started: a newer one is pushed instead."""
        with self._cond:
            for job in self.jobs:
                if job.name == Path(path).name and job.status == "waiting":
                    job.status = "superseded"

    def wait_for(self, path: Path, timeout: float) -> bool:
        """Wait up to `timeout` s for this checkpoint's upload to end; True when the Hub has it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                job = next((j for j in reversed(self.jobs) if j.name == Path(path).name), None)
                if job is None or job.status not in ("waiting", "uploading") or time.monotonic() >= deadline:
                    break
                self._cond.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        return self.is_on_hub(path)

    def take_done(self) -> list[Upload]:
        with self._cond:
            done, self._done = self._done, []
        return done

    def pending(self) -> list[Upload]:
        with self._cond:
            return [j for j in self.jobs if j.status in ("waiting", "uploading")]

    def last_seconds(self) -> float:
        with self._cond:
            times = [j.seconds for j in self.jobs if j.status == "done"]
        return times[-1] if times else 0.0

    def finish(self, timeout: float, every: float = 10.0) -> list[Upload]:
        """Wait up to `timeout` s for pending uploads, printing what is left; return those not uploaded."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        next_note = 0.0
        while self._thread.is_alive() and time.monotonic() < deadline:
            left = self.pending()
            if left and time.monotonic() >= next_note:
                size = sum(ckpt_bytes(j.path) for j in left) / 2**20
                self.log(f"hub: waiting for {len(left)} upload(s) ({size:,.1f} MiB): {', '.join(j.name for j in left)}")
                next_note = time.monotonic() + every
            self._thread.join(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        with self._cond:
            return [j for j in self.jobs if j.status in ("waiting", "uploading", "failed")]

    # -------------------------------------------------------- worker side

    def _next(self) -> Upload | None:
        with self._cond:
            while True:
                job = next((j for j in self.jobs if j.status == "waiting"), None)
                if job is not None:
                    job.status = "uploading"
                    return job
                if self._closing:
                    return None
                self._cond.wait()

    def _work(self) -> None:
        while (job := self._next()) is not None:
            started = time.monotonic()
            try:
                if self.keep_full and job.kind != "export" and job.path.exists():
                    job.weights = self._make_weights(job)
                    job.weights_seconds = time.monotonic() - started
                job.bytes = ckpt_bytes(job.path) + (ckpt_bytes(job.weights) if job.weights is not None else 0)
                commit = with_retries(lambda: self._push(job), self.retries, self.backoff, self._note_retry(job))
            except Exception as exc:  # noqa: BLE001 - a failed upload never stops training
                with self._cond:
                    job.status, job.error = "failed", describe(exc)
                    self._cond.notify_all()
                self.log(f"hub: upload of {job.name} failed ({job.error}); the local copy is kept: {job.path.resolve()}")
                continue
            finally:
                if job.weights is not None:
                    shutil.rmtree(job.weights.parent, ignore_errors=True)
            with self._cond:
                job.status, job.commit, job.seconds = "done", commit, time.monotonic() - started
                if job.kind != "export":
                    self.remote_names.add(job.name)
                self._done.append(job)
                self._cond.notify_all()
            where = "the repo root" if job.kind == "export" else job.path_in_repo
            made = f" (its weights file made first in {job.weights_seconds:.2f} s)" if job.weights is not None else ""
            self.log(f"hub: pushed {job.name} to {self.store.repo_id} ({where}): {job.bytes / 1e9:,.2f} GB in "
                     f"{job.seconds - job.weights_seconds:.1f} s{made}")  # fmt: skip
            if self.on_uploaded is not None:
                try:
                    self.on_uploaded(job)
                except Exception as exc:  # noqa: BLE001
                    self.log(f"hub: after the upload of {job.name}: {describe(exc)}")
            if self.keep_full:
                try:
                    # Only now, with the newer checkpoint confirmed in the repo, may older ones go.
                    with_retries(lambda: self._retain(job), self.retries, self.backoff)
                except Exception as exc:  # noqa: BLE001 - retried after the next push; never fatal
                    self.log(f"hub: keeping the repo to --hub_keep_full {self.keep_full} failed ({describe(exc)}); "
                             "tried again after the next upload")  # fmt: skip

    def _make_weights(self, job: Upload) -> Path:
        """The job's weights file, in a hidden staging folder beside the checkpoint (removed after the push)."""
        staging = job.path.parent / f".upload-{job.name}"
        shutil.rmtree(staging, ignore_errors=True)
        return weights_from_checkpoint(job.path, staging / weights_name(job.name))

    def _note_retry(self, job: Upload) -> Callable[[int, float, BaseException], None]:
        def note(attempt: int, delay: float, exc: BaseException) -> None:
            self.log(f"hub: upload of {job.name} failed ({describe(exc)}); retry {attempt}/{self.retries} in {delay:.0f} s")

        return note

    def _push(self, job: Upload) -> str:
        from huggingface_hub import CommitOperationAdd

        if not self.repo_ready:
            self.repo_ready = self.store.ensure_repo(self.private)
            if not self.repo_ready:
                raise ConnectionError(f"cannot reach the Hub to create {self.store.repo_id}")
        if not job.path.exists():
            raise FileNotFoundError(f"{job.path} is gone")
        ops = []
        if job.path.is_dir():
            for f in sorted(p for p in job.path.rglob("*") if p.is_file()):
                rel = f.relative_to(job.path).as_posix()
                ops.append(CommitOperationAdd(f"{job.path_in_repo}/{rel}".lstrip("/"), str(f)))
        else:
            ops.append(CommitOperationAdd(job.path_in_repo, str(job.path)))
        index = json.loads(json.dumps(self.index))  # committed only if the push succeeds
        if job.kind == "export":
            index["export"] = {**job.entry, "date": now_iso()}
        else:
            weights = f"{WEIGHTS_DIR}/{job.weights.name}" if job.weights is not None else None
            if weights is not None:
                ops.append(CommitOperationAdd(weights, str(job.weights)))
            index["checkpoints"][job.name] = {**job.entry, "path": job.path_in_repo, "date": now_iso(), "full": True,
                                              "weights": weights}  # fmt: skip
        if job.kind == "export":
            ops = [op for op in ops if op.path_in_repo != CARD_FILE]  # the card is ours
        if self.metrics is not None and self.metrics.exists():
            log = self.metrics.read_bytes()
            ops.append(CommitOperationAdd(METRICS_IN_REPO, log[: log.rfind(b"\n") + 1]))  # whole lines only
        if self.keep_full:
            job.lfs_before = self.store.lfs_at_head()
        step = job.entry.get("global_step")
        message = f"fsdp-opt: {job.name}" + (f" (global step {step})" if step is not None else "")
        return self._commit(ops, index, message)

    def _commit(self, ops: list, index: dict[str, Any], message: str) -> str:
        """One commit of `ops` with the index and the model card rendered from it; the index is ours once it lands."""
        from huggingface_hub import CommitOperationAdd

        index["purge_pending"] = sorted(self.to_purge)
        ops = ops + [
            CommitOperationAdd(INDEX_FILE, json.dumps(index, indent=1, sort_keys=True).encode()),
            CommitOperationAdd(CARD_FILE, self.render_card(index).encode()),
        ]
        try:
            info = self.store.api.create_commit(self.store.repo_id, ops, commit_message=message)
        except Exception:
            # Objects uploaded for a commit that did not land use storage that no file points to: purge them with
            # the next cleanup (which skips any the head does use, in case the commit landed after all).
            uploaded = {op.upload_info.sha256.hex() for op in ops
                        if getattr(op, "_upload_mode", None) == "lfs" and op.upload_info.is_hashed}  # fmt: skip
            if self.keep_full:
                self.to_purge |= uploaded
            raise
        self.index = index
        return info.oid

    def _retain(self, job: Upload) -> None:
        """After a confirmed push: keep the newest --hub_keep_full full checkpoints and one weights file per range,
        then delete from storage the LFS objects this run took off the head (never one the head still uses).

        The objects to delete are written to the index before the delete is tried, so a session that cannot
        finish it leaves it to the next one."""
        from huggingface_hub import CommitOperationDelete

        files = self.store.files()
        now = self.store.lfs_at_head()
        self.to_purge |= {sha for path, sha in job.lfs_before.items() if now.get(path) != sha}  # replaced by the push
        full_paths, weight_paths = self.store.checkpoints(files), self.store.weights(files)
        steps = {n: int(e.get("global_step", -1)) for n, e in self.index["checkpoints"].items()}
        d = decide(steps, set(full_paths), set(weight_paths), self.keep_full)
        for name in d.kept_without_weights:
            if name not in self._warned:
                self._warned.add(name)
                self.log(f"hub: keeping the full {name}: the repo has no weights file of it to keep in its place")
        index = json.loads(json.dumps(self.index))
        ops = []
        for name in d.delete_full:
            path = full_paths[name]
            ops.append(CommitOperationDelete(path, is_folder=path not in files))
            index["checkpoints"].setdefault(name, {})["full"] = False
            self.to_purge |= {sha for p, sha in now.items() if p == path or p.startswith(path + "/")}
        for w in d.delete_weights:
            ops.append(CommitOperationDelete(weight_paths[w]))
            index["checkpoints"].setdefault(checkpoint_of(w), {})["weights"] = None
            self.to_purge |= {now[weight_paths[w]]} if weight_paths[w] in now else set()
        if ops:
            self._commit(ops, index, f"fsdp-opt: keep the newest {self.keep_full} full checkpoint(s) and one weights "
                                     "file per range (--hub_keep_full)")  # fmt: skip
            self.log(f"hub: retired {', '.join(d.delete_full + d.delete_weights)}; full: {', '.join(d.keep_full)}; "
                     f"weights files: {', '.join(d.keep_weights) or 'none'}")  # fmt: skip
        elif self.to_purge and sorted(self.to_purge) != self.index.get("purge_pending"):
            self._commit([], index, "fsdp-opt: storage to free")
        self.to_purge -= set(self.store.lfs_at_head().values())
        freed = self.store.purge(self.to_purge)
        self.to_purge.clear()
        self.update_storage(freed)

    def update_storage(self, freed: int = 0) -> None:
        """Record the repo's storage in the index (and the card) when it changed."""
        size = self.store.used_storage()
        pending_changed = self.index.get("purge_pending", []) != sorted(self.to_purge)
        if size is None or (size == self.index.get("storage", {}).get("bytes") and not pending_changed):
            return
        index = json.loads(json.dumps(self.index))
        files = self.store.files()
        index["storage"] = {"bytes": size, "date": now_iso(), "full_checkpoints": len(self.store.checkpoints(files)),
                            "weights_files": len(self.store.weights(files))}  # fmt: skip
        self._commit([], index, "fsdp-opt: repo storage")
        if freed:
            self.log(f"hub: freed {freed / 1e9:,.2f} GB of the repo's storage; it holds {size / 1e9:,.2f} GB")
