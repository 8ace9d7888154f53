"""What leaves the machine: the Hub uploader (started on rank 0 with --hf_repo, finished after the process group is
gone so a long wait for the last uploads cannot time out a collective), W&B artifacts for pushed checkpoints, and the
export at the end of training."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_opt.checkpoint.export import export_lora, export_model_folder
from fsdp_opt.checkpoint.state import gather_full_state
from fsdp_opt.hub.card import render_card, run_info
from fsdp_opt.hub.lease import HubLease, Lease
from fsdp_opt.hub.store import HubStore
from fsdp_opt.hub.uploads import Uploader
from fsdp_opt.runtime.distributed import all_ranks_ok, print0
from fsdp_opt.train.disk import prune
from fsdp_opt.train.saving import wait_for_writes
from fsdp_opt.train.session import Session


def start_uploader(session: Session) -> Any:
    hc = session.config.hub
    run = run_info(
        session.flags(),
        world_size=session.env.world_size,
        global_batch=session.plan.global_batch,
        n_params=session.n_params,
        rows=session.rows,
        chat_template=session.chat_template,
    )
    uploader = Uploader(
        HubStore(hc.hf_repo, retries=hc.hub_retries),
        lambda index: render_card(hc.hf_repo, index),
        run=run,
        private=not hc.hub_public,
        metrics=session.writer.path,
        retries=hc.hub_retries,
        on_uploaded=lambda job: prune(session, job.path),
        log=print0,
        keep_full=hc.keep_full,
        lease=session.lease if isinstance(session.lease, HubLease) else None,
    )
    where = "reachable" if uploader.repo_ready else "not reachable now; uploads will retry"
    print0(f"hub: checkpoints go to {hc.hf_repo}/{'checkpoints'} in the background (the Hub is {where})")
    return uploader


@dataclass
class NotOnHub:
    """The session's newest checkpoint, which did not reach the Hub: its name, where it is kept, why, and what a
    session on another machine would resume from."""

    name: str
    path: Path
    why: str
    resume_from: str | None  # the newest checkpoint the repo has (None: none)

    def line(self, repo: str) -> str:
        then = (
            f"a session on another machine resumes from {self.resume_from}, the newest the repo has"
            if self.resume_from
            else "a session on another machine finds no checkpoint there and starts the chain again"
        )
        return (
            f"the checkpoint {self.name} did not reach {repo} ({self.why}); it is kept whole here: {self.path}. "
            f"Without it {then}; to go on from it, run the next session with this file in its --output_dir, or "
            f"push it and give --resume_file {self.name} (docs/checkpoints.md: when the Hub stays down)"
        )


def finish_outside(session: Session) -> NotOnHub | None:
    """After the process group is gone (no collective can time out): rank 0 waits for uploads (retrying those that
    failed for a passing reason while --hub_wait lasts), closes W&B. Returns the session's newest checkpoint when it
    is not on the Hub."""
    if session.ckpt_writer is not None:
        session.ckpt_writer.wait()  # a write still in flight after an error: it finishes (or fails) before the uploads end
    lost = None
    if session.uploader is not None:
        failed = session.uploader.finish(session.config.hub.hub_wait_seconds)
        log_pushed(session)
        for job in failed:
            what = "did not finish in --hub_wait" if job.status != "failed" else f"failed ({job.error})"
            print0(
                f"warning: upload of {job.name} to {session.config.hub.hf_repo} {what}; the local copy is kept: {job.path.resolve()}"
            )
        if not failed:
            jobs = session.uploader.jobs
            pushed = sum(j.status == "done" for j in jobs)
            replaced = sum(j.status == "superseded" for j in jobs)
            print0(
                f"hub: uploads done: {pushed} pushed to {session.config.hub.hf_repo}"
                + (f", {replaced} replaced by a newer checkpoint before their turn" if replaced else "")
            )
        storage = session.uploader.index.get("storage")
        if storage:
            print0(
                f"hub: {session.config.hub.hf_repo} holds {storage['bytes'] / 1e9:,.2f} GB: {storage['full_checkpoints']} "
                f"full checkpoint(s), {storage['weights_files']} weights file(s) (--hub_keep_full {session.config.hub.keep_full})"
            )
        lost = newest_not_on_hub(session, failed)
        if lost is not None and session.wandb is not None:
            session.wandb.summarize(
                {
                    "hub/not_pushed": lost.name,
                    "hub/kept_at": str(lost.path),
                    "hub/resume_from": lost.resume_from or "none",
                }
            )
    if session.wandb is not None:
        session.wandb.finish()
    return lost


def newest_not_on_hub(session: Session, failed: list) -> NotOnHub | None:  # noqa: ANN001
    """The session's newest checkpoint, when the Hub does not have it (its upload failed, or did not end in time)."""
    path = session.position.last_saved_path
    job = next((j for j in failed if path is not None and j.name == path.name), None)
    if job is None:
        return None
    why = f"the upload failed: {job.error}" if job.status == "failed" else "its upload did not end within --hub_wait"
    pushed = session.uploader.index.get("checkpoints") or {}
    newest = max(pushed, key=lambda n: pushed[n].get("global_step", -1), default=None)
    return NotOnHub(job.name, job.path.resolve(), why, newest)


def release_lease(lease: Lease) -> None:
    """The chain's lease, given back at exit (rank 0): a failure to reach the Hub leaves it to expire."""
    try:
        lease.release()
    except Exception as exc:  # noqa: BLE001 - the session's work is done; the lease then ends at its expiry
        print0(
            f"warning: the chain's lease on {lease.where} could not be released ({str(exc).splitlines()[0][:200]}); "
            f"it ends at its expiry"
        )


def log_pushed(session: Session) -> None:
    """Each pushed checkpoint becomes a W&B artifact that references its file on the Hub."""
    for job in session.uploader.take_done():
        if job.kind != "export" and job.commit:
            url = session.uploader.store.file_url(job.path_in_repo, job.commit)
            session.wandb.log_checkpoint(
                job.name, url, {**job.entry, "hf_repo": session.config.hub.hf_repo, "commit": job.commit}
            )


def export_final(session: Session) -> None:
    """--export_hf: every rank joins the gather; rank 0 writes the folder."""

    cc = session.config.checkpoint
    wait_for_writes(session)  # one gathered state in host RAM at a time
    model_sd, _ = gather_full_state(session.model, None)
    dest = Path(cc.export_hf)
    if session.env.is_main:
        if session.lora is not None:
            all_ranks_ok(
                lambda: export_lora(
                    model_sd,
                    session.lora,
                    dest,
                    cc.export_dtype,
                    merge=cc.export_merge,
                    seed=session.config.train.seed,
                    chat_template=session.chat_template,
                )
            )
            what = "the base with the adapters merged in" if cc.export_merge else "a peft adapter folder"
        else:
            all_ranks_ok(
                lambda: export_model_folder(model_sd, session.model_config, session.tokenizer, dest, cc.export_dtype)
            )
            what = "safetensors, tokenizer, generation config"
        print0(f"exported {dest} ({cc.export_dtype}, {what})")
        if session.uploader is not None:
            entry = {
                "global_step": session.state.global_step,
                "dtype": cc.export_dtype,
                "adapter": session.lora is not None and not cc.export_merge,
            }
            session.uploader.submit(dest, "export", entry)
    else:
        all_ranks_ok(lambda: None)
