"""The training run: set up in a fixed order, then a short loop over optimizer steps.

setup():  flags -> process group -> tokenizer + data (validated) -> checkpoint (validated) -> model on meta
          -> activation checkpointing -> shard -> weights -> optimizer, scaler, schedule, position
train():  for each step: micro-batches forward/backward -> global norm -> unscale+clip -> step -> log -> save
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from fsdp_opt.base import ConfigError
from fsdp_opt.checkpoint.atomic import remove_stale_temp
from fsdp_opt.checkpoint.read import check_compatible
from fsdp_opt.checkpoint.resume import read_resume, restore
from fsdp_opt.checkpoint.state import TrainState
from fsdp_opt.config.choices import DTYPES
from fsdp_opt.config.parse import Config
from fsdp_opt.data.blocks import StepPlan, build_blocks
from fsdp_opt.data.sources import held_out_texts, load_rows, select_texts
from fsdp_opt.engine.fp16watch import Fp16Overflow, overflow_probe, trained_in_bf16
from fsdp_opt.engine.loss import ChunkedLoss
from fsdp_opt.engine.optim import LossScaler, LRSchedule, build_optimizer
from fsdp_opt.engine.step import first_batch_loss, train_step
from fsdp_opt.model.adapters import KEY, Adapters, check_resume
from fsdp_opt.model.parallelize import initialize, resolve_precision, shard_model, tie_and_check
from fsdp_opt.model.shapes import count_params, flops_per_token
from fsdp_opt.model.sources import (
    build_meta_model,
    load_model_config,
    load_tokenizer,
    max_positions,
    model_tag,
    resolve_model,
)
from fsdp_opt.planner.steptime import choose_layout, step_time_line
from fsdp_opt.runtime.distributed import (
    DistEnv,
    all_ranks_ok,
    barrier,
    cap_gpu_memory,
    init_distributed,
    print0,
    rank0_first,
    teardown,
)
from fsdp_opt.runtime.gpus import peak_flops
from fsdp_opt.runtime.hostmem import configure_allocator, release_host_memory
from fsdp_opt.runtime.stopping import WRITE_FAILED, StopControl, resume_command
from fsdp_opt.runtime.torchao_gate import check_for_nf4
from fsdp_opt.tracking.metrics import MetricsWriter
from fsdp_opt.tracking.progress import Progress, gpu_memory_line, host_peaks_line
from fsdp_opt.tracking.wandb_run import WandbRun
from fsdp_opt.train.saving import (
    BackgroundWriter,
    export_final,
    finish_outside,
    log_pushed,
    raise_if_write_failed,
    save,
    save_estimate,
    start_uploader,
    uses_async_save,
    wait_for_writes,
)
from fsdp_opt.train.session import Session
from fsdp_opt.train.summary import print_summary


def run(config: Config) -> None:
    configure_allocator()
    env = init_distributed(config.parallel.device)
    session = None
    try:
        session = setup(config, env)
        train(session)
        for line in (step_time_line(session.step_seconds, session.predicted_step), gpu_memory_line(env)):
            if line:
                print0(line)
        print0(host_peaks_line(env.world_size))
        # Every rank reaches the end before any closes its connections: no peer is left mid-transfer.
        barrier()
    finally:
        teardown()
        if session is not None:
            finish_outside(session)


# ---------------------------------------------------------------- setup


def setup(config: Config, env: DistEnv) -> Session:
    mc, dc, tc, pc, cc, lc = config.model, config.data, config.train, config.parallel, config.checkpoint, config.lora
    source = all_ranks_ok(lambda: resolve_model(mc.model))
    precision = all_ranks_ok(lambda: resolve_precision(pc.precision, env.device))
    if lc.enabled and lc.base_bits == 4:
        all_ranks_ok(check_for_nf4)  # the torch/torchao pair, before anything is built
    if pc.cpu_offload and env.device.type != "cuda":
        raise ConfigError("--cpu_offload: only useful with CUDA devices (the run is on CPU already)")
    tc.accum_steps = tc.accum_for(env.world_size)
    if cc.export_merge and not (lc.enabled and cc.export_hf):
        raise ConfigError("--export_merge: only for a LoRA run (--lora_rank) with --export_hf DIR")
    model_config, tokenizer = rank0_first(lambda: (load_model_config(source, mc.attn_implementation), load_tokenizer(source)))
    bf16_pretrained = trained_in_bf16(model_config)  # as the model's files say; loading sets the engine's dtype
    positions = max_positions(model_config)
    if positions is not None and dc.max_length > positions:
        raise ConfigError(f"--max_length {dc.max_length}: {mc.model} has only {positions} positions")

    def read_data() -> tuple[list[str], int, list[str] | None]:
        ds = load_rows(dc.dataset)
        texts, end = select_texts(ds, dc.text_column, dc.start_idx, dc.end_idx)
        return texts, end, held_out_texts(ds, dc.text_column, end, dc.eval_rows)[0] if dc.eval_rows else None

    texts, end_idx, eval_texts = rank0_first(read_data)
    attention = mc.attn_implementation
    blocks = all_ranks_ok(lambda: build_blocks(texts, tokenizer, dc.max_length, dc.packing, attention))
    eval_blocks = None
    if eval_texts is not None:  # docs and pad give the same per-row losses; docs in fewer blocks
        eval_packing = "concat" if dc.packing == "concat" else "docs"
        eval_blocks = all_ranks_ok(lambda: build_blocks(eval_texts, tokenizer, dc.max_length, eval_packing, attention))
    out_dir = Path(cc.output_dir)
    hc = config.hub
    read_started = time.perf_counter()
    payload = all_ranks_ok(
        lambda: read_resume(cc.resume_file, out_dir, hc.hf_repo, hc.hub_retries) if env.is_main else None
    )
    read_seconds = time.perf_counter() - read_started

    model = build_meta_model(model_config)
    n_params = count_params(model)
    fpt = flops_per_token(model, dc.max_length, frozen_base=lc.enabled)
    adapters = Adapters(lc, mc.model, DTYPES[precision], tc.seed) if lc.enabled else None
    if adapters is not None:
        shards = 1 if pc.sharding_strategy == "NO_SHARD" else env.local_world_size if pc.sharding_strategy == "HYBRID_SHARD" else env.world_size
        all_ranks_ok(lambda: adapters.add_to(model, shards))
    chunked_loss = all_ranks_ok(lambda: ChunkedLoss(model, tc.loss_chunk_tokens) if tc.loss_chunk_tokens else None)
    if cc.resume_file:
        def check() -> None:
            path = Path(payload["_path"])
            same_base = check_resume(payload.get(KEY), adapters.identity() if adapters else None, path)
            if adapters is None or same_base:  # else checked once the base is read
                check_compatible(payload, model, path)

        all_ranks_ok(lambda: check() if env.is_main else None)
    reduce_each, prediction = all_ranks_ok(lambda: choose_layout(config, env, model_config, precision, gpu=cap_gpu_memory(config, env)))
    block_classes, units = shard_model(
        model, env, strategy=pc.sharding_strategy, precision=precision,
        activation_checkpointing=pc.activation_checkpointing, offload=pc.cpu_offload, compile_blocks=pc.compile,
        prefetch=pc.prefetch, ignored=adapters.unsharded(model) if adapters else None,
    )  # fmt: skip
    resuming = bool(cc.resume_file)
    # A LoRA run always loads its base from --model; a checkpoint holds only the adapters.
    initialize(model, env, source, model_config, tc.seed, weights=not resuming or adapters is not None,
                   loader=adapters.load_weights if adapters else None,
                   **(adapters.load_options() if adapters else {}))  # fmt: skip
    if adapters is not None:
        adapters.share_fingerprint(env)
        if resuming:
            def check_base() -> None:
                check_resume(payload.get(KEY), adapters.identity(), Path(payload["_path"]))
                check_compatible(payload, model, Path(payload["_path"]))

            all_ranks_ok(lambda: check_base() if env.is_main else None)
    optimizer = build_optimizer(model, tc.lr, tc.weight_decay, env.device)
    scaler = LossScaler(enabled=precision == "fp16", init_scale=tc.init_loss_scale)
    torch.manual_seed(tc.seed + 7919 * env.rank)  # dropout masks: per rank, reproducible
    state = TrainState(epoch=tc.initial_epoch)
    run_id = None
    if resuming:
        load_started = time.perf_counter()
        state = restore(model, optimizer, scaler, payload, config, env, end_idx, len(blocks))
        print0(f"  checkpoint found and read in {read_seconds:.1f} s, loaded into the shards in "
               f"{time.perf_counter() - load_started:.1f} s")  # fmt: skip
        run_id = payload.get("wandb_run_id") if env.is_main else None
        del payload  # rank 0's copy of the checkpoint: gone before the first save gathers another
        release_host_memory()
    tie_and_check(model)
    model.train()

    plan = StepPlan(
        blocks, batch_size=tc.batch_size, accum_steps=tc.accum_steps, rank=env.rank, world_size=env.world_size, seed=tc.seed
    )
    session = Session(
        config=config,
        env=env,
        model=model,
        optimizer=optimizer,
        schedule=LRSchedule(tc.lr, tc.warmup_steps, tc.lr_schedule, tc.lr_decay_steps, tc.min_lr_ratio),
        scaler=scaler,
        blocks=blocks,
        plan=plan,
        state=state,
        writer=MetricsWriter(out_dir, enabled=env.is_main),
        tag=model_tag(mc.model),
        end_idx=end_idx,
        precision=precision,
        flops_per_token=fpt,
        peak_flops=peak_flops(env.device),
        out_dir=out_dir,
        params=[p for p in model.parameters() if p.requires_grad],
        n_params=n_params,
        model_config=model_config,
        tokenizer=tokenizer,
        eval_blocks=eval_blocks,
        reduce_each_microbatch=reduce_each,
        predicted_step=prediction,
        chunked_loss=chunked_loss,
        lora=adapters.identity() if adapters else None,
        ckpt_writer=BackgroundWriter() if uses_async_save(config, env.device.type) else None,
    )
    print_summary(session, block_classes, units, n_params)
    advice = overflow_probe(bf16_pretrained, precision, lambda: first_batch_loss(session), mc.model)
    if advice:
        print0(f"warning: {advice}")
    session.uploader = all_ranks_ok(lambda: start_uploader(session) if env.is_main and hc.hf_repo else None)
    wc = config.wandb
    run_id = None if wc.wandb_new_run else run_id
    wandb_config = {**config.flat(), "world_size": env.world_size, "global_batch": plan.global_batch, "parameters": n_params}
    session.wandb = WandbRun(
        enabled=env.is_main, project=wc.wandb_project, mode=wc.wandb_mode, run_id=run_id, config=wandb_config, out_dir=out_dir
    )
    return session


# ---------------------------------------------------------------- loop


def train(s: Session) -> None:
    tc, cc = s.config.train, s.config.checkpoint
    stop = StopControl(cc.time_limit_seconds)
    if s.env.is_main:
        for p in remove_stale_temp(s.out_dir):
            print0(f"removed {p.name}, left by an interrupted save")
    try:
        first_epoch = s.state.epoch
        for epoch in range(first_epoch, first_epoch + tc.num_epochs):
            s.state.epoch = epoch
            progress = Progress(s.env.is_main, s.plan.steps_per_epoch(s.state.offset), f"epoch {epoch + 1}")
            try:
                reason = run_epoch(s, epoch, stop, progress)
            finally:
                progress.close()  # also on an error: the error line then starts a line of its own
            if reason:
                _stop_early(s, reason)
                return
            s.state.epoch, s.state.offset = epoch + 1, 0
            save(s, epoch_end=True)
        if cc.export_hf:
            export_final(s)
        wait_for_writes(s)
    finally:
        stop.close()


def run_epoch(s: Session, epoch: int, stop: StopControl, progress: Progress) -> str | None:
    """The steps of one epoch from the saved position; returns the agreed reason to stop early, if any."""
    cc = s.config.checkpoint
    for step in s.plan.steps(epoch, s.state.offset):
        reason = stop.check(save_estimate(s), write_failed=bool(s.ckpt_writer and s.ckpt_writer.error))
        if reason == WRITE_FAILED:
            raise_if_write_failed(s)
        if reason:
            return reason
        step_started = time.perf_counter()
        record = train_step(s, step)
        s.step_seconds.append(time.perf_counter() - step_started)
        stop.observe_step(s.step_seconds[-1])
        s.state.offset = step.end_offset
        record["elapsed"] = round(stop.elapsed(), 3)
        record["skipped_rate"], warning, overflow = s.skip_watch.observe(record["skipped"], record["loss_scale"])
        s.writer.write(record)
        s.wandb.log_step(record)
        if s.uploader is not None:
            log_pushed(s)
        progress.update(record["loss"], record["tokens_per_second"])
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
    print0("resume with:\n  " + resume_command(path.name))
