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


def save_estimate(session: Session) -> float:
    """Seconds the next save may take: the last one measured, or a guess from the state size at 100 MB/s."""
    p = session.position
    estimate = 1.5 * p.last_save_seconds if p.last_save_seconds else 12 * session.n_params / 100e6 + 5.0
    if session.uploader is not None:  # the final checkpoint must reach the Hub too
        estimate += 1.5 * session.uploader.last_seconds()
    return estimate + scoring_seconds(session)  # --eval_tasks


def run_eval(session: Session) -> dict[str, float]:
    """--eval_rows on every rank (the method's scorer); rank 0 appends eval.jsonl and logs to W&B."""
    started = time.perf_counter()
    result = session.scorer.score(session.model)
    result.pop("samples", None)
    result["seconds"] = round(time.perf_counter() - started, 3)
    print0(
        f"eval at step {session.state.global_step}: {session.scorer.line(result)} on rows {session.eval_label} "
        f"({result['seconds']:.1f} s)"
    )
    if session.env.is_main:
        with (session.out_dir / EVAL_FILE).open("a") as f:
            f.write(
                json.dumps(
                    {
                        "step": session.state.global_step,
                        "epoch": session.state.epoch,
                        "rows": session.eval_label,
                        **result,
                    }
                )
                + "\n"
            )
    session.wandb.log_eval(session.state.global_step, {k: result[k] for k in session.scorer.logged})
    return result


def uses_async_save(config: Config, device_type: str) -> bool:
    """--async_save; auto: on a GPU, whose host is idle while it trains; not on CPU, where the write would take cores
    and memory from the steps it overlaps."""
    choice = config.checkpoint.async_save
    return choice == "true" or (choice == "auto" and device_type == "cuda")


def save(session: Session, *, epoch_end: bool, evaluate: bool = True) -> Path:
    """Every rank: evaluate (--eval_rows), then save. A full checkpoint written in the background (--async_save) is
    announced, pushed and pruned once it is on disk; the rest of save() is the gather training waits for."""
    dc, cc = session.config.data, session.config.checkpoint
    if session.env.is_main and session.loss.completions():  # W&B: a table of the last step's completions (the first 16)
        session.wandb.log_table("completions", session.state.global_step, session.loss.completions()[:16])
    evaluation = run_eval(session) if evaluate and session.scorer is not None else None
    scores = score_at_save(session) if evaluate else None  # --eval_tasks (rank 0's)
    sharded = cc.state_dict_type == "sharded"
    if epoch_end:
        name = checkpoint_name(session.tag, dc.start_idx, session.end_idx, session.state.epoch, sharded=sharded)
    else:
        name = checkpoint_name(
            session.tag,
            dc.start_idx,
            session.end_idx,
            session.state.epoch + 1,
            session.state.global_step,
            sharded=sharded,
        )
    path = session.out_dir / name
    background = session.ckpt_writer is not None and not sharded
    if session.env.is_main:
        if session.ckpt_writer is not None:
            session.ckpt_writer.wait()  # the previous write: its bytes count in make_room, its memory is freed first
        make_room(session, keep=path)
        if isinstance(session.lease, FileLease):  # on a shared disk the lease moves on with each save
            session.lease.renew()
    extra = {
        "slice": slice_key(session.config, session.end_idx, len(session.blocks), session.rows, session.chat_template),
        "chat_template": session.chat_template,  # the export and evaluate render with it, on any machine
        "scaler": session.scaler.state_dict(),
        "lr_schedule": session.schedule.state_dict(),
        "config": session.flags(),
        "model_name": session.config.model.model,
        "world_size": session.env.world_size,
        "global_batch": session.plan.global_batch,
        "last_loss": session.state.last_loss,
        "wandb_run_id": session.wandb.run_id if session.wandb is not None else None,
        "lora": session.lora,
        CHAIN_KEY: session.chain_record(),
        CHANGES_KEY: session.settings_changes,
        PIN_KEY: session.data_pin,
        session.method.name: session.method_state(),
        BENCHMARKS_KEY: kept(session, scores),
        "fsdp_opt_version": VERSION,
    }
    entry = {
        "global_step": session.state.global_step,
        "epochs_done": session.state.epoch,
        "start_idx": dc.start_idx,
        "end_idx": session.end_idx,
        "loss": session.state.last_loss if math.isfinite(session.state.last_loss) else None,
        "world_size": session.env.world_size,
        "sharded": sharded,
        "eval_loss": evaluation.get("loss") if evaluation else None,
        "eval_reward": evaluation.get("reward") if evaluation else None,  # --method grpo's held-out reward
        # what the range trained with: a session asked to train it again compares (train/chain.already_trained)
        "config": extra["config"],
        "global_batch": session.plan.global_batch,
        CHAIN_KEY: extra[CHAIN_KEY],
        CHANGES_KEY: session.settings_changes,
        PIN_KEY: session.data_pin,
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
                session,
                path,
                kind,
                entry,
                {"bytes": float(path.stat().st_size), "seconds": time.perf_counter() - started},
                waited=gathered,
            )

        session.ckpt_writer.start(work)

    info = save_checkpoint(
        path,
        session.env,
        session.model,
        session.optimizer,
        state=session.state,
        epochs_run=session.state.epoch,
        extra=extra,
        save_optimizer=cc.save_optimizer,
        sharded=sharded,
        hand_off=write_in_background if background else None,
    )
    session.position.last_saved_step, session.position.last_saved_path = session.state.global_step, path
    if info is not None:
        finished(session, path, kind, entry, info)
    if not background:
        session.position.last_save_seconds = broadcast_object(session.position.last_save_seconds)
    return path


def finished(
    session: Session, path: Path, kind: str, entry: dict[str, Any], info: dict[str, float], waited: float | None = None
) -> None:
    """Rank 0, once a checkpoint is whole on disk: say so, queue its upload, prune older ones."""
    session.position.last_save_seconds, session.position.last_save_bytes = info["seconds"], int(info["bytes"])
    note = f"; training waited {waited:.1f} s of it" if waited is not None else ""
    print0(f"saved {path} ({info['bytes'] / 2**20:,.1f} MiB in {info['seconds']:.1f} s{note})")
    if session.uploader is not None:
        session.uploader.submit(path, kind, {**entry, "bytes": info["bytes"]})
    prune(session, path)


def wait_for_writes(session: Session) -> None:
    """Every rank: the background write done, and a failed one raised as the same CheckpointError on every rank."""
    if session.ckpt_writer is not None and session.env.is_main:
        session.ckpt_writer.wait()
    raise_if_write_failed(session)


def raise_if_write_failed(session: Session) -> None:
    """Every rank (a collective): stop all ranks with rank 0's write error, if there is one."""
    failed = max_over_ranks(1 if session.ckpt_writer is not None and session.ckpt_writer.error else 0)
    if failed:
        raise CheckpointError(
            broadcast_object(session.ckpt_writer.error if session.env.is_main else None)
            or "writing a checkpoint failed"
        )
