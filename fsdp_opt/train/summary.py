"""The run summary rank 0 prints at start: what trains, how it is sharded, the data, the batch, the prediction."""

from __future__ import annotations

import torch

from fsdp_opt.planner.steptime import describe_prediction
from fsdp_opt.runtime import torchao_gate
from fsdp_opt.runtime.distributed import print0
from fsdp_opt.tracking.progress import format_summary
from fsdp_opt.train.session import Session


def print_summary(session: Session, classes: set[type], units: int, n_params: int) -> None:
    c = session.config
    global_batch = session.plan.global_batch
    print0("fsdp-opt run")
    print0(
        format_summary(
            {
                "model": f"{c.model.model} ({n_params:,} parameters, tag {session.tag})",
                "strategy": f"{session.layout.strategy}, wrapped {', '.join(sorted(k.__name__ for k in classes))} x {units} + root = {units + 1} units",
                "precision": f"{session.precision} compute, fp32 master weights, {session.layout.reduce_dtype} gradient reduction"
                + (", dynamic loss scaling" if session.scaler.enabled else ""),
                "lora": describe_lora(session) if session.lora else "off (every weight trains)",
                "activation ckpt": session.layout.activation_checkpointing,
                "world": f"{session.env.world_size} rank(s) on {session.env.device.type}, {session.env.num_nodes} node(s)",
                "data": f"{c.data.dataset} rows [{c.data.start_idx}, {session.end_idx}) -> "
                + session.blocks.describe(PACKING_WORDS[c.data.packing]),
                "method": describe_method(session),
                "batch": f"{session.layout.batch_size} per rank x {session.env.world_size} ranks x {session.accum_steps} accum = {global_batch} sequences per step",
                "gradient sync": "every micro-batch"
                if session.reduce_each_microbatch or session.accum_steps == 1
                else "last micro-batch of each step",
                "loss": describe_loss(session),
                "predicted step": describe_prediction(session.predicted_step),
                "checkpoints": f"{c.checkpoint.state_dict_type}, written "
                + (
                    "in the background while training goes on"
                    if session.ckpt_writer is not None
                    else "before training goes on"
                ),
                "steps/epoch": session.plan.steps_per_epoch(),
                "start": f"global step {session.state.global_step}, epoch {session.state.epoch}",
                "chain": session.chain.describe() if session.chain else "-",
                "output": str(session.out_dir),
            }
        )
    )
    print0("config: " + " ".join(f"--{k} {v}" for k, v in session.flags().items() if v is not None))
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


def describe_lora(session: Session) -> str:
    info, trainable = session.lora, sum(p.numel() for p in session.params)
    return (
        f"rank {info['rank']}, alpha {info['alpha']:g}, dropout {info['dropout']:g} on {len(info['targets'])} layers: "
        f"{trainable:,} trainable parameters ({100 * trainable / max(1, session.n_params):.2f}%); base frozen in "
        f"{session.precision}, weights {info['base_fingerprint']}"
    )


def describe_loss(session: Session) -> str:
    """How the loss reads the logits: whole, or the output layer run at the target tokens (in chunks)."""
    if session.head_loss is None:
        return "whole logits at once (this model's logits are not a plain projection)"
    where = "the output layer at the target tokens only"
    chunk = session.layout.loss_chunk_tokens
    return f"{where}, {chunk} tokens at a time" if chunk else where


def describe_method(session: Session) -> str:
    """The method, its settings and what setup built for it, in a line."""
    parts = [session.method.name, session.method.settings.describe(), session.components.describe()]
    slices, iterations = getattr(session.plan, "slices", 1), getattr(session.plan, "iterations", 1)
    if slices > 1 or iterations > 1:  # a generation fed to several steps
        parts.append(
            f"each generation feeds {slices * iterations} steps ({slices} step(s) of prompts, trained {iterations} "
            "time(s))"
        )
    return ", ".join(p for p in parts if p)
