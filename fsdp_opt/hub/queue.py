"""The upload queue: the jobs of this session and their states, shared by the training thread (which submits and
asks) and the upload thread (which takes the next job and reports how it ended). Every access holds one lock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_opt.hub.store import CKPT_DIR


@dataclass
class Upload:
    path: Path
    kind: str  # "step", "epoch" (never dropped) or "export" (the final model folder, to the repo root)
    entry: dict[str, Any] = field(default_factory=dict)
    status: str = "waiting"  # waiting, uploading, done, failed, superseded
    error: str = ""
    transient: bool = False  # failed for a reason worth another round (the network, the Hub's 5xx, a timeout)
    rounds: int = 0  # the rounds of retries it has been given
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


class UploadQueue:
    """One upload at a time: a newer step checkpoint replaces a step checkpoint still waiting; epoch checkpoints and
    the export always go. `remote_names`: the checkpoints the repo holds (at start, and pushed since)."""

    def __init__(self, remote_names: set[str], log: Callable[[str], None]) -> None:
        self.jobs: list[Upload] = []
        self.remote_names = remote_names
        self.log = log
        self._done: list[Upload] = []
        self._cond = threading.Condition()
        self._closing = False

    def _latest(self, path: Path) -> Upload | None:
        return next((j for j in reversed(self.jobs) if j.name == Path(path).name), None)

    # -------------------------------------------------------- the training thread

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
        with self._cond:
            job = self._latest(path)
            if job is None:  # not written by this session: on the Hub if the repo had it at start
                return Path(path).name in self.remote_names
            if job.status == "done":
                return True
            if job.status != "superseded":  # waiting, uploading or failed: the local file is the only copy
                return False
            return any(
                j.status == "done" and j.entry.get("global_step", -1) > job.entry.get("global_step", -1)
                for j in self.jobs
            )

    def upload_state(self, path: Path) -> str | None:
        """The status of this checkpoint's latest upload job in this session (None: not submitted here)."""
        with self._cond:
            job = self._latest(path)
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
                job = self._latest(path)
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

    def not_uploaded(self) -> list[Upload]:
        with self._cond:
            return [j for j in self.jobs if j.status in ("waiting", "uploading", "failed")]

    def last_seconds(self) -> float:
        with self._cond:
            times = [j.seconds for j in self.jobs if j.status == "done"]
        return times[-1] if times else 0.0

    def close(self) -> None:
        """No more jobs come: the upload thread ends once the queue is empty."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def retryable(self) -> bool:
        with self._cond:
            return bool(self._retryable())

    def _retryable(self) -> list[Upload]:
        pushed = max((self._step(j) for j in self.jobs if j.status == "done" and j.kind != "export"), default=-1)
        return [
            j
            for j in self.jobs
            if j.status == "failed"
            and j.transient
            and j.path.exists()
            and (j.kind == "export" or self._step(j) > pushed)
        ]

    @staticmethod
    def _step(job: Upload) -> int:
        return int(job.entry.get("global_step", -1))

    # -------------------------------------------------------- the upload thread

    def next(self) -> Upload | None:
        """The next waiting job, marked uploading; None once closed and empty."""
        with self._cond:
            while True:
                job = next((j for j in self.jobs if j.status == "waiting"), None)
                if job is not None:
                    job.status = "uploading"
                    return job
                if self._closing:
                    return None
                self._cond.wait()

    def failed(self, job: Upload, error: str, transient: bool = False) -> None:
        with self._cond:
            job.status, job.error, job.transient = "failed", error, transient
            self._cond.notify_all()

    def again(self) -> list[Upload]:
        """The uploads that failed for a passing reason, their checkpoint still on disk, waiting once more; not a
        checkpoint older than one the Hub has from this session (that one is what a resume reads; pushed after it,
        the older one would take its place as the newest the repo keeps)."""
        with self._cond:
            jobs = self._retryable()
            for job in jobs:
                job.status, job.rounds = "waiting", job.rounds + 1
            self._cond.notify_all()
        return jobs

    def done(self, job: Upload, commit: str, seconds: float) -> None:
        with self._cond:
            job.status, job.commit, job.seconds = "done", commit, seconds
            if job.kind != "export":
                self.remote_names.add(job.name)
            self._done.append(job)
            self._cond.notify_all()
