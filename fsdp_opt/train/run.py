"""The training run: a session set up (train/build.py), then a short loop over optimizer steps.

train():  for each step: micro-batches forward/backward -> global norm -> unscale+clip -> step -> log -> save
"""

from __future__ import annotations

import json
import time

import torch

from fsdp_opt.base import NotPushedError, RewardError
from fsdp_opt.checkpoint.atomic import remove_stale_temp
from fsdp_opt.config.parse import Config
from fsdp_opt.engine.fp16watch import Fp16Overflow
from fsdp_opt.engine.step import train_step
from fsdp_opt.planner.steptime import step_time_line
from fsdp_opt.runtime.distributed import barrier, init_distributed, print0, teardown
from fsdp_opt.runtime.hostmem import configure_allocator, freeze_imported
from fsdp_opt.runtime.stopping import WRITE_FAILED, StopControl, resume_command
from fsdp_opt.tracking.metrics import COMPLETIONS_FILE, REPLACED, set_aside
from fsdp_opt.tracking.progress import Progress, gpu_memory_line, host_peaks_line
from fsdp_opt.train.build import check_flags, setup
from fsdp_opt.train.chain import claim, next_in_session
from fsdp_opt.train.publish import export_final, finish_outside, log_pushed, release_lease
from fsdp_opt.train.saving import raise_if_write_failed, save, save_estimate, wait_for_writes
from fsdp_opt.train.session import Session


def run(config: Config) -> None:
    freeze_imported()
    env = init_distributed(config.parallel.device)
    configure_allocator(cpu_device=env.device.type == "cpu")
    session, lease, lost = None, None, None
    try:
        # --start_idx auto: this session's range; and the chain's lease. None: the chain is done, or another session
        # holds the lease.
        checked = check_flags(config, env)  # the flags first: a typo never reaches the Hub or takes a lease
        config, lease = claim(config, env)
        if config is None:
            barrier()
            return
        session = setup(config, env, checked, lease)
        session = train_session(session)
        for line in (step_time_line(session.position.step_seconds, session.predicted_step), gpu_memory_line(env)):
            if line:
                print0(line)
        print0(host_peaks_line(env.world_size))
        # Every rank reaches the end before any closes its connections: no peer is left mid-transfer.
        barrier()
    finally:
        teardown()
        lost = finish_outside(session) if session is not None else None
        if lease is not None:  # after the last uploads, which renew it
            release_lease(lease)
    if lost is not None:  # the session trained, but its newest checkpoint is not on the Hub: the last line says so
        raise NotPushedError(lost.line(config.hub.hf_repo))


# ---------------------------------------------------------------- loop


def train_session(session: Session) -> Session:
    """The session's range, then (--session_ranges) those after it while they fit; the export; the last writes.
    Returns the session of the last range trained."""
    step = session.state.global_step
    if session.env.is_main:  # one record per step: an earlier run's records of the steps this session trains move aside
        for name, count in set_aside(session.out_dir, step).items():
            print0(
                f"{name}: {count} record(s) of the steps after global step {step}, from an earlier run of the steps "
                f"this session trains, moved to {name.removesuffix('.jsonl') + REPLACED}"
            )
    stop = StopControl(session.config.checkpoint.time_limit_seconds)
    session.position.clock_started = stop.started
    try:
        finished, ranges = train(session, stop), 1
        while finished and (following := next_in_session(session, stop, ranges)) is not None:
            session = following
            finished, ranges = train(session, stop), ranges + 1
        if finished and session.config.checkpoint.export_hf:
            export_final(session)
        wait_for_writes(session)
    finally:
        stop.close()
    return session


def train(session: Session, stop: StopControl) -> bool:
    """The epochs of this slice (one range of an auto chain: one epoch); False when it stopped early."""
    tc = session.config.train
    if session.env.is_main:
        for p in remove_stale_temp(session.out_dir):
            print0(f"removed {p.name}, left by an interrupted save")
    first_epoch = session.state.epoch
    epochs = 1 if session.config.data.range_size is not None else tc.num_epochs
    for epoch in range(first_epoch, first_epoch + epochs):
        session.state.epoch = epoch
        progress = Progress(
            session.env.is_main,
            session.plan.steps_per_epoch(session.state.offset, session.state.within),
            f"epoch {epoch + 1}",
        )
        try:
            reason = run_epoch(session, epoch, stop, progress)
        finally:
            progress.close()  # also on an error: the error line then starts a line of its own
        if reason:
            _stop_early(session, reason)
            return False
        session.state.epoch, session.state.offset, session.state.within = epoch + 1, 0, 0
        if session.chain is not None:
            session.chain.ranges_done += 1
        save(session, epoch_end=True)
    return True


def run_epoch(session: Session, epoch: int, stop: StopControl, progress: Progress) -> str | None:
    """The steps of one epoch from the saved position; returns the agreed reason to stop early, if any."""
    cc = session.config.checkpoint
    for step in session.plan.steps(epoch, session.state.offset, session.state.within):
        reason = stop.check(
            save_estimate(session), write_failed=bool(session.ckpt_writer and session.ckpt_writer.error)
        )
        if reason == WRITE_FAILED:
            raise_if_write_failed(session)
        if reason:
            return reason
        step_started = time.perf_counter()
        try:
            record = train_step(session, step)
        except RewardError as exc:
            raise keep_last_step(session, exc) from None
        session.position.step_seconds.append(time.perf_counter() - step_started)
        stop.observe_step(session.position.step_seconds[-1])
        session.state.offset, session.state.within = step.end_offset, step.within_after
        session.count_step(step)
        record["elapsed"] = round(stop.elapsed(), 3)
        record["skipped_rate"], warning, overflow = session.skip_watch.observe(record["skipped"], record["loss_scale"])
        session.writer.write(record, fields_of(session))
        session.wandb.log_step(record)
        write_completions(session)
        if session.uploader is not None:
            log_pushed(session)
        progress.update(
            record["loss"], record["tokens_per_second"], **{k: record[k] for k in session.method.spec.shown}
        )
        if warning:
            print0(warning)
        if overflow:
            raise Fp16Overflow(overflow)
        epoch_done = step.end_offset >= session.plan.num_samples
        if cc.save_every_steps and session.state.global_step % cc.save_every_steps == 0 and not epoch_done:
            save(session, epoch_end=False)
    return None


def keep_last_step(session: Session, exc: RewardError) -> RewardError:
    """A reward function failed on the step's completions (every rank has the same error, before any update of the
    step): the last whole step saved (and pushed) before the session ends, metrics.jsonl and completions.jsonl ending
    with it. Returns the error to raise, its line saying where the session can go on from."""
    step = session.state.global_step
    if step == 0:
        return exc
    path = session.position.last_saved_path
    if session.position.last_saved_step != step or path is None:
        path = save(session, epoch_end=False, evaluate=False)
    wait_for_writes(session)
    return RewardError(
        f"{exc}, in step {step + 1}: step {step}, the last whole one, is saved in {path.name}; fix the function and "
        f"resume from it (--resume_file {path.name}, or --start_idx auto), with --allow_changes where its rule changed"
    )


def _stop_early(session: Session, reason: str) -> None:
    print0(f"stopping: {reason} at global step {session.state.global_step}")
    path = session.position.last_saved_path  # saved at this very step already (an epoch end just before the stop, say)
    if session.position.last_saved_step != session.state.global_step or path is None:
        path = save(session, epoch_end=False, evaluate=False)  # no time for an evaluation now
    wait_for_writes(session)
    print0("resume with:\n  " + resume_command(path.name, same=session.config.data.range_size is not None))


def fields_of(session: Session) -> tuple[str, ...]:
    """metrics.jsonl's fields beyond the common ones: the method's, and a reward field per reward function."""
    rewards = tuple(f"reward_{r.label}" for r in session.components.rewards or ())
    return (*session.method.spec.fields, *rewards)


def write_completions(session: Session) -> None:
    """completions.jsonl (a method that samples): every completion the step trained for the first time, gathered to
    rank 0 (every rank calls this)."""
    if not session.method.spec.generates:
        return
    everyone = [session.loss.completions()]
    if session.env.world_size > 1:
        everyone = [None] * session.env.world_size
        torch.distributed.all_gather_object(everyone, session.loss.completions())
    if session.env.is_main and any(everyone):
        with (session.out_dir / COMPLETIONS_FILE).open("a") as f:
            for part in everyone:
                for r in part:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
