"""The training run: set up in a fixed order, then a short loop over optimizer steps.

setup():  flags -> process group -> tokenizer + data (validated) -> checkpoint (validated) -> model on meta
          -> activation checkpointing -> shard -> weights -> optimizer, scaler, schedule, position
train():  for each step: micro-batches forward/backward -> global norm -> unscale+clip -> step -> log -> save
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from .atomic import remove_stale_temp
from . import parallelize as par
from .config import Config
from .data import StepBatch, StepPlan, build_blocks, held_out_texts, load_rows, model_inputs, select_texts
from .distributed import (
    DistEnv,
    all_ranks_ok,
    barrier,
    cap_gpu_memory,
    init_distributed,
    print0,
    rank0_first,
    teardown,
)
from .errors import ConfigError
from .fp16watch import Fp16Overflow, overflow_probe, trained_in_bf16
from . import lora
from .lora import Adapters
from .loss import ChunkedLoss, causal_lm_loss_sum
from .models import (
    build_meta_model,
    load_model_config,
    load_tokenizer,
    max_positions,
    model_tag,
    resolve_model,
)
from .hostmem import configure_allocator, release_host_memory
from .resume import read_resume, restore
from .saving import (
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
from .session import Session
from .summary import print_summary
from .torchao_gate import check_for_nf4
from .steptime import choose_layout, step_time_line
from .stopping import WRITE_FAILED, StopControl, resume_command
from .optim import LossScaler, LRSchedule, build_optimizer, global_grad_norm, unscale_and_clip_
from .tracking import (
    MetricsWriter,
    Progress,
    WandbRun,
    count_params,
    flops_per_token,
    gpu_memory_line,
    host_peaks_line,
    peak_flops,
    peak_memory_bytes,
)


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
    precision = all_ranks_ok(lambda: par.resolve_precision(pc.precision, env.device))
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
    adapters = Adapters(lc, mc.model, par.DTYPES[precision], tc.seed) if lc.enabled else None
    if adapters is not None:
        shards = 1 if pc.sharding_strategy == "NO_SHARD" else env.local_world_size if pc.sharding_strategy == "HYBRID_SHARD" else env.world_size
        all_ranks_ok(lambda: adapters.add_to(model, shards))
    chunked_loss = all_ranks_ok(lambda: ChunkedLoss(model, tc.loss_chunk_tokens) if tc.loss_chunk_tokens else None)
    if cc.resume_file:
        def check() -> None:
            path = Path(payload["_path"])
            same_base = lora.check_resume(payload.get(lora.KEY), adapters.identity() if adapters else None, path)
            if adapters is None or same_base:  # else checked once the base is read
                ckpt.check_compatible(payload, model, path)

        all_ranks_ok(lambda: check() if env.is_main else None)
    reduce_each, prediction = all_ranks_ok(lambda: choose_layout(config, env, model_config, precision, gpu=cap_gpu_memory(config, env)))
    block_classes, units = par.shard_model(
        model, env, strategy=pc.sharding_strategy, precision=precision,
        activation_checkpointing=pc.activation_checkpointing, offload=pc.cpu_offload, compile_blocks=pc.compile,
        prefetch=pc.prefetch, ignored=adapters.unsharded(model) if adapters else None,
    )  # fmt: skip
    resuming = bool(cc.resume_file)
    # A LoRA run always loads its base from --model; a checkpoint holds only the adapters.
    par.initialize(model, env, source, model_config, tc.seed, weights=not resuming or adapters is not None,
                   loader=adapters.load_weights if adapters else None,
                   **(adapters.load_options() if adapters else {}))  # fmt: skip
    if adapters is not None:
        adapters.share_fingerprint(env)
        if resuming:
            def check_base() -> None:
                lora.check_resume(payload.get(lora.KEY), adapters.identity(), Path(payload["_path"]))
                ckpt.check_compatible(payload, model, Path(payload["_path"]))

            all_ranks_ok(lambda: check_base() if env.is_main else None)
    optimizer = build_optimizer(model, tc.lr, tc.weight_decay, env.device)
    scaler = LossScaler(enabled=precision == "fp16", init_scale=tc.init_loss_scale)
    torch.manual_seed(tc.seed + 7919 * env.rank)  # dropout masks: per rank, reproducible
    state = ckpt.TrainState(epoch=tc.initial_epoch)
    run_id = None
    if resuming:
        load_started = time.perf_counter()
        state = restore(model, optimizer, scaler, payload, config, env, end_idx, len(blocks))
        print0(f"  checkpoint found and read in {read_seconds:.1f} s, loaded into the shards in "
               f"{time.perf_counter() - load_started:.1f} s")  # fmt: skip
        run_id = payload.get("wandb_run_id") if env.is_main else None
        del payload  # rank 0's copy of the checkpoint: gone before the first save gathers another
        release_host_memory()
    par.tie_and_check(model)
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


def accumulate(s: Session, step: StepBatch, scale: float = 1.0) -> torch.Tensor:
    """Forward and backward over this rank's micro-batches of `step`; returns this rank's summed token loss.

    The gradients add up to `scale` times the token mean over the whole step (all ranks): each micro-batch's loss
    sum is divided by the step's global target count.
    """
    model, env = s.model, s.env
    weight = scale / max(1, step.target_tokens)
    loss_sum = torch.zeros((), device=env.device, dtype=torch.float32)
    n_micro = len(step.micro_batches)
    for i, index in enumerate(step.micro_batches):
        if not s.reduce_each_microbatch:
            model.set_requires_gradient_sync(i == n_micro - 1)
        batch = s.blocks.batch(index, env.device)
        chunked = s.chunked_loss
        with chunked.hidden_states() if chunked else nullcontext():
            # With a chunked loss `.logits` holds the final hidden states: the projection runs in the loss.
            out = model(**model_inputs(batch)).logits
        loss = chunked.loss_sum(out, batch["labels"]) if chunked else causal_lm_loss_sum(out, batch["labels"])
        (loss * weight).backward()
        loss_sum += loss.detach()
    return loss_sum


def first_batch_loss(s: Session) -> torch.Tensor:
    """The mean loss of this session's first micro-batch (summed over ranks), in eval mode: no dropout draws, so the
    training that follows is the same with or without this forward. Every rank calls it."""
    first = next(iter(s.plan.steps(s.state.epoch, s.state.offset)), None)
    total = torch.zeros(2, device=s.env.device, dtype=torch.float32)
    if first is not None and first.micro_batches:
        batch = s.blocks.batch(first.micro_batches[0], s.env.device)
        s.model.eval()
        try:
            chunked = s.chunked_loss
            with chunked.hidden_states() if chunked else nullcontext():
                out = s.model(**model_inputs(batch)).logits
            loss = chunked.loss_sum(out, batch["labels"]) if chunked else causal_lm_loss_sum(out, batch["labels"])
        finally:
            s.model.train()
        total[0] = loss.float()
        total[1] = (batch["labels"][:, 1:] != -100).sum()
    if s.env.world_size > 1:
        dist.all_reduce(total)
    return total[0] / total[1].clamp(min=1)


def train_step(s: Session, step: StepBatch) -> dict[str, Any]:
    started = time.perf_counter()
    env = s.env
    lr = s.schedule(s.state.global_step)
    for group in s.optimizer.param_groups:
        group["lr"] = lr
    scale = s.scaler.scale
    loss_sum = accumulate(s, step, scale)
    scaled_norm = global_grad_norm(s.params)
    if env.world_size > 1:
        dist.all_reduce(loss_sum)
    # The one host sync of the step: loss for the log, norm for the skip decision (same on all ranks).
    loss_total, norm_scaled = torch.stack([loss_sum, scaled_norm.float().to(loss_sum.device)]).tolist()
    finite = math.isfinite(loss_total) and math.isfinite(norm_scaled)
    if finite:
        unscale_and_clip_(s.params, scaled_norm, scale, s.config.train.max_grad_norm)
        s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    s.scaler.update(finite)
    s.state.global_step += 1
    seconds = time.perf_counter() - started
    tokens_per_second = step.target_tokens / seconds if seconds > 0 else 0.0
    loss_mean = loss_total / max(1, step.target_tokens)
    s.last_loss = loss_mean
    record: dict[str, Any] = {
        "step": s.state.global_step,
        "epoch": step.epoch,
        "loss": loss_mean,
        "lr": lr,
        "grad_norm": norm_scaled / scale,
        "loss_scale": scale,
        "tokens": step.target_tokens,
        "tokens_per_second": tokens_per_second,
        "elapsed": 0.0,
        "skipped": not finite,
        "skipped_steps": s.scaler.skipped_steps,
        "slice": f"{s.config.data.start_idx}-{s.end_idx}",
        "skipped_rate": 0.0,  # set by the loop's SkipWatch
    }
    if s.peak_flops:
        record["mfu"] = tokens_per_second * s.flops_per_token / (s.peak_flops * env.world_size)
    mem = peak_memory_bytes(env.device)
    if mem is not None:
        record["peak_memory_bytes"] = mem
    if not finite and not s.scaler.enabled:
        print0(f"warning: step {s.state.global_step}: non-finite loss or gradient norm; the update was skipped")
    return record
