"""What the trainer's flags leave to the plan, decided at setup: the sharding strategy (AUTO), the reduce mode (auto)
and, with `--batch_size auto`, the whole configuration of the step (micro-batch, accumulation, loss chunking,
activation checkpointing, CPU offload, reduce dtype) from the search (`planner.search`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fsdp_opt.base import ConfigError, gib, picked
from fsdp_opt.config.choices import AUTO, STRATEGIES
from fsdp_opt.config.parse import Config
from fsdp_opt.data.prompts import generation_slices
from fsdp_opt.model.shapes import Shape
from fsdp_opt.planner.calibrate import measure
from fsdp_opt.planner.generation import Phase, gathered_fits, with_generation
from fsdp_opt.planner.inputs import Inputs
from fsdp_opt.planner.search import (
    Limits,
    Space,
    change_line,
    cheapest_change,
    chosen,
    describe,
    recommend,
    reduce_dtypes,
)
from fsdp_opt.planner.steptime import Rates, candidates, rates_for
from fsdp_opt.runtime.distributed import DistEnv, cap_gpu_memory, print0
from fsdp_opt.runtime.hostmem import total_memory_bytes

# A CPU run's "GPU memory" for the search: this share of the machine's RAM, split over its ranks.
CPU_MEMORY_SHARE = 0.6


@dataclass(frozen=True)
class Layout:
    """How the run shards, syncs and batches, as `choose_layout` decided it from the flags."""

    strategy: str  # --sharding_strategy, with AUTO decided
    reduce_each_microbatch: bool  # --reduce_every_microbatch, with auto decided
    prediction: dict[str, Any] | None = None  # the step-time prediction of this layout (GPU runs; CPU with auto)
    batch_size: int = 4  # --batch_size, with auto decided
    accum_steps: int = 1  # --accum_steps, or what --global_batch or the search gives
    activation_checkpointing: bool = True
    loss_chunk_tokens: int = 0
    cpu_offload: bool = False
    reduce_dtype: str = "fp32"  # --reduce_dtype, with auto decided
    searched: bool = False  # --batch_size auto chose it
    gathered: bool = True  # a method that samples: generation on the model gathered once (else on its shards)

    def decided(self) -> dict[str, Any]:
        """The flags this layout decides, with their values: what the run prints and stores in place of the flags."""
        return {
            "sharding_strategy": self.strategy,
            "batch_size": self.batch_size,
            "accum_steps": self.accum_steps,
            "activation_checkpointing": self.activation_checkpointing,
            "loss_chunk_tokens": self.loss_chunk_tokens,
            "cpu_offload": self.cpu_offload,
            "reduce_dtype": self.reduce_dtype,
            "reduce_every_microbatch": str(self.reduce_each_microbatch).lower(),
        }


@dataclass(frozen=True)
class Run:
    """What a layout is decided for: the run's flags, its ranks, its model's config, the compute precision, and this
    GPU (usable memory in bytes, name; None without one)."""

    config: Config
    env: DistEnv
    model_config: Any
    precision: str
    gpu: tuple[int, str] | None = None


def run_inputs(
    config: Config,
    env: DistEnv,
    precision: str,
    gpu: tuple[int, str] | None,
    accum_steps: int = 1,
    attention: str | None = None,
) -> Inputs:
    """The plan's inputs for this run: its ranks and memory, the attention kernel it runs (`attention`, resolved from
    --attn_implementation auto), and the flags as given."""
    pc, tc, dc = config.parallel, config.train, config.data
    if gpu is None:  # CPU ranks: a share of the machine's RAM each
        memory = int(CPU_MEMORY_SHARE * (total_memory_bytes() or 16 * 2**30) / max(1, env.local_world_size))
    else:
        memory = gpu[0]
    return Inputs(
        gpus=env.world_size,
        nodes=env.num_nodes,
        gpu_memory=memory,
        batch_size=4 if tc.batch_size == AUTO else tc.batch_size,
        max_length=dc.max_length,
        accum_steps=accum_steps,
        precision=precision,
        activation_checkpointing=pc.activation_checkpointing,
        attn_implementation=attention or config.model.attn_implementation,
        packing=dc.packing,
        prefetch=pc.prefetch,
        loss_chunk_tokens=tc.loss_chunk_tokens,
        cuda=gpu is not None,
        lora_rank=config.lora.lora_rank,
        lora_targets=config.lora.lora_targets,
        lora_dropout=config.lora.dropout,
        base_bits=config.lora.base_bits,
        reduce_dtype="fp16" if pc.reduce_dtype == "fp16" else "fp32",
        cpu_offload=pc.cpu_offload,
        method=config.method,
    )


def choose_layout(
    config: Config,
    env: DistEnv,
    model_config: Any,
    precision: str,
    accum_steps: int | None,
    gpu: tuple[int, str] | None = None,
    beside: Any = None,
) -> Layout:
    """Decide what the flags leave open, once, with the method's phases: a method that samples gets where it
    generates (the model gathered once, or its shards) and its step's prediction with its generation and the forward
    of a model kept beside (`beside`: that model's config, where it is another one: a teacher). `gpu` is this GPU's
    (usable memory in bytes, name), from `distributed.cap_gpu_memory`; None without one. `accum_steps`: the flags'
    (None with --batch_size auto). The config is only read: what is decided comes back as the Layout. Every rank
    calls it (a CPU run with --batch_size auto measures its rates with all ranks)."""
    run = Run(config, env, model_config, precision, gpu)
    layout = training_layout(run, accum_steps)
    if not config.method.spec.generates:
        return layout
    global_batch = layout.batch_size * env.world_size * layout.accum_steps
    gathered = gathered_generation_fits(run, global_batch)
    settings = config.method.settings
    slices = generation_slices(getattr(settings, "steps_per_generation", None), layout.accum_steps)
    layout = dataclasses.replace(layout, gathered=gathered)
    graphs = settings.decoding == "graphs" and env.device.type == "cuda"
    return with_generation_phase(layout, run, global_batch, gathered, graphs, slices, beside)


def training_layout(run: Run, accum_steps: int | None) -> Layout:
    """The training step's layout: what the flags leave open of it (`accum_steps`: the flags', None with
    --batch_size auto)."""
    config, env, model_config, precision, gpu = run.config, run.env, run.model_config, run.precision, run.gpu
    if config.train.batch_size == AUTO:
        return searched_layout(run)
    pc, tc = config.parallel, config.train
    choice = pc.reduce_every_microbatch
    fixed = dict(
        **picked(tc, "batch_size", "loss_chunk_tokens"),
        **picked(pc, "activation_checkpointing", "cpu_offload", "reduce_dtype"),
        accum_steps=accum_steps,
    )
    if gpu is None:
        return Layout(
            "FULL_SHARD" if pc.sharding_strategy == "AUTO" else pc.sharding_strategy, choice == "true", **fixed
        )
    inputs = run_inputs(config, env, precision, gpu, accum_steps, getattr(model_config, "_attn_implementation", None))
    shape = Shape.of(model_config)
    rates = rates_for(gpu[1], pc.tflops, pc.link_gbps)
    strategies = allowed(env) if pc.sharding_strategy == "AUTO" else [pc.sharding_strategy]
    # With one micro-batch per step the two modes are one: candidates lists it once.
    options = [
        c
        for c in candidates(shape, inputs, strategies, rates)
        if choice == "auto" or accum_steps == 1 or c["reduce_every_microbatch"] == (choice == "true")
    ]
    if not options[0]["fits"]:  # nothing fits: the least memory, so the failure (if any) is the smallest
        options.sort(key=lambda c: c["peak_bytes"])
        warn_unfit(run, shape, inputs, rates, options[0])
    best = options[0]
    if pc.sharding_strategy == "AUTO":
        print0(
            f"note: --sharding_strategy AUTO chose {best['strategy']} (fits the memory plan with the shortest "
            f"predicted step of {', '.join(strategies)})"
        )
    if choice == "auto" and best["reduce_every_microbatch"] and accum_steps > 1:
        print0(
            "note: the memory plan does not fit no-sync gradient accumulation on this GPU; gradients are "
            "reduce-scattered after every micro-batch (--reduce_every_microbatch false to override)"
        )
    return Layout(
        best["strategy"],
        best["reduce_every_microbatch"],
        {**best, "tflops": rates.tflops, "link_gbps": rates.link_gbps, "hbm_gbps": rates.hbm_gbps},
        **fixed,
    )


def warn_unfit(run: Run, shape: Shape, inputs: Inputs, rates: Rates, least: dict[str, Any]) -> None:
    """Before the model is built: the flags' run does not fit the memory plan on this GPU, and what does."""
    config, env, precision = run.config, run.env, run.precision
    samples = config.train.samples_per_step(env.world_size)
    sharded = config.checkpoint.state_dict_type == "sharded"
    limits = Limits(rates, search_space(config, env, precision, True), total_memory_bytes(), sharded)
    auto = recommend(shape, inputs, samples, limits)
    fix = (
        f"--batch_size auto fits it ({describe(auto)})"
        if auto is not None
        else change_line(not inputs.lora_rank, inputs, cheapest_change(shape, inputs, samples, limits))
    )
    print0(
        f"warning: the memory plan's peak for these flags is {gib(least['peak_bytes'])} per GPU (the least of the "
        f"layouts they allow), over the {gib(inputs.gpu_memory)} this GPU has: the run will likely run out of GPU "
        f"memory in its first step; {fix} "
        "(python -m fsdp_opt.plan with the same flags shows each row)"
    )


def allowed(env: DistEnv) -> list[str]:
    return [s for s in STRATEGIES if s != "HYBRID_SHARD" or env.num_nodes > 1]


def search_space(config: Config, env: DistEnv, precision: str, cuda: bool) -> Space:
    """What --batch_size auto may vary: what the flags leave open."""
    pc = config.parallel
    every = {"auto": (False, True), "true": (True,), "false": (False,)}[pc.reduce_every_microbatch]
    strategies = allowed(env) if pc.sharding_strategy == "AUTO" else [pc.sharding_strategy]
    return Space(
        strategies=tuple(strategies),
        reduce_every=every,
        reduce_dtypes=reduce_dtypes(pc.reduce_dtype, precision),
        checkpointing=(True, False) if pc.activation_checkpointing else (False,),
        chunking=True,
        offload=cuda,
    )


def searched_layout(run: Run) -> Layout:
    """--batch_size auto: the fastest configuration that fits, at the run's sequences per step."""
    config, env, model_config, precision, gpu = run.config, run.env, run.model_config, run.precision, run.gpu
    pc = config.parallel
    samples = config.train.samples_per_step(env.world_size)
    if samples % env.world_size:
        raise ConfigError(
            f"--global_batch {samples}: does not split over {env.world_size} rank(s); use a multiple "
            f"of {env.world_size}"
        )
    if gpu is None:
        measured = measure(env, (precision,))  # the run's dtype: CPU fp16 and bf16 products take seconds each
        rates = Rates.measured(measured, precision)
        where = f"rates measured now on {env.world_size} CPU rank(s)"
    else:
        rates = rates_for(gpu[1], pc.tflops, pc.link_gbps)
        where = f"{gpu[1]}, {gib(gpu[0])} each, {rates.tflops:.0f} TFLOPS, link {rates.link_gbps:g} GB/s"
    inputs = run_inputs(config, env, precision, gpu, attention=getattr(model_config, "_attn_implementation", None))
    shape = Shape.of(model_config)
    space = search_space(config, env, precision, gpu is not None)
    host = None if gpu is None else total_memory_bytes()
    best = recommend(shape, inputs, samples, Limits(rates, space, host, config.checkpoint.state_dict_type == "sharded"))
    if best is None:
        raise ConfigError(
            f"--batch_size auto: no configuration of {samples} sequences per step fits "
            f"{env.world_size} rank(s) of {gib(inputs.gpu_memory)}; a smaller --global_batch will not "
            "help (each rank needs one sequence at least): try --lora_rank or more GPUs"
        )
    print0(
        f"--batch_size auto: {describe(best)} ({samples} sequences per step); predicted "
        f"{best['predicted_step_time_s']:.3f} s per step, peak {gib(best['peak_bytes'])} per rank ({where})"
    )
    p = best["prediction"]
    return Layout(
        best["sharding_strategy"],
        best["reduce_every_microbatch"],
        {
            **p,
            "strategy": best["sharding_strategy"],
            "tflops": rates.tflops,
            "link_gbps": rates.link_gbps,
            "hbm_gbps": rates.hbm_gbps,
        },
        searched=True,
        **chosen(best),
    )


def with_generation_phase(
    layout: Layout, run: Run, global_batch: int, gathered: bool, graphs: bool, slices: int, beside_config: Any = None
) -> Layout:
    """The layout of a run that generates (GRPO, distillation) with its step prediction counting the generation, the
    forward of the model beside it (GRPO's reference, the teacher: of `beside_config`'s shape, default the model's) and
    the old log-probabilities' forward (planner/generation.py), as `plan` counts them."""
    if layout.prediction is None:
        return layout
    config, m = run.config, run.config.method
    attention = getattr(run.model_config, "_attn_implementation", None)
    inputs = run_inputs(config, run.env, run.precision, run.gpu, attention=attention)
    phase = Phase(
        global_batch,
        m.completions_per_prompt,
        m.settings.max_completion_length,
        slices,
        getattr(m.settings, "num_iterations", 1),
        forward_beside=m.uses_reference or m.spec.teacher,  # a model kept beside, its forward on the completions
        beside=Shape.of(beside_config) if beside_config is not None else None,
    )
    prediction = with_generation(
        layout.prediction, Shape.of(run.model_config), layout.strategy, inputs, phase, gathered, graphs
    )
    return dataclasses.replace(layout, prediction=prediction)


def gathered_generation_fits(run: Run, global_batch: int) -> bool:
    """Whether this run's model gathered whole and its KV cache fit its GPU (or --max_gpu_memory) beside training."""
    config, env, model_config, precision = run.config, run.env, run.model_config, run.precision
    if env.device.type != "cuda":
        return True
    inputs = run_inputs(config, env, precision, cap_gpu_memory(config, env))
    return gathered_fits(model_config, inputs, config.method.completions_per_prompt, global_batch)
