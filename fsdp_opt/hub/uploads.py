"""Background uploads of checkpoints to the Hub repo: one at a time, retried, never fatal to training.

The Uploader joins the two halves: the queue (`queue.UploadQueue`: jobs and their states, asked by the training
thread) and the repo (`commits.RepoWriter`: one commit per upload, then retention), with a thread between them that
makes each job's weights file (--hub_keep_full), pushes it with retries and reports how it ended.

What is retried: every call of a push (the preupload, each LFS upload, the commit) that fails for a passing reason:
a network error or a reset connection, no answer within IO_S, a 5xx, a 429 (after the Retry-After it gives), a 408,
and a 409 or 412 (another commit at the same time). --hub_retries times with a doubling wait, at first; an upload that
still failed gets further rounds at the session's end, until --hub_wait is spent. A refusal (401, 403, a 404 of the
repo, a quota) ends the retrying at once, with the Hub's reason.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from huggingface_hub.utils import disable_progress_bars

from fsdp_opt.checkpoint.export import weights_from_checkpoint
from fsdp_opt.checkpoint.room import bytes_on_disk
from fsdp_opt.checkpoint.weightsfile import weights_name
from fsdp_opt.hub.commits import RepoWriter
from fsdp_opt.hub.queue import Upload, UploadQueue
from fsdp_opt.hub.retry import describe, is_transient, with_retries
from fsdp_opt.hub.store import METRICS_IN_REPO, HubStore


def _try(fn: Callable[[], Any], fallback: Any) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - an unreachable Hub at start is not fatal
        return fallback


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
        lease: Any = None,
    ) -> None:
        disable_progress_bars()  # the training progress bar owns the console
        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # its retry notes; ours say the same once
        self.store, self.retries, self.backoff, self.on_uploaded, self.log = store, retries, backoff, on_uploaded, log
        ready = store.ensure_repo(private, retries=1)  # unreachable: start training, retry with uploads
        files = _try(store.files, []) if ready else []
        index: dict[str, Any] = _try(lambda: store.read_index(files), {"checkpoints": {}})
        index["run"] = run
        if metrics is not None and not metrics.exists() and METRICS_IN_REPO in files:
            # A new machine: continue the run's step log from the repo, so metrics.jsonl covers every session.
            _try(lambda: store.fetch(METRICS_IN_REPO, metrics), None)
        # keep_full: --hub_keep_full; 0 keeps everything and deletes nothing
        self.repo = RepoWriter(
            store,
            render_card,
            index=index,
            private=private,
            metrics=metrics,
            keep_full=keep_full,
            repo_ready=ready,
            log=log,
            lease=lease,
        )
        self.queue = UploadQueue(set(store.checkpoints(files)), log)
        self._thread = threading.Thread(target=self._work, name="hub-uploads", daemon=True)
        self._thread.start()

    # The training thread's questions go to the queue.
    def submit(self, path: Path, kind: str, entry: dict[str, Any]) -> Upload:
        return self.queue.submit(path, kind, entry)

    def is_on_hub(self, path: Path) -> bool:
        return self.queue.is_on_hub(path)

    def upload_state(self, path: Path) -> str | None:
        return self.queue.upload_state(path)

    def drop(self, path: Path) -> None:
        self.queue.drop(path)

    def wait_for(self, path: Path, timeout: float) -> bool:
        return self.queue.wait_for(path, timeout)

    def take_done(self) -> list[Upload]:
        return self.queue.take_done()

    def pending(self) -> list[Upload]:
        return self.queue.pending()

    def last_seconds(self) -> float:
        return self.queue.last_seconds()

    @property
    def jobs(self) -> list[Upload]:
        return self.queue.jobs

    @property
    def index(self) -> dict[str, Any]:
        return self.repo.index

    @property
    def repo_ready(self) -> bool:
        return self.repo.repo_ready

    def finish(self, timeout: float, every: float = 10.0, pause: float = 30.0) -> list[Upload]:
        """Wait up to `timeout` s for pending uploads, printing what is left, and give those that failed for a
        passing reason further rounds (`pause` s apart) while the time lasts; return those not uploaded."""
        deadline = time.monotonic() + timeout
        self.queue.close()
        next_note = 0.0
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                again = [j for j in self.queue.not_uploaded() if j.status == "failed" and j.transient]
                if not again or not self.queue.retryable():  # nothing, or only checkpoints older than one pushed
                    break
                wait = min(pause * 2 ** min(again[0].rounds, 3), max(0.0, deadline - time.monotonic() - 1.0))
                self.log(
                    f"hub: {len(again)} upload(s) failed for a passing reason ({again[0].error}): trying again in "
                    f"{wait:.0f} s, --hub_wait leaves {deadline - time.monotonic():.0f} s"
                )
                time.sleep(wait)
                if time.monotonic() >= deadline - 1.0 or not self.queue.again():
                    break
                self._thread = threading.Thread(target=self._work, name="hub-uploads", daemon=True)
                self._thread.start()
            left = self.queue.pending()
            if left and time.monotonic() >= next_note:
                size = sum(bytes_on_disk(j.path) for j in left) / 2**20
                self.log(f"hub: waiting for {len(left)} upload(s) ({size:,.1f} MiB): {', '.join(j.name for j in left)}")
                next_note = time.monotonic() + every
            self._thread.join(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        return self.queue.not_uploaded()

    def _work(self) -> None:
        while (job := self.queue.next()) is not None:
            started = time.monotonic()
            try:
                if self.repo.keep_full and job.kind != "export" and job.path.exists():
                    job.weights = self._make_weights(job)
                    job.weights_seconds = time.monotonic() - started
                job.bytes = bytes_on_disk(job.path) + (bytes_on_disk(job.weights) if job.weights is not None else 0)
                commit = with_retries(
                    lambda: self.repo.push(job), self.retries, self.backoff, self._note_retry(job), conflicts=True
                )
            except Exception as exc:  # noqa: BLE001 - a failed upload never stops training
                passing = is_transient(exc, conflicts=True)
                self.queue.failed(job, describe(exc), passing)
                then = "tried again at the session's end" if passing else "the Hub refused it: not tried again"
                self.log(
                    f"hub: upload of {job.name} failed ({job.error}; {then}); the local copy is kept: "
                    f"{job.path.resolve()}"
                )
                continue
            finally:
                if job.weights is not None:
                    shutil.rmtree(job.weights.parent, ignore_errors=True)
            self.queue.done(job, commit, time.monotonic() - started)
            where = "the repo root" if job.kind == "export" else job.path_in_repo
            made = f" (its weights file made first in {job.weights_seconds:.2f} s)" if job.weights is not None else ""
            self.log(
                f"hub: pushed {job.name} to {self.store.repo_id} ({where}): {job.bytes / 1e9:,.2f} GB in "
                f"{job.seconds - job.weights_seconds:.1f} s{made}"
            )
            if self.on_uploaded is not None:
                try:
                    self.on_uploaded(job)
                except Exception as exc:  # noqa: BLE001
                    self.log(f"hub: after the upload of {job.name}: {describe(exc)}")
            if self.repo.keep_full:
                try:
                    # Only now, with the newer checkpoint confirmed in the repo, may older ones go.
                    with_retries(lambda: self.repo.retain(job), self.retries, self.backoff)
                except Exception as exc:  # noqa: BLE001 - retried after the next push; never fatal
                    self.log(
                        f"hub: keeping the repo to --hub_keep_full {self.repo.keep_full} failed ({describe(exc)}); "
                        "tried again after the next upload"
                    )

    def _make_weights(self, job: Upload) -> Path:
        """The job's weights file, in a hidden staging folder beside the checkpoint (removed after the push)."""
        staging = job.path.parent / f".upload-{job.name}"
        shutil.rmtree(staging, ignore_errors=True)
        return weights_from_checkpoint(job.path, staging / weights_name(job.name))

    def _note_retry(self, job: Upload) -> Callable[[int, float, BaseException], None]:
        def note(attempt: int, delay: float, exc: BaseException) -> None:
            self.log(
                f"hub: upload of {job.name} failed ({describe(exc)}); retry {attempt}/{self.retries} in {delay:.0f} s"
            )

        return note
