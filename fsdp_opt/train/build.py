"""Building a session in a fixed order: check the flags -> read the checkpoint to resume -> read model config,
tokenizer and data -> decide the layout -> the method's components that come before the model (a reference pass) ->
build the model (model/loader.py) -> the components that need it (a model kept beside, the decoding) -> the method's
loss and scorer -> optimizer, scaler, schedule and the position (a checkpoint restored) -> the session, then its side
work (summary, fp16 probe, uploads, W&B). Every step is agreed across ranks; the session is made once, at the end."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from fsdp_opt.base import ConfigError
from fsdp_opt.checkpoint.drift import CHANGES_KEY
from fsdp_opt.checkpoint.read import check_compatible
from fsdp_opt.checkpoint.resume import Resume, position, slice_key
from fsdp_opt.checkpoint.save import BackgroundWriter
from fsdp_opt.config.choices import AUTO
from fsdp_opt.config.layout import LoraConfig
from fsdp_opt.config.methods import TEACHER, MethodSpec
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
from fsdp_opt.model.loader import Build, Loaded, head_layers, load_model, meta_model
from fsdp_opt.model.parallelize import DTYPES, resolve_precision, tie_and_check
from fsdp_opt.model.shapes import count_params, flops_per_token
from fsdp_opt.model.sources import ModelSource, load_model_config, model_tag, resolve_model
from fsdp_opt.planner.layout import Layout, choose_layout
from fsdp_opt.runtime.distributed import DistEnv, all_ranks_ok, broadcast_object, cap_gpu_memory, peak_flops, print0
from fsdp_opt.runtime.hostmem import release_host_memory
from fsdp_opt.runtime.torchao_gate import check_for_nf4
from fsdp_opt.tracking.metrics import MetricsWriter
from fsdp_opt.tracking.wandb_run import WandbRun
from fsdp_opt.train import components as parts_of
from fsdp_opt.train.chain import start_status
from fsdp_opt.train.chain_scores import read_run_tasks, start_scores
from fsdp_opt.train.components import Components, Setup
from fsdp_opt.train.inputs import Inputs, check_pin, read_inputs, refuse_changed_mixture_now
from fsdp_opt.train.methods import Method, method_for
from fsdp_opt.train.methods.base import PlanInput, RunParts
from fsdp_opt.train.publish import start_uploader
from fsdp_opt.train.reference import Frozen
from fsdp_opt.train.saving import uses_async_save
from fsdp_opt.train.session import Position, Session, seed_dropout
from fsdp_opt.train.summary import print_summary


@dataclass
class Checked:
    """What the flags name, checked on every rank before anything is read or built."""

    source: ModelSource
    precision: str  # --precision, with auto decided for this device
    accum_steps: int | None  # --accum_steps, or what --global_batch implies for this many ranks (None: auto decides)
    method: Method  # the run's method, with its settings
    components: Components  # what its flags name, had (its reward functions)
    tasks: Any = None  # --eval_tasks, read (engine/benchmarks.py Tasks)


def setup(config: Config, env: DistEnv, checked: Checked | None = None, lease: Lease | None = None) -> Session:
    """The fixed order (this module's docstring). Every step is agreed across ranks: a user error anywhere stops
    all."""
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
    method = checked.method
    inputs = read_inputs(config, checked.source, method, revision, pin)
    data_source = all_ranks_ok(
        lambda: (
            check_pin(config, method, pin, inputs.data, inputs.tokenizer, inputs.model_config, resume.trained_range)
            if env.is_main
            else None
        )
    )
    # what the flags leave open, decided before anything is loaded, with the method's phases (a generation, a model
    # beside): a method's work before the model (a reference pass) may score the micro-batches training will run
    beside = beside_config(config, method.spec, env)
    layout = all_ranks_ok(
        lambda: choose_layout(
            config,
            env,
            inputs.model_config,
            checked.precision,
            checked.accum_steps,
            gpu=cap_gpu_memory(config, env),
            beside=beside,
        )
    )
    data = inputs.data
    plan = method.plan(
        data.blocks, PlanInput(layout.batch_size, layout.accum_steps, env.rank, env.world_size, config.train.seed)
    )
    made = Setup(
        env=env,
        model_name=config.model.model,
        model_config=inputs.model_config,
        tokenizer=inputs.tokenizer,
        lora=config.lora.enabled,
        sequences=data.blocks,
        held_out=data.eval_blocks,
        plan=plan,
        epochs=trained_epochs(config, env, resume, inputs),
        batch_size=layout.batch_size,
        gather=layout.gathered,
        allow_changes=config.checkpoint.allow_changes,
    )
    how = Frozen(
        env,
        checked.precision,
        layout.strategy,
        inputs.tokenizer,
        config.model.model,
        config.model.attn_implementation,
        config.train.seed,
    )
    components = parts_of.before_model(checked.components, how, resume.payload, made)
    built, adapters, n_params, fpt = build_model(config, env, checked, inputs, resume.payload, method.spec, layout)
    head_loss = all_ranks_ok(lambda: HeadLoss.for_run(built.model, layout.loss_chunk_tokens))
    components = parts_of.after_model(components, built.model, head_loss, how, made)
    # --eval_tasks: the scoring's plan, and the step the resumed checkpoint was scored at (before handover)
    benchmarks = start_scores(
        checked.tasks, resume.payload, inputs.model_config, inputs.tokenizer, env, checked.precision, layout, config
    )
    parts = RunParts(
        env,
        inputs.model_config,
        inputs.tokenizer,
        head_loss,
        data.blocks,
        data.eval_blocks,
        layout.batch_size,
        components,
    )
    loss = method.loss(parts)
    scorer = method.scorer(parts) if data.eval_blocks is not None else None
    model = built.model
    tc = config.train
    optimizer = build_optimizer(model, tc.lr, tc.weight_decay, env.device)
    scaler = LossScaler(enabled=checked.precision == "fp16", init_scale=tc.init_loss_scale)
    seed_dropout(config, env)
    state, changes, run_id, saved_chain = TrainState(epoch=tc.initial_epoch), [], None, None
    if resume.resuming:
        changes = resume.record_changes(config, plan.global_batch, env, components.changes)
        state = resume.restore_into(
            model,
            optimizer,
            scaler,
            config,
            env,
            data.end_idx,
            len(data.blocks),
            data.spec.key(data.train_on),
            inputs.tokenizer.chat_template,
        )
        run_id, saved_chain = resume.handover(env)
    data_pin = None
    if env.is_main:
        data_pin = with_range(
            pin,
            data_source,
            config.data.start_idx,
            data.end_idx,
            data.rows_digest,
            data.tokens_digest,
            packed_as(config.data.max_length, config.data.packing),
        )
    chain = start_status(config, data.end_idx, state, plan, saved_chain, data.rows)
    tie_and_check(model)
    model.train()
    out_dir = Path(config.checkpoint.output_dir)
    session = Session(
        config=config,
        env=env,
        model=model,
        optimizer=optimizer,
        schedule=LRSchedule(tc.lr, tc.warmup_steps, tc.lr_schedule, tc.lr_decay_steps, tc.min_lr_ratio),
        scaler=scaler,
        blocks=data.blocks,
        plan=plan,
        writer=MetricsWriter(out_dir, enabled=env.is_main),
        tag=model_tag(config.model.model),
        end_idx=data.end_idx,
        precision=checked.precision,
        layout=layout,
        flops_per_token=fpt,
        peak_flops=peak_flops(env.device),
        out_dir=out_dir,
        model_config=inputs.model_config,
        tokenizer=inputs.tokenizer,
        method=method,
        components=components,
        loss=loss,
        position=Position(state, chain, chain_seconds_before=chain.train_seconds),
        scorer=scorer,
        n_params=n_params,
        params=[p for p in model.parameters() if p.requires_grad],
        eval_blocks=data.eval_blocks,
        eval_label=data.eval_label,
        head_loss=head_loss,
        rows=data.spec.key(data.train_on),
        lora=adapters.identity() if adapters else None,
        settings_changes=changes,
        data_pin=data_pin,
        data_revision=revision,
        lease=lease,
        benchmarks=benchmarks,
        ckpt_writer=BackgroundWriter() if uses_async_save(config, env.device.type) else None,
    )
    session = start_side_work(session, built, run_id, inputs.bf16_pretrained)
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
    method = method_for(config.method)
    components = parts_of.check(method.spec, method.settings, env)
    auto = config.train.batch_size == AUTO
    if method.spec.generates:  # a step's completions: whole groups of --num_generations
        settings = method.settings
        check_groups(config.train.samples_per_step(env.world_size), settings.completions_per_prompt)
        generation_slices(
            getattr(settings, "steps_per_generation", None), None if auto else config.train.accum_for(env.world_size)
        )
    tasks = read_run_tasks(config, env)  # --eval_tasks: resolved and read before the lease and the model
    return Checked(
        source, precision, None if auto else config.train.accum_for(env.world_size), method, components, tasks
    )


def beside_config(config: Config, spec: MethodSpec, env: DistEnv) -> Any:  # noqa: ANN401
    """The config of the model a method keeps beside the trained one where it is another model (a teacher): the
    layout counts its memory and its forward at its own size."""
    if TEACHER not in spec.needs:
        return None
    name = config.method.settings.teacher_model
    return all_ranks_ok(lambda: load_model_config(resolve_model(name), config.model.attn_implementation))


def trained_epochs(config: Config, env: DistEnv, resume: Resume, inputs: Inputs) -> range:
    """The epochs of the slice this session trains: from the checkpoint's own (a resume inside the slice) or the
    first, one for a range of an auto chain."""

    def first() -> int:
        if resume.payload is None:
            return config.train.initial_epoch
        d = inputs.data
        here = slice_key(config, d.end_idx, len(d.blocks), d.spec.key(d.train_on), inputs.tokenizer.chat_template)
        return position(config, resume.payload, here, len(d.blocks))[0].epoch

    start = broadcast_object(first() if env.is_main else None)
    return range(start, start + (1 if config.data.range_size is not None else config.train.num_epochs))


def lora_settings(spec: MethodSpec, lc: LoraConfig) -> LoraConfig:
    """The LoRA settings the run builds its adapters with: no adapter dropout either where the method trains without
    dropout (unless --lora_dropout gives one)."""
    if spec.dropout or not lc.enabled or lc.lora_dropout is not None:
        return lc
    return dataclasses.replace(lc, lora_dropout=0.0)


def build_model(
    config: Config,
    env: DistEnv,
    checked: Checked,
    inputs: Inputs,
    payload: dict[str, Any] | None,
    spec: MethodSpec,
    layout: Layout,
) -> tuple[Loaded, Adapters | None, int, float]:
    """The trainable model (model/loader.py), sharded in the layout, its weights in place (a LoRA run: its base from
    --model; the checkpoint's state is loaded once the optimizer exists); with its adapters, the parameters of the
    model without them, and its training FLOPs per token. A resumed checkpoint is checked against the skeleton."""
    mc, tc, pc = config.model, config.train, config.parallel
    lc = lora_settings(spec, config.lora)
    resuming = bool(config.checkpoint.resume_file)
    skeleton = meta_model(inputs.model_config, spec.head)
    n_params = count_params(skeleton)  # the model's own, before any adapters
    fpt = flops_per_token(skeleton, config.data.max_length, frozen_base=lc.enabled)
    del skeleton
    adapters = (
        Adapters(lc, mc.model, DTYPES[checked.precision], tc.seed, head_layers(spec.head)) if lc.enabled else None
    )

    def check(model: nn.Module) -> None:
        if not resuming:
            return

        def on_main() -> None:
            path = Path(payload["_path"])
            same_base = check_resume(payload.get(KEY), adapters.identity() if adapters else None, path)
            if adapters is None or same_base:  # else checked once the base is read
                check_compatible(payload, model, path)

        all_ranks_ok(lambda: on_main() if env.is_main else None)

    build = Build(
        checked.source,
        inputs.model_config,
        checked.precision,
        layout.strategy,
        tc.seed,
        head=spec.head,
        adapters=adapters,
        # A LoRA run always loads its base from --model; a checkpoint holds only the adapters.
        weights=not resuming or adapters is not None,
        activation_checkpointing=layout.activation_checkpointing,
        reduce_dtype=layout.reduce_dtype,
        offload=layout.cpu_offload,
        compile=pc.compile,
        prefetch=pc.prefetch,
    )
    built = load_model(build, env, check)
    if adapters is not None and resuming:

        def check_base() -> None:
            path = Path(payload["_path"])
            check_resume(payload.get(KEY), adapters.identity(), path)
            check_compatible(payload, built.model, path)

        all_ranks_ok(lambda: check_base() if env.is_main else None)
    return built, adapters, n_params, fpt


def start_side_work(session: Session, built: Loaded, run_id: str | None, bf16_pretrained: bool) -> Session:
    """The summary, the fp16 overflow probe, the Hub uploader (rank 0) and the W&B run."""
    config, env = session.config, session.env
    print_summary(session, built.block_classes, built.units, session.n_params)
    probe = overflow_probe(
        bf16_pretrained, session.precision, lambda: first_batch_loss(session, session.blocks), config.model.model
    )
    if probe:
        print0(probe)
    uploader = all_ranks_ok(lambda: start_uploader(session) if env.is_main and config.hub.hf_repo else None)
    wc = config.wandb
    wandb_config = {
        **session.flags(),
        "world_size": env.world_size,
        "global_batch": session.plan.global_batch,
        "parameters": session.n_params,
        CHANGES_KEY: session.settings_changes,
    }
    wandb = WandbRun(
        enabled=env.is_main,
        project=wc.wandb_project,
        mode=wc.wandb_mode,
        run_id=None if wc.wandb_new_run else run_id,
        config=wandb_config,
        out_dir=session.out_dir,
    )
    return dataclasses.replace(session, uploader=uploader, wandb=wandb)
