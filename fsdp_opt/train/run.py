"""The training run: a session set up (train/build.py), then a short loop over optimizer steps.

train():  for each step: micro-batches forward/backward -> global norm -> unscale+clip -> step -> log -> save
"""

from __future__ import annotations

import time

from fsdp_opt.base import NotPushedError
from fsdp_opt.checkpoint.atomic import remove_stale_temp
from fsdp_opt.config.parse import Config
from fsdp_opt.engine.fp16watch import Fp16Overflow
from fsdp_opt.engine.step import train_step
from fsdp_opt.planner.steptime import step_time_line
from fsdp_opt.runtime.distributed import barrier, init_distributed, print0, teardown
from fsdp_opt.runtime.hostmem import configure_allocator, freeze_imported
from fsdp_opt.runtime.stopping import WRITE_FAILED, StopControl, resume_command
from fsdp_opt.tracking.metrics import REPLACED, set_aside
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
        train_session(session)
        for line in (step_time_line(session.step_seconds, session.predicted_step), gpu_memory_line(env)):
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


def train_session(s: Session) -> None:
    """The session's range, then (--session_ranges) those after it while they fit; the export; the last writes."""
    if s.env.is_main:  # one record per step: an earlier run's records of the steps this session trains move aside
        for name, count in set_aside(s.out_dir, s.state.global_step).items():
            print0(
                f"{name}: {count} record(s) of the steps after global step {s.state.global_step}, from an earlier run "
                f"of the steps this session trains, moved to {name.removesuffix('.jsonl') + REPLACED}"
            )
    stop = StopControl(s.config.checkpoint.time_limit_seconds)
    s.clock_started = stop.started
    try:
        finished, ranges = train(s, stop), 1
        while finished and next_in_session(s, stop, ranges):
            finished, ranges = train(s, stop), ranges + 1
        if finished and s.config.checkpoint.export_hf:
            export_final(s)
        wait_for_writes(s)
    finally:
        stop.close()


def train(s: Session, stop: StopControl) -> bool:
    """The epochs of this slice (one range of an auto chain: one epoch); False when it stopped early."""
    tc = s.config.train
    if s.env.is_main:
        for p in remove_stale_temp(s.out_dir):
            print0(f"removed {p.name}, left by an interrupted save")
    first_epoch = s.state.epoch
    epochs = 1 if s.config.data.range_size is not None else tc.num_epochs
    for epoch in range(first_epoch, first_epoch + epochs):
        s.state.epoch = epoch
        progress = Progress(s.env.is_main, s.plan.steps_per_epoch(s.state.offset, s.state.within), f"epoch {epoch + 1}")
        try:
            reason = run_epoch(s, epoch, stop, progress)
        finally:
            progress.close()  # also on an error: the error line then starts a line of its own
        if reason:
            _stop_early(s, reason)
            return False
        s.state.epoch, s.state.offset, s.state.within = epoch + 1, 0, 0
        if s.chain is not None:
            s.chain.ranges_done += 1
        save(s, epoch_end=True)
    return True


def run_epoch(s: Session, epoch: int, stop: StopControl, progress: Progress) -> str | None:
    """The steps of one epoch from the saved position; returns the agreed reason to stop early, if any."""
    cc = s.config.checkpoint
    for step in s.plan.steps(epoch, s.state.offset, s.state.within):
        reason = stop.check(save_estimate(s), write_failed=bool(s.ckpt_writer and s.ckpt_writer.error))
        if reason == WRITE_FAILED:
            raise_if_write_failed(s)
        if reason:
            return reason
        step_started = time.perf_counter()
        record = train_step(s, step)
        s.step_seconds.append(time.perf_counter() - step_started)
        stop.observe_step(s.step_seconds[-1])
        s.state.offset, s.state.within = step.end_offset, step.within_after
        s.count_step(step)
        record["elapsed"] = round(stop.elapsed(), 3)
        record["skipped_rate"], warning, overflow = s.skip_watch.observe(record["skipped"], record["loss_scale"])
        s.writer.write(record, s.method.fields)
        s.wandb.log_step(record)
        s.method.after_step(s, record)
        if s.uploader is not None:
            log_pushed(s)
        progress.update(record["loss"], record["tokens_per_second"], **{k: record[k] for k in s.method.shown})
        if warning:
            print0(warning)
        if overflow:
            raise Fp16Overflow(overflow)
        epoch_done = step.end_offset >= s.plan.num_samples
        if cc.save_every_steps and s.state.global_step % cc.save_every_steps == 0 and not epoch_done:
            save(s, epoch_end=False)
    return None


def _stop_early(s: Session, reason: str) -> None:
    print0(f"stopping: {reason} at global step {s.state.global_step}")
    path = s.last_saved_path  # saved at this very step already (an epoch end just before the stop, say)
    if s.last_saved_step != s.state.global_step or path is None:
        path = save(s, epoch_end=False, evaluate=False)  # no time for an evaluation now
    wait_for_writes(s)
    print0("resume with:\n  " + resume_command(path.name, same=s.config.data.range_size is not None))
