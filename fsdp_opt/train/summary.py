"""The run summary rank 0 prints at start: what trains, how it is sharded, the data, the batch, the prediction."""

from __future__ import annotations

import torch

from fsdp_opt.planner.steptime import describe_prediction
from fsdp_opt.runtime import torchao_gate
from fsdp_opt.runtime.distributed import print0
from fsdp_opt.tracking.progress import format_summary
from fsdp_opt.train.session import Session


def print_summary(s: Session, classes: set[type], units: int, n_params: int) -> None:
    c = s.config
    global_batch = s.plan.global_batch
    print0("fsdp-opt run")
    print0(
        format_summary(
            {
                "model": f"{c.model.model} ({n_params:,} parameters, tag {s.tag})",
                "strategy": f"{s.layout.strategy}, wrapped {', '.join(sorted(k.__name__ for k in classes))} x {units} + root = {units + 1} units",
                "precision": f"{s.precision} compute, fp32 master weights, {s.layout.reduce_dtype} gradient reduction"
                + (", dynamic loss scaling" if s.scaler.enabled else ""),
                "lora": describe_lora(s) if s.lora else "off (every weight trains)",
                "activation ckpt": s.layout.activation_checkpointing,
                "world": f"{s.env.world_size} rank(s) on {s.env.device.type}, {s.env.num_nodes} node(s)",
                "data": f"{c.data.dataset} rows [{c.data.start_idx}, {s.end_idx}) -> "
                + s.blocks.describe(PACKING_WORDS[c.data.packing]),
                "method": describe_method(s),
                "batch": f"{s.layout.batch_size} per rank x {s.env.world_size} ranks x {s.accum_steps} accum = {global_batch} sequences per step",
                "gradient sync": "every micro-batch"
                if s.reduce_each_microbatch or s.accum_steps == 1
                else "last micro-batch of each step",
                "loss": describe_loss(s),
                "predicted step": describe_prediction(s.predicted_step),
                "checkpoints": f"{c.checkpoint.state_dict_type}, written "
                + (
                    "in the background while training goes on"
                    if s.ckpt_writer is not None
                    else "before training goes on"
                ),
                "steps/epoch": s.plan.steps_per_epoch(),
                "start": f"global step {s.state.global_step}, epoch {s.state.epoch}",
                "chain": s.chain.describe() if s.chain else "-",
                "output": str(s.out_dir),
            }
        )
    )
    print0("config: " + " ".join(f"--{k} {v}" for k, v in s.flags().items() if v is not None))
    if torchao_gate.hidden_reason:
        print0(
            f"note: {torchao_gate.hidden_reason}: it is not used (only --base_bits 4 needs torchao; for this torch: "
            f"{torchao_gate.install_line(torch.__version__)})"
        )


PACKING_WORDS = {
    "docs": "blocks of whole documents (each attends to itself only, positions from 0)",
    "concat": "blocks of rows joined end to end",
    "pad": "padded rows",
}


def describe_lora(s: Session) -> str:
    info, trainable = s.lora, sum(p.numel() for p in s.params)
    return (
        f"rank {info['rank']}, alpha {info['alpha']:g}, dropout {info['dropout']:g} on {len(info['targets'])} layers: "
        f"{trainable:,} trainable parameters ({100 * trainable / max(1, s.n_params):.2f}%); base frozen in "
        f"{s.precision}, weights {info['base_fingerprint']}"
    )


def describe_loss(s: Session) -> str:
    """How the loss reads the logits: whole, or the output layer run at the target tokens (in chunks)."""
    if s.head_loss is None:
        return "whole logits at once (this model's logits are not a plain projection)"
    where = "the output layer at the target tokens only"
    chunk = s.layout.loss_chunk_tokens
    return f"{where}, {chunk} tokens at a time" if chunk else where


def describe_method(s: Session) -> str:
    """The method, its settings and what setup built for it, in a line."""
    parts = [s.method.name, s.method.settings.describe(), s.components.describe()]
    slices, iterations = getattr(s.plan, "slices", 1), getattr(s.plan, "iterations", 1)
    if slices > 1 or iterations > 1:  # a generation fed to several steps
        parts.append(
            f"each generation feeds {slices * iterations} steps ({slices} step(s) of prompts, trained {iterations} "
            "time(s))"
        )
    return ", ".join(p for p in parts if p)
