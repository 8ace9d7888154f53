"""`python -m fsdp_opt.plan`'s flags: the trainer's that decide memory and time (the model, the layout, LoRA, the
method's phases), the machine's (GPUs, memory, rates, disk) and what to show (a simulation, the catalogue, JSON).

Built from the config's dataclasses and figures alone, which import nothing heavy: `plan --help` (and a flag typed
wrong) answers before torch or transformers is imported."""

from __future__ import annotations

import argparse
import dataclasses

from fsdp_opt.config.benchmarks import BenchmarkConfig
from fsdp_opt.config.choices import (
    KAGGLE_DISK,
    KAGGLE_HOST_MEMORY,
    PACKING_MODES,
    T4_HBM_GBPS,
    T4_LINK_GBPS,
    T4_MEMORY,
    T4_TFLOPS,
)
from fsdp_opt.config.flags import OneLineParser, parse_batch, parse_bool
from fsdp_opt.config.method import method_field
from fsdp_opt.config.parse import KEEP, add_flag


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m fsdp_opt.plan", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default="facebook/opt-1.3b",
        help="a Hub id whose shape the plan knows offline (the OPT family from facebook/opt-125m to opt-6.7b, "
        "meta-llama/Llama-3.1-8B, and the catalogue's popular models with their -Instruct/-it variants: --catalog "
        "lists them), tiny-opt, or a local model folder",
    )
    p.add_argument("--gpus", type=int, default=2, help="GPUs in all (ranks)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument(
        "--gpu_memory",
        default=None,
        help=f"memory of one GPU as torch reads it (default: Kaggle's T4, {T4_MEMORY}; another figure plans another "
        "machine, whose host RAM is then this one's unless --host_memory says)",
    )
    p.add_argument(
        "--batch_size",
        type=parse_batch,
        default=4,
        help="micro-batch per GPU, or auto: plan the recommended configuration (as the trainer's --batch_size auto)",
    )
    p.add_argument(
        "--global_batch",
        "--total_batch_size",
        dest="global_batch",
        type=int,
        default=None,
        help="sequences per optimizer step, all GPUs (default: batch_size x accum_steps x gpus)",
    )
    p.add_argument("--max_length", type=int, default=512)
    p.add_argument(
        "--accum_steps",
        type=int,
        default=None,
        help="micro-batches per step (default: the trainer's 1, or what --global_batch implies)",
    )
    p.add_argument(
        "--precision",
        default=None,
        choices=["fp16", "bf16", "fp32"],
        help="default: fp16 (a T4 has no bf16), fp32 with --cpu (the trainer's --precision auto)",
    )
    p.add_argument("--activation_checkpointing", type=parse_bool, nargs="?", const=True, default=True)
    p.add_argument("--attn_implementation", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument(
        "--packing",
        default="docs",
        choices=PACKING_MODES,
        help="the trainer's --packing (docs and pad attend through a mask, which the plan counts)",
    )
    p.add_argument("--reduce_every_microbatch", type=parse_bool, nargs="?", const=True, default=False)
    p.add_argument(
        "--reduce_dtype",
        default="fp32",
        choices=["fp32", "fp16", "auto"],
        help="the trainer's --reduce_dtype (auto: the search may choose fp16 with fp16 compute)",
    )
    p.add_argument("--prefetch", type=int, default=0, help="blocks gathered ahead (the trainer's --prefetch)")
    p.add_argument("--loss_chunk_tokens", type=int, default=0, help="the trainer's --loss_chunk_tokens")
    p.add_argument("--lora_rank", type=int, default=0, help="the trainer's --lora_rank (0: full fine-tuning)")
    p.add_argument(
        "--lora_targets", default=None, help="the trainer's --lora_targets (default: every linear layer of the blocks)"
    )
    p.add_argument(
        "--lora_dropout",
        type=float,
        default=None,
        help="the trainer's --lora_dropout (default: 0.05; 0 with --method dpo, which trains without dropout)",
    )
    p.add_argument("--base_bits", type=int, default=16, choices=[16, 4], help="the trainer's --base_bits")
    # the trainer's method flags, of its types and choices (config/method.py), with what the plan does with each
    for name, default, help_text in (
        (
            "method",
            "sft",
            "the trainer's --method: dpo and kto add their reference pass (memory, time) to the plan; grpo, rloo "
            "and distill their generation phase (the model gathered once, and layer by layer beside it), distill its "
            "teacher beside the model",
        ),
        ("num_generations", KEEP, "--method grpo: completions per prompt (G)"),
        ("max_completion_length", KEEP, "--method grpo and distill: tokens of a completion"),
        (
            "teacher_model",
            KEEP,
            "--method distill: the trainer's --teacher_model, which it needs as the trainer does; the plan keeps it "
            "beside the model and runs its forward on each step's completions",
        ),
        ("teacher_bits", KEEP, "--method distill: the trainer's --teacher_bits (4: its blocks' linear weights in NF4)"),
        (
            "beta",
            KEEP,
            "--method grpo: the KL weight (default 0); above 0 a reference model's forward (a model of its own for "
            "full fine-tuning or with --ref_model, kept beside the policy); the other methods' --beta changes nothing "
            "the plan counts",
        ),
        (
            "decoding",
            KEEP,
            "--method grpo: the trainer's --decoding; the plan prints the unreplayed and the graph figures "
            "beside each other, and the step at this one",
        ),
        ("num_iterations", KEEP, "--method grpo: the trainer's --num_iterations"),
        ("steps_per_generation", KEEP, "--method grpo: the trainer's --steps_per_generation (default --accum_steps)"),
        (
            "ref_model",
            KEEP,
            "the trainer's --ref_model: with LoRA, the reference is then a model of its own (of the same "
            "shape) instead of the base with the adapters off",
        ),
    ):
        add_flag(p, method_field(name), default=default, help=help_text)
    p.add_argument(
        "--disk", default=KAGGLE_DISK, help=f"disk for checkpoints (Kaggle's /kaggle/working: {KAGGLE_DISK})"
    )
    p.add_argument(
        "--data_on_disk",
        default="0",
        help="what a session keeps of the dataset on that disk: 0 when its rows are read by range (a split "
        "stored as parquet, on the Hub or in a folder); a split downloaded whole keeps about twice its "
        "size (the files and datasets' arrow copy) where HF_HOME is; --dataset measures it",
    )
    p.add_argument(
        "--dataset",
        default=None,
        help="a dataset to measure --data_on_disk from (its Hub listing; with --dataset_config and "
        "--dataset_split as the trainer takes them)",
    )
    p.add_argument("--dataset_config", default=None, help="the trainer's --dataset_config")
    p.add_argument("--dataset_split", default="train", help="the trainer's --dataset_split")
    p.add_argument(
        "--host_memory",
        default=None,
        help=f"RAM of one machine (default: Kaggle's, {KAGGLE_HOST_MEMORY}, while the GPUs are the default T4s; "
        "this machine's with --gpu_memory, --cpu, --calibrate or --rates)",
    )
    p.add_argument(
        "--state_dict_type", default="full", choices=["full", "sharded"], help="the trainer's --state_dict_type"
    )
    p.add_argument(
        "--cpu_offload", type=parse_bool, nargs="?", const=True, default=False, help="the trainer's --cpu_offload"
    )
    p.add_argument("--keep_last", type=int, default=2)
    p.add_argument("--save_optimizer", type=parse_bool, nargs="?", const=True, default=True)
    p.add_argument("--slices", type=int, default=10, help="sessions in the chain, for the Hub repo's size")
    p.add_argument(
        "--hub_keep_full", type=int, default=1, help="the trainer's --hub_keep_full (0: keep every full checkpoint)"
    )
    p.add_argument("--cpu", action="store_true", help="plan for CPU processes (no CUDA context)")

    # 2xT4's, as planner.steptime.Rates() has them
    p.add_argument("--tflops", type=float, default=T4_TFLOPS, help="sustained TFLOPS per GPU (T4 fp16: 24)")
    p.add_argument(
        "--link_gbps", type=float, default=T4_LINK_GBPS, help="GB/s between GPUs (2 T4s on PCIe 3 through NCCL: 3.2)"
    )
    p.add_argument("--hbm_gbps", type=float, default=T4_HBM_GBPS, help="GB/s of GPU memory (T4: 320)")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's rates first (2 ranks under torchrun: GPUs when there are, else CPU "
        "processes) and predict from them instead of --tflops/--link_gbps/--hbm_gbps",
    )
    p.add_argument(
        "--rates", default=None, help="predict from a calibration saved earlier (python -m fsdp_opt.calibrate --json)"
    )
    p.add_argument(
        "--simulate",
        nargs="?",
        const="FULL_SHARD",
        default=None,
        metavar="STRATEGIES",
        help="also run one training step at the model's real shape on fake tensors (no memory used) for "
        "these strategies (comma-separated; default FULL_SHARD) and hold its peaks against the plan; --method "
        "grpo: its generation phase too, on the first of them",
    )
    p.add_argument(
        "--catalog",
        action="store_true",
        help="instead of one model's plan: what fits of every built-in model (full fine-tuning, LoRA r16, "
        "LoRA r16 on a 4-bit base) at the flags' GPUs, memory, precision, length and sequences per step",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    for field in dataclasses.fields(BenchmarkConfig):  # the trainer's --eval_tasks: its scoring at each save
        add_flag(p, field)
    return p
