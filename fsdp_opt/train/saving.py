"""A save of the session: on every rank (the gather or the sharded write is collective); rank 0 writes the file (in
the background with --async_save), makes room on disk first, queues the Hub upload and prunes. Also the estimate the
time limit needs, and the --eval_rows evaluation that goes with a save."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from fsdp_opt.base import VERSION, CheckpointError
from fsdp_opt.checkpoint.atomic import save_or_explain
from fsdp_opt.checkpoint.chain import CHAIN_KEY
from fsdp_opt.checkpoint.drift import CHANGES_KEY
from fsdp_opt.checkpoint.names import checkpoint_name
from fsdp_opt.checkpoint.resume import slice_key
from fsdp_opt.checkpoint.save import save_checkpoint
from fsdp_opt.config.parse import Config
from fsdp_opt.data.pin import PIN_KEY
from fsdp_opt.hub.lease import FileLease
from fsdp_opt.runtime.distributed import broadcast_object, max_over_ranks, print0
from fsdp_opt.runtime.hostmem import release_host_memory
from fsdp_opt.tracking.metrics import EVAL_FILE
from fsdp_opt.tracking.scoretable import BENCHMARKS_KEY
from fsdp_opt.train.chain_scores import kept, score_at_save, scoring_seconds
from fsdp_opt.train.disk import make_room, prune
from fsdp_opt.train.session import Session


def save_estimate(s: Session) -> float:
    """Seconds the next save may take: the last one measured, or a guess from the state size at 100 MB/s."""
    estimate = 1.5 * s.last_save_seconds if s.last_save_seconds else 12 * s.n_params / 100e6 + 5.0
    if s.uploader is not None:  # the final checkpoint must reach the Hub too
        estimate += 1.5 * s.uploader.last_seconds()
    return estimate + scoring_seconds(s)  # --eval_tasks


def run_eval(s: Session) -> dict[str, float]:
    """--eval_rows on every rank (the method's evaluation); rank 0 appends eval.jsonl and logs to W&B."""
    result = s.method.evaluate(s)
    if s.env.is_main:
        with (s.out_dir / EVAL_FILE).open("a") as f:
            f.write(
                json.dumps({"step": s.state.global_step, "epoch": s.state.epoch, "rows": s.eval_label, **result}) + "\n"
            )
    s.wandb.log_eval(s.state.global_step, {k: result[k] for k in s.method.eval_logged})
    return result


def uses_async_save(config: Config, device_type: str) -> bool:
    """--async_save; auto: on a GPU, whose host is idle while it trains; not on CPU, where the write would take cores
    and memory from the steps it overlaps."""
    choice = config.checkpoint.async_save
    return choice == "true" or (choice == "auto" and device_type == "cuda")


def save(s: Session, *, epoch_end: bool, evaluate: bool = True) -> Path:
    """Every rank: evaluate (--eval_rows), then save. A full checkpoint written in the background (--async_save) is
    announced, pushed and pruned once it is on disk; the rest of save() is the gather training waits for."""
    dc, cc = s.config.data, s.config.checkpoint
    s.method.at_save(s)
    evaluation = run_eval(s) if evaluate and s.eval_blocks is not None else None
    scores = score_at_save(s) if evaluate else None  # --eval_tasks (rank 0's)
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
        if isinstance(s.lease, FileLease):  # on a shared disk the lease moves on with each save
            s.lease.renew()
    extra = {
        "slice": slice_key(s.config, s.end_idx, len(s.blocks), s.rows, s.chat_template),
        "chat_template": s.chat_template,  # the export and evaluate render with it, on any machine
        "scaler": s.scaler.state_dict(),
        "lr_schedule": s.schedule.state_dict(),
        "config": s.flags(),
        "model_name": s.config.model.model,
        "world_size": s.env.world_size,
        "global_batch": s.plan.global_batch,
        "last_loss": s.last_loss,
        "wandb_run_id": s.wandb.run_id if s.wandb is not None else None,
        "lora": s.lora,
        CHAIN_KEY: s.chain_record(),
        CHANGES_KEY: s.settings_changes,
        PIN_KEY: s.data_pin,
        BENCHMARKS_KEY: kept(s, scores),
        **({s.method.state_key: s.method.state()} if s.method.state_key else {}),
        "fsdp_opt_version": VERSION,
    }
    entry = {
        "global_step": s.state.global_step,
        "epochs_done": s.state.epoch,
        "start_idx": dc.start_idx,
        "end_idx": s.end_idx,
        "loss": s.last_loss if math.isfinite(s.last_loss) else None,
        "world_size": s.env.world_size,
        "sharded": sharded,
        "eval_loss": evaluation.get("loss") if evaluation else None,
        "eval_reward": evaluation.get("reward") if evaluation else None,  # --method grpo's held-out reward
        CHAIN_KEY: extra[CHAIN_KEY],
        CHANGES_KEY: s.settings_changes,
        PIN_KEY: s.data_pin,
        **({BENCHMARKS_KEY: scores} if scores else {}),  # --eval_tasks: lm-eval's result keys (the card's table)
    }
    kind = "epoch" if epoch_end else "step"
    started = time.perf_counter()

    def write_in_background(payload: dict[str, Any]) -> None:
        gathered = time.perf_counter() - started

        def work() -> None:
            save_or_explain(payload, path)
            payload.clear()
            release_host_memory()
            finished(
                s,
                path,
                kind,
                entry,
                {"bytes": float(path.stat().st_size), "seconds": time.perf_counter() - started},
                waited=gathered,
            )

        s.ckpt_writer.start(work)

    info = save_checkpoint(
        path,
        s.env,
        s.model,
        s.optimizer,
        state=s.state,
        epochs_run=s.state.epoch,
        extra=extra,
        save_optimizer=cc.save_optimizer,
        sharded=sharded,
        hand_off=write_in_background if background else None,
    )
    s.last_saved_step, s.last_saved_path = s.state.global_step, path
    if info is not None:
        finished(s, path, kind, entry, info)
    if not background:
        s.last_save_seconds = broadcast_object(s.last_save_seconds)
    return path


def finished(
    s: Session, path: Path, kind: str, entry: dict[str, Any], info: dict[str, float], waited: float | None = None
) -> None:
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
        raise CheckpointError(
            broadcast_object(s.ckpt_writer.error if s.env.is_main else None) or "writing a checkpoint failed"
        )
