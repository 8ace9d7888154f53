"""What a session writes and sends: checkpoints, evaluations, the export, Hub uploads, W&B.

save() runs on every rank (the gather or the sharded write is collective); rank 0 writes the files, queues the
Hub upload and prunes. finish_outside() runs after the process group is gone, so a long wait for the last
uploads cannot time out a collective on another rank.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

from fsdp_opt.base import CheckpointError
from fsdp_opt.checkpoint.atomic import save_or_explain
from fsdp_opt.checkpoint.export import export_lora, export_model_folder
from fsdp_opt.checkpoint.files import checkpoint_step
from fsdp_opt.checkpoint.files import prune as ckpt_prune
from fsdp_opt.checkpoint.names import checkpoint_name, list_checkpoints
from fsdp_opt.checkpoint.resume import slice_key
from fsdp_opt.checkpoint.room import Held, bytes_on_disk, choose
from fsdp_opt.checkpoint.save import save_checkpoint
from fsdp_opt.checkpoint.state import gather_full_state
from fsdp_opt.config.parse import Config
from fsdp_opt.engine.evaluation import evaluate_loss
from fsdp_opt.hub.card import render_card, run_info
from fsdp_opt.hub.store import HubStore
from fsdp_opt.hub.uploads import Uploader
from fsdp_opt.runtime.distributed import all_ranks_ok, broadcast_object, max_over_ranks, print0
from fsdp_opt.runtime.hostmem import release_host_memory
from fsdp_opt.tracking.metrics import EVAL_FILE
from fsdp_opt.train.session import Session


def start_uploader(s: Session) -> Any:
    hc = s.config.hub
    run = run_info(s.config.flat(), world_size=s.env.world_size, global_batch=s.plan.global_batch, n_params=s.n_params)
    uploader = Uploader(
        HubStore(hc.hf_repo, retries=hc.hub_retries),
        lambda index: render_card(hc.hf_repo, index),
        run=run,
        private=not hc.hub_public,
        metrics=s.writer.path,
        retries=hc.hub_retries,
        on_uploaded=lambda job: prune(s, job.path),
        log=print0,
        keep_full=hc.keep_full,
    )
    where = "reachable" if uploader.repo_ready else "not reachable now; uploads will retry"
    print0(f"hub: checkpoints go to {hc.hf_repo}/{'checkpoints'} in the background (the Hub is {where})")
    return uploader


def finish_outside(s: Session) -> None:
    """After the process group is gone (no collective can time out): rank 0 waits for uploads, closes W&B."""
    if s.ckpt_writer is not None:
        s.ckpt_writer.wait()  # a write still in flight after an error: it finishes (or fails) before the uploads end
    if s.uploader is not None:
        failed = s.uploader.finish(s.config.hub.hub_wait_seconds)
        log_pushed(s)
        for job in failed:
            what = "did not finish in --hub_wait" if job.status != "failed" else f"failed ({job.error})"
            print0(f"warning: upload of {job.name} to {s.config.hub.hf_repo} {what}; the local copy is kept: {job.path.resolve()}")
        if not failed:
            jobs = s.uploader.jobs
            pushed = sum(j.status == "done" for j in jobs)
            replaced = sum(j.status == "superseded" for j in jobs)
            print0(f"hub: uploads done: {pushed} pushed to {s.config.hub.hf_repo}"
                   + (f", {replaced} replaced by a newer checkpoint before their turn" if replaced else ""))  # fmt: skip
        storage = s.uploader.index.get("storage")
        if storage:
            print0(f"hub: {s.config.hub.hf_repo} holds {storage['bytes'] / 1e9:,.2f} GB: {storage['full_checkpoints']} "
                   f"full checkpoint(s), {storage['weights_files']} weights file(s) (--hub_keep_full {s.config.hub.keep_full})")  # fmt: skip
    if s.wandb is not None:
        s.wandb.finish()


def log_pushed(s: Session) -> None:
    """Each pushed checkpoint becomes a W&B artifact that references its file on the Hub."""
    for job in s.uploader.take_done():
        if job.kind != "export" and job.commit:
            url = s.uploader.store.file_url(job.path_in_repo, job.commit)
            s.wandb.log_checkpoint(job.name, url, {**job.entry, "hf_repo": s.config.hub.hf_repo, "commit": job.commit})


def save_estimate(s: Session) -> float:
    """Seconds the next save may take: the last one measured, or a guess from the state size at 100 MB/s."""
    estimate = 1.5 * s.last_save_seconds if s.last_save_seconds else 12 * s.n_params / 100e6 + 5.0
    if s.uploader is not None:  # the final checkpoint must reach the Hub too
        estimate += 1.5 * s.uploader.last_seconds()
    return estimate


def run_eval(s: Session) -> dict[str, float]:
    """--eval_rows on every rank; rank 0 prints, appends eval.jsonl and logs to W&B."""
    dc = s.config.data
    started = time.perf_counter()
    result = evaluate_loss(s.model, s.eval_blocks, s.config.train.batch_size, s.env)
    result["seconds"] = round(time.perf_counter() - started, 3)
    rows = f"[{s.end_idx}, {s.end_idx + dc.eval_rows})"
    print0(f"eval at step {s.state.global_step}: loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} "
           f"on rows {rows} ({result['tokens']:,} tokens, {result['seconds']:.1f} s)")  # fmt: skip
    if s.env.is_main:
        with (s.out_dir / EVAL_FILE).open("a") as f:
            f.write(json.dumps({"step": s.state.global_step, "epoch": s.state.epoch, "rows": rows, **result}) + "\n")
    s.wandb.log_eval(s.state.global_step, {k: result[k] for k in ("loss", "perplexity")})
    return result


class BackgroundWriter:
    """Rank 0 writes a gathered checkpoint in a thread of its own while training goes on (--async_save).

    One write at a time: start() waits for the one before, so host RAM never holds two gathered states. A failed
    write is kept in `error`; the training loop reads it at the next step and every rank stops with it.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    def start(self, work: Callable[[], None]) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(work,), name="checkpoint-writer")
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except CheckpointError as exc:
            self.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported on every rank at the next step, like a disk error
            self.error = f"writing a checkpoint failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def uses_async_save(config: Config, device_type: str) -> bool:
    """--async_save; auto: on a GPU, whose host is idle while it trains; not on CPU, where the write would take cores
    and memory from the steps it overlaps."""
    choice = config.checkpoint.async_save
    return choice == "true" or (choice == "auto" and device_type == "cuda")


def save(s: Session, *, epoch_end: bool, evaluate: bool = True) -> Path:
    """Every rank: evaluate (--eval_rows), then save. A full checkpoint written in the background (--async_save) is
    announced, pushed and pruned once it is on disk; the rest of save() is the gather training waits for."""
    dc, cc = s.config.data, s.config.checkpoint
    evaluation = run_eval(s) if evaluate and s.eval_blocks is not None else None
    sharded = cc.state_dict_type == "sharded"
    if epoch_end:
        name = checkpoint_name(s.tag, dc.start_idx, s.end_idx, s.state.epoch, sharded=sharded)
    else:
        name = checkpoint_name(s.tag, dc.start_idx, s.end_idx, s.state.epoch + 1, s.state.global_step, sharded=sharded)
    path = s.out_dir / name
    background = s.ckpt_writer is not None and not sharded
    if s.env.is_main:
        if s.ckpt_writer is not None:
            s.ckpt_writer.wait()  # the previous write: its bytes count in make_room, its memory is freed first
        make_room(s, keep=path)
    extra = {
        "slice": slice_key(s.config, s.end_idx, len(s.blocks)),
        "scaler": s.scaler.state_dict(),
        "lr_schedule": s.schedule.state_dict(),
        "config": s.config.flat(),
        "model_name": s.config.model.model,
        "world_size": s.env.world_size,
        "global_batch": s.plan.global_batch,
        "last_loss": s.last_loss,
        "wandb_run_id": s.wandb.run_id if s.wandb is not None else None,
        "lora": s.lora,
    }
    entry = {
        "global_step": s.state.global_step,
        "epochs_done": s.state.epoch,
        "start_idx": dc.start_idx,
        "end_idx": s.end_idx,
        "loss": s.last_loss if math.isfinite(s.last_loss) else None,
        "world_size": s.env.world_size,
        "sharded": sharded,
        "eval_loss": evaluation["loss"] if evaluation else None,
    }
    kind = "epoch" if epoch_end else "step"
    started = time.perf_counter()

    def write_in_background(payload: dict[str, Any]) -> None:
        gathered = time.perf_counter() - started

        def work() -> None:
            save_or_explain(payload, path)
            payload.clear()
            release_host_memory()
            finished(s, path, kind, entry, {"bytes": float(path.stat().st_size), "seconds": time.perf_counter() - started},
                     waited=gathered)  # fmt: skip

        s.ckpt_writer.start(work)

    info = save_checkpoint(
        path, s.env, s.model, s.optimizer, state=s.state, epochs_run=s.state.epoch, extra=extra,
        save_optimizer=cc.save_optimizer, sharded=sharded, hand_off=write_in_background if background else None,
    )  # fmt: skip
    s.last_saved_step, s.last_saved_path = s.state.global_step, path
    if info is not None:
        finished(s, path, kind, entry, info)
    if not background:
        s.last_save_seconds = broadcast_object(s.last_save_seconds)
    return path


def finished(s: Session, path: Path, kind: str, entry: dict[str, Any], info: dict[str, float], waited: float | None = None) -> None:
    """Rank 0, once a checkpoint is whole on disk: say so, queue its upload, prune older ones."""
    s.last_save_seconds, s.last_save_bytes = info["seconds"], int(info["bytes"])
    note = f"; training waited {waited:.1f} s of it" if waited is not None else ""
    print0(f"saved {path} ({info['bytes'] / 2**20:,.1f} MiB in {info['seconds']:.1f} s{note})")
    if s.uploader is not None:
        s.uploader.submit(path, kind, {**entry, "bytes": info["bytes"]})
    prune(s, path)


def wait_for_writes(s: Session) -> None:
    """Every rank: the background write done, and a failed one raised as the same CheckpointError on every rank."""
    if s.ckpt_writer is not None and s.env.is_main:
        s.ckpt_writer.wait()
    raise_if_write_failed(s)


def raise_if_write_failed(s: Session) -> None:
    """Every rank (a collective): stop all ranks with rank 0's write error, if there is one."""
    failed = max_over_ranks(1 if s.ckpt_writer is not None and s.ckpt_writer.error else 0)
    if failed:
        raise CheckpointError(broadcast_object(s.ckpt_writer.error if s.env.is_main else None) or "writing a checkpoint failed")


def export_final(s: Session) -> None:
    """--export_hf: every rank joins the gather; rank 0 writes the folder."""

    cc = s.config.checkpoint
    wait_for_writes(s)  # one gathered state in host RAM at a time
    model_sd, _ = gather_full_state(s.model, None)
    dest = Path(cc.export_hf)
    if s.env.is_main:
        if s.lora is not None:
            all_ranks_ok(lambda: export_lora(model_sd, s.lora, dest, cc.export_dtype, merge=cc.export_merge, seed=s.config.train.seed))
            what = "the base with the adapters merged in" if cc.export_merge else "a peft adapter folder"
        else:
            all_ranks_ok(lambda: export_model_folder(model_sd, s.model_config, s.tokenizer, dest, cc.export_dtype))
            what = "safetensors, tokenizer, generation config"
        print0(f"exported {dest} ({cc.export_dtype}, {what})")
        if s.uploader is not None:
            entry = {"global_step": s.state.global_step, "dtype": cc.export_dtype,
                     "adapter": s.lora is not None and not cc.export_merge}  # fmt: skip
            s.uploader.submit(dest, "export", entry)
    else:
        all_ranks_ok(lambda: None)


def make_room(s: Session, keep: Path) -> None:
    """Rank 0, before a save: remove local checkpoints until the new one fits the disk's free space and --disk_budget
    (room.choose: those the Hub has first, then older ones, the newest only once the Hub has it). What still does not
    fit is left to the save, which stops in one line when the disk is full; over --disk_budget alone it warns."""
    cc = s.config.checkpoint
    up = s.uploader
    with s.prune_lock:
        paths = sorted((p for p in list_checkpoints(s.out_dir) if p != keep),
                       key=lambda p: (checkpoint_step(p), p.stat().st_mtime))  # fmt: skip
        state = {p: up.upload_state(p) if up is not None else None for p in paths}
        held = [Held(p, bytes_on_disk(p), on_hub=up is not None and up.is_on_hub(p),
                          uploading=state[p] == "uploading", queued=state[p] in ("waiting", "uploading"))
                for p in paths]  # fmt: skip
        s.out_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(s.out_dir).free
        plan = choose(held, s.last_save_bytes or save_bytes_estimate(s), free, cc.disk_budget_bytes)
        why = f"{plan.needed / 1e9:,.2f} GB needed, {free / 1e9:,.2f} GB free" + (
            f", --disk_budget {cc.disk_budget}" if cc.disk_budget_bytes is not None else "")  # fmt: skip
        for h in plan.remove:
            on_hub = h.on_hub
            if h is plan.remove[-1] and plan.wait_for_newest:
                print0(f"waiting for the upload of {h.path.name} before removing it to make room ({why})")
                on_hub = up.wait_for(h.path, s.config.hub.hub_wait_seconds)
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
        print0(f"warning: --disk_budget {cc.disk_budget}: the checkpoints in {s.out_dir} and the next save need about "
               f"{(plan.used_after + plan.needed) / 1e9:,.2f} GB; nothing more can be removed (the newest is not on "
               "the Hub); saving anyway")  # fmt: skip


def save_bytes_estimate(s: Session) -> int:
    """The first save's size before one is measured: fp32 weights (+ AdamW's two moments) of what trains."""
    trainable = sum(p.numel() for p in s.params)
    return (12 if s.config.checkpoint.save_optimizer else 4) * trainable + 2**20


def prune(s: Session, keep: Path) -> None:
    """--keep_last, rank 0. With --hf_repo a file goes only once the Hub has it (called again after each push)."""
    keep_last = s.config.checkpoint.keep_last
    may_delete = s.uploader.is_on_hub if s.uploader is not None else None
    with s.prune_lock:
        for old in ckpt_prune(s.out_dir, keep_last, keep=keep, may_delete=may_delete):
            print0(f"removed {old} (--keep_last {keep_last})")
