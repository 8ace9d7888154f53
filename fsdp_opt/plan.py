"""Will it fit? Per-GPU memory by component for each sharding strategy, checkpoint sizes against a disk
budget, and the host RAM a full save needs, before anything is launched.

    python -m fsdp_opt.plan --model facebook/opt-1.3b --gpus 2 --gpu_memory 15GiB --batch_size 4 --max_length 512

The command over `fsdp_opt.planner`: flags in, the plan out as tables or JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from fsdp_opt.base import ConfigError, gib, parse_size
from fsdp_opt.config.choices import PACKING_MODES, STRATEGIES, T4_MEMORY
from fsdp_opt.config.method import DECODING, GENERATION, METHODS, REFERENCE_PASS, spec
from fsdp_opt.config.flags import OneLineParser, parse_batch, parse_bool
from fsdp_opt.config.training import TrainConfig
from fsdp_opt.data.prompts import generation_slices
from fsdp_opt.data.resolve import DataSource
from fsdp_opt.data.sources import data_on_disk
from fsdp_opt.model.catalog import SHAPES
from fsdp_opt.model.shapes import Shape, model_config
from fsdp_opt.model.sources import LLAMA_8B, OPT_FAMILY
from fsdp_opt.planner.catalog import catalog_rows, render_catalog
from fsdp_opt.planner.calibrate import calibrate, read_rates
from fsdp_opt.planner.generation import generation_memory
from fsdp_opt.planner.inputs import Inputs
from fsdp_opt.planner.report import make_plan, render
from fsdp_opt.planner.simulate import compare
from fsdp_opt.planner.simulate import render as sim_render
from fsdp_opt.planner.simulate import simulate as sim_simulate
from fsdp_opt.planner.simulate import simulate_generation as sim_generation
from fsdp_opt.planner.simulate import simulate_reference
from fsdp_opt.planner.search import Space, recommend, reduce_dtypes
from fsdp_opt.planner.steptime import Rates
from fsdp_opt.runtime.hostmem import total_memory_bytes


def machine_memory() -> int:
    return total_memory_bytes() or 31 * 10**9


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m fsdp_opt.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="facebook/opt-1.3b",
                   help=f"one of {', '.join(OPT_FAMILY)}, {LLAMA_8B}, the catalogue's ({', '.join(SHAPES)}, and their "
                        "-Instruct/-it variants), tiny-opt, or a local model folder")  # fmt: skip
    p.add_argument("--gpus", type=int, default=2, help="GPUs in all (ranks)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu_memory", default=T4_MEMORY, help=f"memory of one GPU as torch reads it (Kaggle's T4: {T4_MEMORY})")
    p.add_argument("--batch_size", type=parse_batch, default=4,
                   help="micro-batch per GPU, or auto: plan the recommended configuration (as the trainer's --batch_size auto)")
    p.add_argument("--global_batch", "--total_batch_size", dest="global_batch", type=int, default=None,
                   help="sequences per optimizer step, all GPUs (default: batch_size x accum_steps x gpus)")
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument("--accum_steps", type=int, default=None,
                   help="micro-batches per step (default: the trainer's 1, or what --global_batch implies)")
    p.add_argument("--precision", default=None, choices=["fp16", "bf16", "fp32"],
                   help="default: fp16 (a T4 has no bf16), fp32 with --cpu (the trainer's --precision auto)")
    p.add_argument("--activation_checkpointing", type=parse_bool, nargs="?", const=True, default=True)
    p.add_argument("--attn_implementation", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--packing", default="docs", choices=PACKING_MODES,
                   help="the trainer's --packing (docs and pad attend through a mask, which the plan counts)")
    p.add_argument("--reduce_every_microbatch", type=parse_bool, nargs="?", const=True, default=False)
    p.add_argument("--reduce_dtype", default="fp32", choices=["fp32", "fp16", "auto"],
                   help="the trainer's --reduce_dtype (auto: the search may choose fp16 with fp16 compute)")
    p.add_argument("--prefetch", type=int, default=0, help="blocks gathered ahead (the trainer's --prefetch)")
    p.add_argument("--loss_chunk_tokens", type=int, default=0, help="the trainer's --loss_chunk_tokens")
    p.add_argument("--lora_rank", type=int, default=0, help="the trainer's --lora_rank (0: full fine-tuning)")
    p.add_argument("--lora_targets", default=None, help="the trainer's --lora_targets (default: every linear layer of the blocks)")
    p.add_argument("--lora_dropout", type=float, default=None,
                   help="the trainer's --lora_dropout (default: 0.05; 0 with --method dpo, which trains without dropout)")
    p.add_argument("--base_bits", type=int, default=16, choices=[16, 4], help="the trainer's --base_bits")
    p.add_argument("--method", default="sft", choices=METHODS,
                   help="the trainer's --method: dpo adds its reference pass (memory, time) to the plan; grpo its "
                        "generation phase (the model gathered once, and layer by layer beside it)")
    p.add_argument("--num_generations", type=int, default=8, help="--method grpo: completions per prompt (G)")
    p.add_argument("--max_completion_length", type=int, default=256, help="--method grpo: tokens of a completion")
    p.add_argument("--beta", type=float, default=0.0,
                   help="--method grpo: the KL weight; above 0 a reference model's forward (a model of its own for full "
                        "fine-tuning or with --ref_model, kept beside the policy)")
    p.add_argument("--decoding", default="static", choices=DECODING,
                   help="--method grpo: the trainer's --decoding; the plan prints the unreplayed and the graph figures "
                        "beside each other, and the step at this one")
    p.add_argument("--num_iterations", type=int, default=1, help="--method grpo: the trainer's --num_iterations")
    p.add_argument("--steps_per_generation", type=int, default=None,
                   help="--method grpo: the trainer's --steps_per_generation (default --accum_steps)")
    p.add_argument("--ref_model", default=None,
                   help="the trainer's --ref_model: with LoRA, the reference is then a model of its own (of the same "
                        "shape) instead of the base with the adapters off")
    p.add_argument("--disk", default="20GB", help="disk for checkpoints (Kaggle's /kaggle/working: 20GB)")
    p.add_argument("--data_on_disk", default="0",
                   help="what a session keeps of the dataset on that disk: 0 when its rows are read by range (a split "
                        "stored as parquet, on the Hub or in a folder); a split downloaded whole keeps about twice its "
                        "size (the files and datasets' arrow copy) where HF_HOME is; --dataset measures it")
    p.add_argument("--dataset", default=None,
                   help="a dataset to measure --data_on_disk from (its Hub listing; with --dataset_config and "
                        "--dataset_split as the trainer takes them)")
    p.add_argument("--dataset_config", default=None, help="the trainer's --dataset_config")
    p.add_argument("--dataset_split", default="train", help="the trainer's --dataset_split")
    p.add_argument("--host_memory", default=None, help="RAM of one machine (default: this machine's; Kaggle: 31GB)")
    p.add_argument("--state_dict_type", default="full", choices=["full", "sharded"], help="the trainer's --state_dict_type")
    p.add_argument("--cpu_offload", type=parse_bool, nargs="?", const=True, default=False, help="the trainer's --cpu_offload")
    p.add_argument("--keep_last", type=int, default=2)
    p.add_argument("--save_optimizer", type=parse_bool, nargs="?", const=True, default=True)
    p.add_argument("--slices", type=int, default=10, help="sessions in the chain, for the Hub repo's size")
    p.add_argument("--hub_keep_full", type=int, default=1, help="the trainer's --hub_keep_full (0: keep every full checkpoint)")
    p.add_argument("--cpu", action="store_true", help="plan for CPU processes (no CUDA context)")

    rates = Rates()  # 2×T4's
    p.add_argument("--tflops", type=float, default=rates.tflops, help="sustained TFLOPS per GPU (T4 fp16: 24)")
    p.add_argument("--link_gbps", type=float, default=rates.link_gbps, help="GB/s between GPUs (2 T4s on PCIe 3 through NCCL: 3.2)")
    p.add_argument("--hbm_gbps", type=float, default=rates.hbm_gbps, help="GB/s of GPU memory (T4: 320)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's rates first (2 ranks under torchrun: GPUs when there are, else CPU "
                        "processes) and predict from them instead of --tflops/--link_gbps/--hbm_gbps")
    p.add_argument("--rates", default=None, help="predict from a calibration saved earlier (python -m fsdp_opt.calibrate --json)")
    p.add_argument("--simulate", nargs="?", const="FULL_SHARD", default=None, metavar="STRATEGIES",
                   help="also run one training step at the model's real shape on fake tensors (no memory used) for "
                        "these strategies (comma-separated; default FULL_SHARD) and hold its peaks against the plan; --method "
                        "grpo: its generation phase too, on the first of them")
    p.add_argument("--catalog", action="store_true",
                   help="instead of one model's plan: what fits of every built-in model (full fine-tuning, LoRA r16, "
                        "LoRA r16 on a 4-bit base) at the flags' GPUs, memory, precision, length and sequences per step")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p


def batch_of(a: argparse.Namespace) -> tuple[int, int]:
    """Sequences per optimizer step and the accumulation of the flags given, by the trainer's rules (and its
    defaults)."""
    if a.global_batch is not None and a.accum_steps is not None:
        raise ConfigError(f"--global_batch and --accum_steps {a.accum_steps}: give one of them (accum_steps is derived)")
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
            raise ConfigError(f"--precision {a.precision}: the calibration measured {', '.join(measured['matmul_tflops'])} only")
        return Rates.measured(measured, a.precision), measured
    return Rates(tflops=a.tflops, link_gbps=a.link_gbps, hbm_gbps=a.hbm_gbps), None


def applied(inputs: Inputs, c: dict) -> Inputs:
    """The inputs with a searched configuration's choices in place."""
    return replace(inputs, batch_size=c["batch_size"], accum_steps=c["accum_steps"],
                   reduce_every_microbatch=c["reduce_every_microbatch"], reduce_dtype=c["reduce_dtype"],
                   loss_chunk_tokens=c["loss_chunk_tokens"], activation_checkpointing=c["activation_checkpointing"],
                   cpu_offload=c["cpu_offload"])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    try:
        a = build_parser().parse_args(argv)
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
            gpus=a.gpus, nodes=a.nodes, gpu_memory=parse_size(a.gpu_memory, "--gpu_memory"),
            batch_size=4 if auto else a.batch_size, max_length=a.max_length, accum_steps=accum, precision=a.precision,
            activation_checkpointing=a.activation_checkpointing, attn_implementation=a.attn_implementation,
            packing=a.packing, reduce_every_microbatch=a.reduce_every_microbatch, prefetch=a.prefetch,
            loss_chunk_tokens=a.loss_chunk_tokens, cuda=not a.cpu, lora_rank=a.lora_rank, lora_targets=a.lora_targets,
            lora_dropout=a.lora_dropout if a.lora_dropout is not None else 0.05 if spec(a.method).dropout else 0.0,
            base_bits=a.base_bits, reduce_dtype="fp16" if a.reduce_dtype == "fp16" else "fp32",
            cpu_offload=a.cpu_offload, method=a.method, ref_model=a.ref_model is not None,
            generations=a.num_generations, completion_length=a.max_completion_length, beta=a.beta,
            decoding=a.decoding, iterations=a.num_iterations,
            generation_slices=generation_slices(a.steps_per_generation, accum) if GENERATION in spec(a.method).phases else 1,
        )  # fmt: skip
        if a.lora_rank < 0:
            raise ConfigError(f"--lora_rank {a.lora_rank}: must be 0 (full fine-tuning) or more")
        if a.base_bits != 16 and not a.lora_rank:
            raise ConfigError(f"--base_bits {a.base_bits}: only with --lora_rank (a 4-bit base is frozen)")
        host = parse_size(a.host_memory, "--host_memory") if a.host_memory is not None else machine_memory()
        rates, measured = rates_of(a)
        space = Space(strategies=tuple(s for s in STRATEGIES if s != "HYBRID_SHARD" or a.nodes > 1),
                      reduce_dtypes=reduce_dtypes(a.reduce_dtype, a.precision))
        if a.catalog:
            rows = catalog_rows(inputs, samples, rates, space, host)
            print(json.dumps(rows, indent=1) if a.json else render_catalog(rows, inputs, samples))
            return 0
        if auto:
            shape = Shape.of(model_config(a.model))
            best = recommend(shape, inputs, samples, rates, space, host, a.state_dict_type == "sharded")
            if best is None:
                raise ConfigError(f"--batch_size auto: no configuration of {samples} sequences per step fits "
                                  f"{a.gpus} GPU(s) of {a.gpu_memory}")  # fmt: skip
            inputs = applied(inputs, best)
        data_bytes = parse_size(a.data_on_disk, "--data_on_disk")
        if a.dataset:
            data_bytes = data_on_disk(DataSource(a.dataset, a.dataset_config, a.dataset_split))
        plan = make_plan(a.model, inputs, disk=parse_size(a.disk, "--disk"), host_memory=host, keep_last=a.keep_last,
                         save_optimizer=a.save_optimizer, sharded=a.state_dict_type == "sharded",
                         offload=inputs.cpu_offload, slices=a.slices, keep_full=a.hub_keep_full, rates=rates,
                         samples=samples, space=space, data_bytes=data_bytes)  # fmt: skip
        if measured is not None:
            plan["calibration"] = measured
        simulate = [x.strip() for x in a.simulate.split(",")] if a.simulate else []
        for strategy in simulate:
            if strategy not in plan["strategies"]:
                raise ConfigError(f"--simulate {a.simulate}: {strategy} is not one of {', '.join(plan['strategies'])}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = [] if a.json else [render(plan)]
    if simulate:
        plan["simulated"] = {}
        for strategy in simulate:
            result = sim_simulate(a.model, inputs, strategy)
            planned = plan["strategies"][strategy]["components"]
            rows = compare(result, planned)
            with_runtime = result["peak_total"] + planned.get("runtime", 0)
            plan["simulated"][strategy] = {**result, "comparison": rows, "total_bytes": with_runtime,
                                           "fits": with_runtime <= inputs.gpu_memory}  # fmt: skip
            text += ["", *sim_render(strategy, rows, result),
                     f"{strategy} verdict: plan {gib(plan['strategies'][strategy]['total_bytes'])}, simulated "
                     f"{gib(with_runtime)} (with the plan's runtime row) of {gib(inputs.gpu_memory)}: "
                     + ("fits" if with_runtime <= inputs.gpu_memory and plan["strategies"][strategy]["fits"]
                        else "does NOT fit" if with_runtime > inputs.gpu_memory and not plan["strategies"][strategy]["fits"]
                        else "the two disagree")]  # fmt: skip
    ref = plan.get(a.method) if REFERENCE_PASS in spec(a.method).phases else None
    if simulate and ref and not ref["own_model"]:
        got = simulate_reference(a.model, inputs, ref["strategy"])
        planned = ref["total_bytes"] - ref["components"].get("runtime", 0)
        ref["simulated"] = {**got, "planned_less_runtime": planned, "ratio": planned / got["peak_total"]}
        text += ["", f"dpo reference pass ({ref['strategy']}), simulated (fake tensors, rank 0 of {got['world_size']}): "
                     f"{gib(got['peak_total'])} at its peak; planned {gib(planned)} (its total less runtime): plan / "
                     f"simulated {planned / got['peak_total']:.2f}"]  # fmt: skip
    grpo = plan.get(a.method) if GENERATION in spec(a.method).phases else None
    if simulate and grpo:
        strategy = simulate[0]  # the generation phase on the first strategy --simulate names
        got = sim_generation(a.model, inputs, strategy, grpo["requests_per_rank"])
        parts = generation_memory(Shape.of(model_config(a.model)), strategy, inputs, grpo["requests_per_rank"])
        planned = sum(v for k, v in parts.items() if k not in ("runtime", "reference"))
        grpo["simulated"] = {**got, "strategy": strategy, "planned_less_runtime": planned,
                             "ratio": planned / got["peak_total"]}  # fmt: skip
        text += ["", f"grpo generation ({strategy}, {grpo['requests_per_rank']} completions), simulated (fake "
                     f"tensors, rank 0 of {got['world_size']}): {gib(got['peak_total'])} at its peak; planned "
                     f"{gib(planned)} (less runtime and reference): plan / simulated {planned / got['peak_total']:.2f}"]  # fmt: skip
    print(json.dumps(plan, indent=1) if a.json else "\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
