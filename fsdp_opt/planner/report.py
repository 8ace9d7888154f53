"""The whole plan of a configuration: every strategy's memory, the layouts ranked by predicted step time, disk and Hub
bytes, host RAM; and its rendering as tables.

The model is described from its config alone (the OPT family from 125m to 6.7b is built in, so this works offline;
any local config.json or model folder too). The byte counts follow the engine's choices: fp32 master weights, fp32
gradients, AdamW's two fp32 moments, weights gathered in the compute dtype, per-block FSDP units with the tied
embeddings in the root."""

from __future__ import annotations

from typing import Any

from fsdp_opt.base import gib
from fsdp_opt.config.choices import STRATEGIES
from fsdp_opt.config.methods import GENERATION, REFERENCE_PASS, spec
from fsdp_opt.model.shapes import Shape, model_config
from fsdp_opt.planner.disk import disk_and_hub, disk_line
from fsdp_opt.planner.dpo import reference_line, reference_pass
from fsdp_opt.planner.generation import Phase, grpo_lines, grpo_plan
from fsdp_opt.planner.host import host_memory as host_phases
from fsdp_opt.planner.host import render_host
from fsdp_opt.planner.inputs import Inputs, state_bytes
from fsdp_opt.planner.lora import adapter_params, describe
from fsdp_opt.planner.memory import activation_bytes, largest_micro_batch, memory, peak_bytes
from fsdp_opt.planner.search import (
    KEYS,
    Limits,
    Space,
    applied,
    by_gpu_count,
    change_line,
    cheapest_change,
    gpu_count_line,
    recommend,
    recommended_line,
)
from fsdp_opt.planner.steptime import candidates, comm_bytes, render_configurations, step_time


def make_plan(
    model: str,
    inputs: Inputs,
    *,
    disk: int,
    host_memory: int,
    keep_last: int,
    host_from: str = "--host_memory",
    save_optimizer: bool,
    sharded: bool = False,
    offload: bool = False,
    slices: int = 10,
    keep_full: int = 1,
    rates=None,
    samples: int | None = None,
    space: Space | None = None,
    data_bytes: int = 0,
) -> dict[str, Any]:
    """`samples`: sequences per optimizer step to search for (default: what the inputs imply); `space`: what the
    search may vary (default: everything, the fp16 reduce only with fp16 compute); `host_from`: where the host RAM's
    figure comes from, as the plan names it."""

    shape = Shape.of(model_config(model))
    strategies: dict[str, Any] = {}
    for strategy in STRATEGIES:
        if strategy == "HYBRID_SHARD" and inputs.nodes < 2:
            continue
        parts = memory(shape, strategy, inputs)
        total = peak_bytes(parts)
        strategies[strategy] = {
            "components": parts,
            "total_bytes": total,
            "fits": total <= inputs.gpu_memory,
            "max_micro_batch": largest_micro_batch(shape, strategy, inputs),
            "state_bytes_per_rank": sum(state_bytes(shape, strategy, inputs).values()),
            "comm_bytes_per_step": comm_bytes(shape, strategy, inputs),
            "predicted_step_time_s": step_time(shape, strategy, inputs, rates)["step_s"],
        }
    configurations = candidates(shape, inputs, list(strategies), rates)
    samples = samples or inputs.batch_size * inputs.accum_steps * inputs.gpus
    space = space or Space(strategies=tuple(strategies))
    limits = Limits(rates, space, host_memory, sharded)
    recommended = recommend(shape, inputs, samples, limits)
    change = None if recommended else cheapest_change(shape, inputs, samples, limits)
    gpu_counts = by_gpu_count(shape, inputs, samples, limits)
    stored = disk_and_hub(
        shape,
        inputs,
        disk=disk,
        keep_last=keep_last,
        save_optimizer=save_optimizer,
        slices=slices,
        keep_full=keep_full,
        data_bytes=data_bytes,
    )
    saved = stored.pop("saved")

    given = configurations[0] if configurations and configurations[0]["fits"] else None
    plan = {
        "model": model,
        "shape": shape.summary(),
        "lora": describe(shape, inputs) if inputs.lora_rank else None,
        "adapter_params": adapter_params(shape, inputs) if inputs.lora_rank else 0,
        "inputs": {
            **inputs.described(),
            "disk": disk,
            "host_memory": host_memory,
            "keep_last": keep_last,
            "save_optimizer": save_optimizer,
        },
        "activations": {
            "with_checkpointing": activation_bytes(shape, inputs, True),
            "without_checkpointing": activation_bytes(shape, inputs, False),
        },
        "strategies": strategies,
        "configurations": configurations,
        "auto_pick": configurations[0] if configurations and configurations[0]["fits"] else None,
        "samples_per_step": samples,
        "recommended": {k: recommended[k] for k in KEYS} if recommended else None,
        "by_gpu_count": [
            {k: r[k] for k in (*KEYS, "fits") if k in r} | ({"why": r["why"]} if "why" in r else {}) for r in gpu_counts
        ],
        "recommended_line": "",
        "fits_with": {k: change[k] for k in (*KEYS, "change", "max_length")} if change else None,
        "fits_with_line": None if recommended else change_line(not inputs.lora_rank, inputs, change),
        "gpu_count_line": gpu_count_line(gpu_counts),
        **stored,
        "host_ram": host_ram(
            host_phases(shape, "FULL_SHARD", inputs, save_optimizer=save_optimizer, sharded=sharded, offload=offload),
            shape,
            host_memory,
            save_optimizer,
            saved,
        )
        | {"host_from": host_from},
    }
    if REFERENCE_PASS in inputs.method.spec.phases:  # a pass of the reference before training, keyed by the method
        strategy = next(s for s in ("FULL_SHARD", "HYBRID_SHARD", "SHARD_GRAD_OP", "NO_SHARD") if s in strategies)
        own = bool(inputs.lora_rank) and not inputs.ref_model
        plan[inputs.method_name] = reference_pass(shape, strategy, inputs, rates, own)
        plan[inputs.method_name]["strategy"] = strategy
    whole = None  # a method's whole steps: the recommendation's and the flags', compared by them
    if GENERATION in inputs.method.spec.phases:  # the generation phase beside the training step, keyed by the method
        # the flags given where they fit (what the command runs), else the recommended layout
        strategy = given["strategy"] if given else recommended["sharding_strategy"] if recommended else "FULL_SHARD"
        training_s = given["step_s"] if given else recommended["predicted_step_time_s"] if recommended else None
        plan[inputs.method_name] = generating(shape, inputs, samples, rates, strategy, training_s)
        if recommended:
            mine = generating(
                shape,
                applied(inputs, recommended),
                samples,
                rates,
                recommended["sharding_strategy"],
                recommended["predicted_step_time_s"],
            )
            t = inputs.method.spec
            added = "generation" + (", teacher" if t.teacher else ", reference" if inputs.beta > 0 else "")
            whole = (mine["step_s"], plan[inputs.method_name]["step_s"] if given else None, added)
    elif REFERENCE_PASS in inputs.method.spec.phases and recommended:
        # the pass before training, its share of a step: the same for any layout of the step (its own strategy)
        share = plan[inputs.method_name]["seconds_per_1000_pairs"] * samples / 1000
        training = given["step_s"] + share if given else None
        whole = (recommended["predicted_step_time_s"] + share, training, "the reference pass's share")
    if samples != inputs.batch_size * inputs.accum_steps * inputs.gpus:  # --global_batch: the flags' step is not it
        given, whole = None, whole and (whole[0], None, whole[2])
    plan["recommended_line"] = recommended_line(recommended, given, samples, whole)
    return plan


def generating(
    shape: Shape, inputs: Inputs, samples: int, rates: Any, strategy: str, training_s: float | None
) -> dict[str, Any]:
    """A step that generates (GRPO's, distillation's) in one layout: the generation phase, the forward of the model
    kept beside (the teacher, of its own shape; GRPO's reference at --beta > 0: a model of its own for full
    fine-tuning or with --ref_model, else the base with the adapters off) and the training step (`training_s`)."""
    t = inputs.method.spec
    phase = Phase(
        samples,
        inputs.generations if t.group else 1,
        inputs.completion_length,
        inputs.generation_slices,
        inputs.iterations,
        forward_beside=t.teacher or inputs.beta > 0,
        beside=Shape.of(model_config(inputs.teacher)) if t.teacher and inputs.teacher else shape,
    )
    return grpo_plan(
        shape,
        strategy,
        inputs,
        phase,
        training_s,
        rates,
        inputs.decoding,
        reference_model=t.teacher or (inputs.beta > 0 and (not inputs.lora_rank or inputs.ref_model)),
        beside_name="teacher" if t.teacher else "reference",
        beside_bits=inputs.teacher_bits if t.teacher else 16,
    )


def host_ram(
    phases: dict[str, Any], shape: Shape, host_memory: int, save_optimizer: bool, saved: int
) -> dict[str, Any]:
    worst = max(phases["peak_fresh"]["machine"], phases["peak_resumed"]["machine"])
    # gather_bytes: what rank 0 gathers for a full save (and maps again to resume).
    gather = (12 if save_optimizer else 4) * saved
    return {**phases, "gather_bytes": gather, "host_memory": host_memory, "fits": worst <= host_memory}


def render(plan: dict[str, Any]) -> str:
    i, shape = plan["inputs"], plan["shape"]
    lines = [
        f"{plan['model']}: {shape['params']:,} parameters ({shape['layers']} blocks of {shape['block_params']:,}, "
        f"root {shape['root_params']:,})",
        (
            f"{i['gpus']} GPU(s) on {i['nodes']} node(s), {gib(i['gpu_memory'])} each"
            if i["cuda"]
            else f"{i['gpus']} CPU process(es) on {i['nodes']} machine(s), in host memory"
        )
        + f"; micro-batch {i['batch_size']} x {i['max_length']} tokens, {i['precision']}, accum {i['accum_steps']}, "
        "activation checkpointing "
        f"{'on' if i['activation_checkpointing'] else 'off'}",
        *([plan["lora"]] if plan.get("lora") else []),
        "",
    ]
    names = list(plan["strategies"])
    comps = list(next(iter(plan["strategies"].values()))["components"])
    lines.append(f"| per {'GPU' if i['cuda'] else 'process'} | " + " | ".join(names) + " |")
    lines.append("| --- |" + " --- |" * len(names))
    for comp in comps:
        lines.append(f"| {comp} | " + " | ".join(gib(plan["strategies"][n]["components"][comp]) for n in names) + " |")
    lines.append(
        "| **total** | " + " | ".join(f"**{gib(plan['strategies'][n]['total_bytes'])}**" for n in names) + " |"
    )
    lines.append("| fits | " + " | ".join("yes" if plan["strategies"][n]["fits"] else "NO" for n in names) + " |")
    lines.append(
        "| largest micro-batch | " + " | ".join(str(plan["strategies"][n]["max_micro_batch"]) for n in names) + " |"
    )
    if any(plan["strategies"][n]["components"]["accumulated_gradients"] for n in names):
        lines.append(
            "(total: accumulating without sync, the sharded gradients appear only as the accumulated ones are "
            "reduce-scattered, so they are not added to them)"
        )

    lines += ["", *render_configurations(plan), plan["recommended_line"], plan["gpu_count_line"]]
    ref = plan.get(i["method"]) if REFERENCE_PASS in spec(i["method"]).phases else None
    if ref:
        lines.append(reference_line(ref, ref["strategy"], i["gpu_memory"], i["method"]))
    if GENERATION in spec(i["method"]).phases and plan.get(i["method"]):
        lines += grpo_lines(plan[i["method"]], i["gpu_memory"], i["method"])
    if plan.get("fits_with_line"):
        lines.append(plan["fits_with_line"])
    a, c, d, r = plan["activations"], plan["checkpoints"], plan["disk"], plan["host_ram"]
    lines += [
        "",
        f"activations: {gib(a['with_checkpointing'])} with checkpointing, {gib(a['without_checkpointing'])} without",
        f"checkpoints{' (the adapters)' if plan.get('lora') else ''}: full {gib(c['full_with_optimizer'])} (weights "
        f"only {gib(c['full_weights_only'])}), sharded {gib(c['sharded_with_optimizer_per_rank'])} per rank, fp16 "
        f"export {gib(c['export_fp16'])}"
        + (f" (merged into the base: {gib(c['merged_export_fp16'])})" if plan.get("lora") else ""),
        disk_line(d, i["keep_last"], i["disk"]),
        f"Hub repo after {plan['hub']['slices']} slices with --hub_keep_full {plan['hub']['keep_full']}: "
        f"{gib(plan['hub']['total'])} ({gib(plan['hub']['full_checkpoints'])} of full checkpoints, "
        f"{gib(plan['hub']['weights_files'])} of weights files; {gib(plan['hub']['with_export'])} with an exported "
        "model)",
        "",
    ]

    lines += render_host(r, r["host_memory"], r.get("host_from", "--host_memory"))
    return "\n".join(lines)
