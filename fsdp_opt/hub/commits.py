"""The repo's side of an upload: one commit per checkpoint with the index and the model card, and --hub_keep_full's
retention after a confirmed push (older full checkpoints and weights files off the head, then their storage freed).

The index (fsdp_opt_index.json) is the repo's own record of the run: checkpoints, the export, storage, and the LFS
objects still to purge. A commit's index becomes ours only once the commit lands."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, CommitOperationDelete

from fsdp_opt.checkpoint.weightsfile import WEIGHTS_DIR, checkpoint_of
from fsdp_opt.hub.lease import HubLease
from fsdp_opt.hub.queue import Upload
from fsdp_opt.hub.retention import decide
from fsdp_opt.hub.store import CARD_FILE, INDEX_FILE, METRICS_IN_REPO, HubStore, now_iso


class LeaseLost(RuntimeError):
    """Another session took the chain's lease over: this one must not write to the repo."""


class RepoWriter:
    """Commits to the run's repo. Used by the upload thread only."""

    def __init__(
        self,
        store: HubStore,
        render_card: Callable[[dict[str, Any]], str],
        *,
        index: dict[str, Any],
        private: bool,
        metrics: Path | None,
        keep_full: int,
        repo_ready: bool,
        log: Callable[[str], None],
        lease: HubLease | None = None,
    ) -> None:
        self.store, self.render_card, self.index, self.lease = store, render_card, index, lease
        self.private, self.metrics, self.keep_full, self.repo_ready, self.log = (
            private,
            metrics,
            keep_full,
            repo_ready,
            log,
        )
        # LFS objects this run removed from the head and has yet to delete from storage (a later session finishes).
        self.to_purge: set[str] = set(index.get("purge_pending", []))
        self._warned: set[str] = set()

    def push(self, job: Upload) -> str:
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
            index["checkpoints"][job.name] = {
                **job.entry,
                "path": job.path_in_repo,
                "date": now_iso(),
                "full": True,
                "weights": weights,
            }
        if job.kind == "export":
            ops = [op for op in ops if op.path_in_repo != CARD_FILE]  # the card is ours
        if self.metrics is not None and self.metrics.exists():
            log = self.metrics.read_bytes()
            ops.append(CommitOperationAdd(METRICS_IN_REPO, log[: log.rfind(b"\n") + 1]))  # whole lines only
        if self.keep_full:
            job.lfs_before = self.store.lfs_at_head()
        step = job.entry.get("global_step")
        message = f"fsdp-opt: {job.name}" + (f" (global step {step})" if step is not None else "")
        return self.commit(ops, index, message)

    def commit(self, ops: list, index: dict[str, Any], message: str) -> str:
        """One commit of `ops` with the index and the model card rendered from it; the index is ours once it lands."""
        index["purge_pending"] = sorted(self.to_purge)
        ops = ops + [
            CommitOperationAdd(INDEX_FILE, json.dumps(index, indent=1, sort_keys=True).encode()),
            CommitOperationAdd(CARD_FILE, self.render_card(index).encode()),
        ]
        if self.lease is not None:
            # one writer: a session whose lease was taken over writes nothing more; each push renews the lease
            if self.lease.lost or (self.lease.held and self.lease.held_by_another()):
                self.lease.held, self.lease.lost = False, True
                raise LeaseLost(
                    f"the lease on {self.store.repo_id} was taken over by another session; this one "
                    "writes nothing more to the repo"
                )
            if self.lease.held:
                ops.append(self.lease.renew_op())
        try:
            info = self.store.api.create_commit(self.store.repo_id, ops, commit_message=message)
        except Exception:
            # Objects uploaded for a commit that did not land use storage that no file points to: purge them with
            # the next cleanup (which skips any the head does use, in case the commit landed after all).
            uploaded = {
                op.upload_info.sha256.hex()
                for op in ops
                if getattr(op, "_upload_mode", None) == "lfs" and op.upload_info.is_hashed
            }
            if self.keep_full:
                self.to_purge |= uploaded
            raise
        self.index = index
        return info.oid

    def retain(self, job: Upload) -> None:
        """After a confirmed push: keep the newest --hub_keep_full full checkpoints and one weights file per range,
        then delete from storage the LFS objects this run took off the head (never one the head still uses).

        The objects to delete are written to the index before the delete is tried, so a session that cannot
        finish it leaves it to the next one."""
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
            self.commit(
                ops,
                index,
                f"fsdp-opt: keep the newest {self.keep_full} full checkpoint(s) and one weights "
                "file per range (--hub_keep_full)",
            )
            self.log(
                f"hub: retired {', '.join(d.delete_full + d.delete_weights)}; full: {', '.join(d.keep_full)}; "
                f"weights files: {', '.join(d.keep_weights) or 'none'}"
            )
        elif self.to_purge and sorted(self.to_purge) != self.index.get("purge_pending"):
            self.commit([], index, "fsdp-opt: storage to free")
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
        index["storage"] = {
            "bytes": size,
            "date": now_iso(),
            "full_checkpoints": len(self.store.checkpoints(files)),
            "weights_files": len(self.store.weights(files)),
        }
        self.commit([], index, "fsdp-opt: repo storage")
        if freed:
            self.log(f"hub: freed {freed / 1e9:,.2f} GB of the repo's storage; it holds {size / 1e9:,.2f} GB")
