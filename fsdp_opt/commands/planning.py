"""The plan command's work (`python -m fsdp_opt.plan`, commands/plan.py): its flags, parsed, in; the plan out as
tables or JSON, over `fsdp_opt.planner`."""

from __future__ import annotations

import argparse
import json
import sys

from fsdp_opt.base import ConfigError, gib, parse_size, picked
from fsdp_opt.config.choices import KAGGLE_HOST_MEMORY, STRATEGIES, T4_MEMORY
from fsdp_opt.config.method import MethodConfig, union_flags
from fsdp_opt.config.methods import GENERATION, REFERENCE_PASS, spec
from fsdp_opt.config.training import TrainConfig
from fsdp_opt.data.resolve import DataSource
from fsdp_opt.data.sources import data_on_disk
from fsdp_opt.model.shapes import Shape, model_config
from fsdp_opt.planner.benchmarks import scoring_line
from fsdp_opt.planner.calibrate import calibrate, read_rates
from fsdp_opt.planner.catalog import catalog_rows, render_catalog
from fsdp_opt.planner.generation import generation_memory
from fsdp_opt.planner.inputs import Inputs
from fsdp_opt.planner.report import make_plan, render
from fsdp_opt.planner.search import Limits, Space, applied, recommend, reduce_dtypes
from fsdp_opt.planner.simreport import compare
from fsdp_opt.planner.simreport import render as sim_render
from fsdp_opt.planner.simulate import simulate as sim_simulate
from fsdp_opt.planner.simulate import simulate_generation as sim_generation
from fsdp_opt.planner.simulate import simulate_reference
from fsdp_opt.planner.steptime import Rates
from fsdp_opt.runtime.hostmem import total_memory_bytes
from fsdp_opt.train.chain_scores import planned_scoring

# The plan's flags the planner's Inputs takes under the same names.
SAME_NAMED = (
    "gpus",
    "nodes",
    "max_length",
    "precision",
    "activation_checkpointing",
    "attn_implementation",
    "packing",
    "reduce_every_microbatch",
    "prefetch",
    "loss_chunk_tokens",
    "lora_rank",
    "lora_targets",
    "base_bits",
    "cpu_offload",
)


def host_memory_of(a: argparse.Namespace) -> tuple[int, str]:
    """(bytes, where the figure comes from) of one machine's RAM: --host_memory; Kaggle's while the plan is for its
    T4s (the default GPU, rates and disk); else this machine's (planned for with --cpu, measured with --calibrate)."""
    if a.host_memory is not None:
        return parse_size(a.host_memory, "--host_memory"), "--host_memory"
    if a.gpu_memory is None and not (a.cpu or a.calibrate or a.rates):
        return parse_size(KAGGLE_HOST_MEMORY, "--host_memory"), f"Kaggle's {KAGGLE_HOST_MEMORY}, the T4s' machine"
    return total_memory_bytes() or parse_size(KAGGLE_HOST_MEMORY, "--host_memory"), "this machine's"


def batch_of(a: argparse.Namespace) -> tuple[int, int]:
    """Sequences per optimizer step and the accumulation of the flags given, by the trainer's rules (and its
    defaults)."""
    if a.global_batch is not None and a.accum_steps is not None:
        raise ConfigError(
            f"--global_batch and --accum_steps {a.accum_steps}: give one of them (accum_steps is derived)"
        )
    tc = TrainConfig(batch_size=a.batch_size, accum_steps=a.accum_steps or 1, global_batch=a.global_batch)
    samples = tc.samples_per_step(a.gpus)
    if samples % a.gpus:
        raise ConfigError(f"--global_batch {samples}: does not split over --gpus {a.gpus}")
    return samples, 1 if a.batch_size == "auto" else tc.accum_for(a.gpus)


def rates_of(a: argparse.Namespace) -> tuple[Rates, dict | None]:
    """The prediction's rates: measured now (--calibrate), read (--rates), or the flags' (2xT4 by default)."""
    if a.calibrate or a.rates:
        measured = calibrate(cpu=a.cpu, gpus=a.gpus) if a.calibrate else read_rates(a.rates)
        if a.precision not in measured["matmul_tflops"]:
            raise ConfigError(
                f"--precision {a.precision}: the calibration measured {', '.join(measured['matmul_tflops'])} only"
            )
        return Rates.measured(measured, a.precision), measured
    return Rates(tflops=a.tflops, link_gbps=a.link_gbps, hbm_gbps=a.hbm_gbps), None


def method_of(a: argparse.Namespace) -> MethodConfig:
    """The method's settings as the trainer takes them (config.method.MethodConfig.from_flags): its own flags with its
    defaults; another method's flag (--teacher_model with --method kto) is the trainer's one line."""
    return MethodConfig.from_flags(a.method, {k: getattr(a, k, None) for k in union_flags()})


def plan(a: argparse.Namespace) -> int:
    """The plan of the parsed flags, printed; the exit code (2: a flag to fix, said in one line)."""
    try:
        method = method_of(a)
        a.precision = a.precision or ("fp32" if a.cpu else "fp16")
        auto = a.batch_size == "auto"
        for flag in ("gpus", "nodes", "max_length", "accum_steps", "slices") + (() if auto else ("batch_size",)):
            if getattr(a, flag) is not None and getattr(a, flag) < 1:
                raise ConfigError(f"--{flag} {getattr(a, flag)}: must be at least 1")
        for flag in ("tflops", "link_gbps", "hbm_gbps"):
            if not getattr(a, flag) > 0:
                raise ConfigError(f"--{flag} {getattr(a, flag)}: must be more than 0")
        for flag in ("prefetch", "loss_chunk_tokens", "hub_keep_full"):
            if getattr(a, flag) < 0:
                raise ConfigError(f"--{flag} {getattr(a, flag)}: must be 0 or more")
        if a.gpus % a.nodes:
            raise ConfigError(f"--gpus {a.gpus}: does not split evenly over --nodes {a.nodes}")
        if a.reduce_dtype == "fp16" and a.precision != "fp16":
            raise ConfigError(f"--reduce_dtype fp16: only with --precision fp16 (this plan computes in {a.precision})")
        samples, accum = batch_of(a)
        inputs = Inputs(
            **picked(a, *SAME_NAMED),
            gpu_memory=parse_size(a.gpu_memory or T4_MEMORY, "--gpu_memory"),
            batch_size=4 if auto else a.batch_size,
            accum_steps=accum,
            cuda=not a.cpu,
            lora_dropout=a.lora_dropout if a.lora_dropout is not None else 0.05 if method.spec.dropout else 0.0,
            reduce_dtype="fp16" if a.reduce_dtype == "fp16" else "fp32",
            method=method,
        )
        if a.lora_rank < 0:
            raise ConfigError(f"--lora_rank {a.lora_rank}: must be 0 (full fine-tuning) or more")
        if a.base_bits != 16 and not a.lora_rank:
            raise ConfigError(f"--base_bits {a.base_bits}: only with --lora_rank (a 4-bit base is frozen)")
        host, host_from = host_memory_of(a)
        rates, measured = rates_of(a)
        space = Space(
            strategies=tuple(s for s in STRATEGIES if s != "HYBRID_SHARD" or a.nodes > 1),
            reduce_dtypes=reduce_dtypes(a.reduce_dtype, a.precision),
        )
        if a.catalog:
            rows = catalog_rows(inputs, samples, rates, space, host)
            print(json.dumps(rows, indent=1) if a.json else render_catalog(rows, inputs, samples))
            return 0
        if auto:
            shape = Shape.of(model_config(a.model))
            best = recommend(shape, inputs, samples, Limits(rates, space, host, a.state_dict_type == "sharded"))
            if best is None:
                raise ConfigError(
                    f"--batch_size auto: no configuration of {samples} sequences per step fits "
                    f"{a.gpus} GPU(s) of {gib(inputs.gpu_memory)}"
                )
            inputs = applied(inputs, best)
        data_bytes = parse_size(a.data_on_disk, "--data_on_disk")
        if a.dataset:
            data_bytes = data_on_disk(DataSource(a.dataset, a.dataset_config, a.dataset_split))
        plan = make_plan(
            a.model,
            inputs,
            disk=parse_size(a.disk, "--disk"),
            host_memory=host,
            host_from=host_from,
            keep_last=a.keep_last,
            save_optimizer=a.save_optimizer,
            sharded=a.state_dict_type == "sharded",
            offload=inputs.cpu_offload,
            slices=a.slices,
            keep_full=a.hub_keep_full,
            rates=rates,
            samples=samples,
            space=space,
            data_bytes=data_bytes,
        )
        if measured is not None:
            plan["calibration"] = measured
        if a.eval_tasks:  # lm-eval's scoring at each save (train/chain_scores.py)
            plan["lm_eval"] = planned_scoring(a, inputs, rates)
        simulate = [x.strip() for x in a.simulate.split(",")] if a.simulate else []
        for strategy in simulate:
            if strategy not in plan["strategies"]:
                raise ConfigError(f"--simulate {a.simulate}: {strategy} is not one of {', '.join(plan['strategies'])}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = [] if a.json else [render(plan)] + ([scoring_line(plan["lm_eval"])] if "lm_eval" in plan else [])
    if simulate:
        plan["simulated"] = {}
        for strategy in simulate:
            result = sim_simulate(a.model, inputs, strategy)
            planned = plan["strategies"][strategy]["components"]
            rows = compare(result, planned)
            with_runtime = result["peak_total"] + planned.get("runtime", 0)
            plan["simulated"][strategy] = {
                **result,
                "comparison": rows,
                "total_bytes": with_runtime,
                "fits": with_runtime <= inputs.gpu_memory,
            }
            text += [
                "",
                *sim_render(strategy, rows, result),
                f"{strategy} verdict: plan {gib(plan['strategies'][strategy]['total_bytes'])}, simulated "
                f"{gib(with_runtime)} (with the plan's runtime row) of {gib(inputs.gpu_memory)}: "
                + (
                    "fits"
                    if with_runtime <= inputs.gpu_memory and plan["strategies"][strategy]["fits"]
                    else "does NOT fit"
                    if with_runtime > inputs.gpu_memory and not plan["strategies"][strategy]["fits"]
                    else "the two disagree"
                ),
            ]
    ref = plan.get(a.method) if REFERENCE_PASS in spec(a.method).phases else None
    if simulate and ref and not ref["own_model"]:
        got = simulate_reference(a.model, inputs, ref["strategy"])
        planned = ref["total_bytes"] - ref["components"].get("runtime", 0)
        ref["simulated"] = {**got, "planned_less_runtime": planned, "ratio": planned / got["peak_total"]}
        text += [
            "",
            f"{a.method} reference pass ({ref['strategy']}), simulated (fake tensors, rank 0 of {got['world_size']}): "
            f"{gib(got['peak_total'])} at its peak; planned {gib(planned)} (its total less runtime): plan / "
            f"simulated {planned / got['peak_total']:.2f}",
        ]
    grpo = plan.get(a.method) if GENERATION in spec(a.method).phases else None
    if simulate and grpo:
        strategy = simulate[0]  # the generation phase on the first strategy --simulate names
        got = sim_generation(a.model, inputs, strategy, grpo["requests_per_rank"])
        parts = generation_memory(Shape.of(model_config(a.model)), strategy, inputs, grpo["requests_per_rank"])
        planned = sum(v for k, v in parts.items() if k not in ("runtime", "reference"))
        grpo["simulated"] = {
            **got,
            "strategy": strategy,
            "planned_less_runtime": planned,
            "ratio": planned / got["peak_total"],
        }
        text += [
            "",
            f"{a.method} generation ({strategy}, {grpo['requests_per_rank']} completions), simulated (fake "
            f"tensors, rank 0 of {got['world_size']}): {gib(got['peak_total'])} at its peak; planned "
            f"{gib(planned)} (less runtime and reference): plan / simulated {planned / got['peak_total']:.2f}",
        ]
    print(json.dumps(plan, indent=1) if a.json else "\n".join(text))
    return 0
