"""Building a session in a fixed order: check the flags -> read the checkpoint to resume -> read model config,
tokenizer and data -> build the model (meta, adapters, layout, shard, weights) -> optimizer, scaler, schedule and
position -> the side work (summary, fp16 probe, uploads, W&B). Every step is agreed across ranks."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from fsdp_opt.base import ConfigError
from fsdp_opt.checkpoint.drift import CHANGES_KEY
from fsdp_opt.checkpoint.read import check_compatible
from fsdp_opt.checkpoint.resume import Resume
from fsdp_opt.checkpoint.save import BackgroundWriter
from fsdp_opt.config.choices import AUTO, DTYPES, shard_count
from fsdp_opt.config.parse import Config
from fsdp_opt.data.pin import packed_as, pinned_revision, with_range
from fsdp_opt.data.prompts import check_groups, generation_slices
from fsdp_opt.data.resolve import DataSource
from fsdp_opt.data.sources import check_exists
from fsdp_opt.engine.fp16watch import overflow_probe
from fsdp_opt.engine.loss import HeadLoss
from fsdp_opt.engine.optim import LossScaler, LRSchedule, build_optimizer
from fsdp_opt.engine.step import TrainState, first_batch_loss
from fsdp_opt.hub.lease import Lease
from fsdp_opt.hub.store import read_resume
from fsdp_opt.model.adapters import KEY, Adapters, check_resume
from fsdp_opt.model.parallelize import fp32_products_on_cpu, initialize, resolve_precision, shard_model, tie_and_check
from fsdp_opt.model.shapes import count_params, flops_per_token
from fsdp_opt.model.sources import ModelSource, build_meta_model, model_tag, resolve_model
from fsdp_opt.planner.layout import Layout, choose_layout
from fsdp_opt.runtime.distributed import (
    DistEnv,
    all_ranks_ok,
    broadcast_object,
    cap_gpu_memory,
    print0,
)
from fsdp_opt.runtime.gpus import peak_flops
from fsdp_opt.runtime.hostmem import release_host_memory
from fsdp_opt.runtime.torchao_gate import check_for_nf4
from fsdp_opt.tracking.metrics import MetricsWriter
from fsdp_opt.tracking.wandb_run import WandbRun
from fsdp_opt.train.chain import start_status
from fsdp_opt.train.chain_scores import read_run_tasks, start_scores
from fsdp_opt.train.inputs import Loaded, check_pin, read_inputs, refuse_changed_mixture_now
from fsdp_opt.train.methods import Method, method_for
from fsdp_opt.train.publish import start_uploader
from fsdp_opt.train.saving import uses_async_save
from fsdp_opt.train.session import Session, seed_dropout, step_plan
from fsdp_opt.train.summary import print_summary


@dataclass
class Checked:
    """What the flags name, checked on every rank before anything is read or built."""

    source: ModelSource
    precision: str  # --precision, with auto decided for this device
    accum_steps: int | None  # --accum_steps, or what --global_batch implies for this many ranks (None: auto decides)
    tasks: Any = None  # --eval_tasks, read (engine/benchmarks.py Tasks)


@dataclass
class Built:
    """The sharded model with its weights in place, and what building it decided."""

    model: nn.Module
    adapters: Adapters | None
    layout: Layout
    block_classes: set[type]
    units: int
    head_loss: HeadLoss | None
    n_params: int  # of the model without adapters
    flops_per_token: float


def setup(config: Config, env: DistEnv, checked: Checked | None = None, lease: Lease | None = None) -> Session:
    """The fixed order: check the flags (unless `run` did) -> read the checkpoint to resume -> read model config,
    tokenizer and data -> build the model (meta, adapters, layout, shard, weights) -> optimizer and position -> the
    session and its side work (summary, fp16 probe, uploads, W&B). Every step is agreed across ranks: a user error
    anywhere stops all."""
    checked = checked or check_flags(config, env)
    read_started = time.perf_counter()
    payload = all_ranks_ok(
        lambda: (
            read_resume(
                config.checkpoint.resume_file,
                Path(config.checkpoint.output_dir),
                config.hub.hf_repo,
                config.hub.hub_retries,
            )
            if env.is_main
            else None
        )
    )
    resume = Resume.of(payload, config, env, time.perf_counter() - read_started)
    del payload
    pin = resume.pin
    # a Hub dataset is read at the revision the chain recorded, unless --dataset_revision names one
    revision = broadcast_object(config.data.dataset_revision or pinned_revision(pin, DataSource.of(config.data)))
    method = method_for(config)
    inputs = read_inputs(config, checked.source, method, revision, pin)
    data_source = all_ranks_ok(
        lambda: (
            check_pin(config, method, pin, inputs.data, inputs.tokenizer, inputs.model_config, resume.trained_range)
            if env.is_main
            else None
        )
    )
    # what the flags leave open, decided before anything is loaded: a method's work before the model (a reference
    # pass) may score the micro-batches training will run
    layout = all_ranks_ok(
        lambda: choose_layout(
            config, env, inputs.model_config, checked.precision, checked.accum_steps, gpu=cap_gpu_memory(config, env)
        )
    )
    method.before_model(inputs.data, env, resume.payload, checked.precision, inputs.tokenizer, layout)
    built = build_model(config, env, checked, inputs, resume.payload, method, layout)
    session = make_session(config, env, checked, inputs, built, method)
    method.after_model(session)
    session.benchmarks = start_scores(session, checked.tasks, resume.payload)  # before handover drops the payload
    session.lease = lease
    session.data_revision = revision
    if env.is_main:
        d = inputs.data
        session.data_pin = with_range(
            pin,
            data_source,
            config.data.start_idx,
            d.end_idx,
            d.rows_digest,
            d.tokens_digest,
            packed_as(config.data.max_length, config.data.packing),
        )
    run_id, saved_chain = None, None
    if resume.resuming:
        session.settings_changes = resume.record_changes(config, session.plan.global_batch, env)
        session.state = resume.restore_into(
            built.model,
            session.optimizer,
            session.scaler,
            config,
            env,
            inputs.data.end_idx,
            len(inputs.data.blocks),
            session.rows,
            session.chat_template,
        )
        run_id, saved_chain = resume.handover(env)
    session.chain = start_status(session, saved_chain, inputs.data.rows)
    session.chain_seconds_before = session.chain.train_seconds
    tie_and_check(built.model)
    built.model.train()
    start_side_work(session, built, run_id, inputs.bf16_pretrained)
    release_host_memory()  # every rank: what reading the weights (and a checkpoint) left, so the steps start clean
    return session


def check_flags(config: Config, env: DistEnv) -> Checked:
    mc, pc, cc, lc = config.model, config.parallel, config.checkpoint, config.lora
    source = all_ranks_ok(lambda: resolve_model(mc.model))
    precision = all_ranks_ok(lambda: resolve_precision(pc.precision, env.device))
    if lc.enabled and lc.base_bits == 4:
        all_ranks_ok(check_for_nf4)  # the torch/torchao pair, before anything is built
    if pc.cpu_offload and env.device.type != "cuda":
        raise ConfigError("--cpu_offload: only useful with CUDA devices (the run is on CPU already)")
    if pc.reduce_dtype == "fp16" and precision != "fp16":
        raise ConfigError(
            f"--reduce_dtype fp16: only with fp16 compute (this run computes in {precision}; --precision fp16)"
        )
    if cc.export_merge and not (lc.enabled and cc.export_hf):
        raise ConfigError("--export_merge: only for a LoRA run (--lora_rank) with --export_hf DIR")
    # the dataset is there, and what the method names (reward functions): before the chain's lease is taken or
    # anything is built
    all_ranks_ok(lambda: check_exists(DataSource.of(config.data), config.data.eval_split) if env.is_main else None)
    all_ranks_ok(lambda: refuse_changed_mixture_now(config) if env.is_main else None)
    method_for(config).check()
    auto = config.train.batch_size == AUTO
    if config.method.spec.generates:  # a step's completions: whole groups of --num_generations
        check_groups(config.train.samples_per_step(env.world_size), config.method.completions_per_prompt)
        generation_slices(config.method.steps_per_generation, None if auto else config.train.accum_for(env.world_size))
    tasks = read_run_tasks(config, env)  # --eval_tasks: resolved and read before the lease and the model
    return Checked(source, precision, None if auto else config.train.accum_for(env.world_size), tasks)


def build_model(
    config: Config,
    env: DistEnv,
    checked: Checked,
    inputs: Loaded,
    payload: dict[str, Any] | None,
    method: Method,
    layout: Layout,
) -> Built:
    """Meta model -> adapters -> resume checks (rank 0 holds the payload) -> shard in the layout (with activation
    checkpointing) -> weights."""
    mc, tc, pc, lc = config.model, config.train, config.parallel, config.lora
    resuming = bool(config.checkpoint.resume_file)
    model = build_meta_model(inputs.model_config)
    n_params = count_params(model)  # the model's own, before any adapters
    fpt = flops_per_token(model, config.data.max_length, frozen_base=lc.enabled)
    lc = method.lora(lc)
    adapters = Adapters(lc, mc.model, DTYPES[checked.precision], tc.seed) if lc.enabled else None
    if adapters is not None:
        shards = shard_count(layout.strategy, env.world_size, env.local_world_size)
        all_ranks_ok(lambda: adapters.add_to(model, shards))
    head_loss = all_ranks_ok(lambda: HeadLoss.for_run(model, layout.loss_chunk_tokens))
    if resuming:

        def check() -> None:
            path = Path(payload["_path"])
            same_base = check_resume(payload.get(KEY), adapters.identity() if adapters else None, path)
            if adapters is None or same_base:  # else checked once the base is read
                check_compatible(payload, model, path)

        all_ranks_ok(lambda: check() if env.is_main else None)
    block_classes, units = shard_model(
        model,
        env,
        strategy=layout.strategy,
        precision=checked.precision,
        reduce_dtype=layout.reduce_dtype,
        activation_checkpointing=layout.activation_checkpointing,
        offload=layout.cpu_offload,
        compile_blocks=pc.compile,
        prefetch=pc.prefetch,
        ignored=adapters.unsharded(model) if adapters else None,
    )
    fp32_products_on_cpu(model, env.device, checked.precision)
    # A LoRA run always loads its base from --model; a checkpoint holds only the adapters.
    initialize(
        model,
        env,
        checked.source,
        inputs.model_config,
        tc.seed,
        weights=not resuming or adapters is not None,
        loader=adapters.load_weights if adapters else None,
        **(adapters.load_options() if adapters else {}),
    )
    if adapters is not None:
        adapters.share_fingerprint(env)
        if resuming:

            def check_base() -> None:
                path = Path(payload["_path"])
                check_resume(payload.get(KEY), adapters.identity(), path)
                check_compatible(payload, model, path)

            all_ranks_ok(lambda: check_base() if env.is_main else None)
    return Built(model, adapters, layout, block_classes, units, head_loss, n_params, fpt)


def make_session(
    config: Config, env: DistEnv, checked: Checked, inputs: Loaded, built: Built, method: Method
) -> Session:
    """Optimizer, loss scaler, schedule and the data order around the built model; the position starts fresh."""
    tc = config.train
    model = built.model
    optimizer = build_optimizer(model, tc.lr, tc.weight_decay, env.device)
    seed_dropout(config, env)
    out_dir = Path(config.checkpoint.output_dir)
    return Session(
        config=config,
        env=env,
        model=model,
        optimizer=optimizer,
        schedule=LRSchedule(tc.lr, tc.warmup_steps, tc.lr_schedule, tc.lr_decay_steps, tc.min_lr_ratio),
        scaler=LossScaler(enabled=checked.precision == "fp16", init_scale=tc.init_loss_scale),
        blocks=inputs.data.blocks,
        plan=step_plan(config, env, method, inputs.data.blocks, built.layout.batch_size, built.layout.accum_steps),
        method=method,
        state=TrainState(epoch=tc.initial_epoch),
        writer=MetricsWriter(out_dir, enabled=env.is_main),
        tag=model_tag(config.model.model),
        end_idx=inputs.data.end_idx,
        precision=checked.precision,
        layout=built.layout,
        flops_per_token=built.flops_per_token,
        peak_flops=peak_flops(env.device),
        out_dir=out_dir,
        model_config=inputs.model_config,
        tokenizer=inputs.tokenizer,
        n_params=built.n_params,
        params=[p for p in model.parameters() if p.requires_grad],
        eval_blocks=inputs.data.eval_blocks,
        eval_label=inputs.data.eval_label,
        head_loss=built.head_loss,
        rows=inputs.data.spec.key(inputs.data.train_on),
        lora=built.adapters.identity() if built.adapters else None,
        ckpt_writer=BackgroundWriter() if uses_async_save(config, env.device.type) else None,
    )


def start_side_work(s: Session, built: Built, run_id: str | None, bf16_pretrained: bool) -> None:
    """The summary, the fp16 overflow probe, the Hub uploader (rank 0) and the W&B run."""
    config, env = s.config, s.env
    print_summary(s, built.block_classes, built.units, s.n_params)
    probe = overflow_probe(bf16_pretrained, s.precision, lambda: first_batch_loss(s), config.model.model)
    if probe:
        print0(probe)
    s.uploader = all_ranks_ok(lambda: start_uploader(s) if env.is_main and config.hub.hf_repo else None)
    wc = config.wandb
    wandb_config = {
        **s.flags(),
        "world_size": env.world_size,
        "global_batch": s.plan.global_batch,
        "parameters": s.n_params,
        CHANGES_KEY: s.settings_changes,
    }
    s.wandb = WandbRun(
        enabled=env.is_main,
        project=wc.wandb_project,
        mode=wc.wandb_mode,
        run_id=None if wc.wandb_new_run else run_id,
        config=wandb_config,
        out_dir=s.out_dir,
    )
