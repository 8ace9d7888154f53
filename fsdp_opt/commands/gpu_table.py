"""gpu_check's table: every figure of its launches beside the plan's, with the device named."""

from __future__ import annotations

from typing import Any

from fsdp_opt.base import GIB, gib

CONTEXT_WORDS = {True: "yes (a bug)", False: "none", None: "not known (the CUDA driver did not answer)"}


def render(f: dict[str, Any]) -> list[str]:

    def num(v: Any, fmt: str = "{:.2f}") -> str:
        return "-" if v is None else fmt.format(v)

    ratio = (
        f["step_time_measured_s"] / f["step_time_predicted_s"]
        if f["step_time_measured_s"] and f["step_time_predicted_s"]
        else None
    )
    lines = [
        f"gpu_check: {f['model']}"
        + (f" with LoRA rank {f['lora_rank']}" if f.get("lora_rank") else "")
        + f", {f['ranks']} x {f['device']}, {f['strategy']}, micro-batch {f['batch_size']} x accum {f['accum_steps']}"
        + (", reduce every micro-batch" if f["reduce_every_microbatch"] else ""),
        "| figure | value |",
        "| --- | --- |",
        f"| plan peak per GPU (with runtime) | {gib(f['plan_peak_bytes'])} |",
        f"| max_memory_allocated (rank 0) | {num(f['max_memory_allocated_gib'])} GiB (plan less runtime: "
        f"{gib(f['plan_peak_without_runtime_bytes'])}) |",
        f"| max_memory_reserved (rank 0) | {num(f['max_memory_reserved_gib'])} GiB |",
        f"| useful tokens/s (median, all ranks) | {num(f['useful_tokens_per_s'], '{:,.0f}')} |",
        f"| MFU | {num(f['mfu'], '{:.1%}')} |",
        f"| step time: measured / predicted | {num(f['step_time_measured_s'], '{:.3f}')} s / "
        f"{num(f['step_time_predicted_s'], '{:.3f}')} s ({num(ratio)}x) |",
        f"| skipped fp16 steps | {f['skipped_fp16_steps']} of {f['steps'] + f['resumed_steps']} |",
        f"| save (first launch) | {num(f['save_s'], '{:.1f}')} s |",
        f"| resume: read / load into the shards | {num(f['checkpoint_read_s'], '{:.1f}')} s / "
        f"{num(f['load_into_shards_s'], '{:.1f}')} s |",
        f"| resumed | at global step {f['resumed_from_step']}, {f['resumed_steps']} more steps |",
        f"| usable memory per GPU (free with a context, less NCCL's buffers) | {num(f.get('usable_gib'))} GiB"
        + (
            f": the plan's {gib(f['plan_peak_bytes'])} "
            + ("fits" if f["plan_peak_bytes"] / GIB <= f["usable_gib"] else "does NOT fit")
            if f.get("usable_gib")
            else ""
        )
        + " |",
        f"| CUDA context in gpu_check's own process | {CONTEXT_WORDS[f.get('cuda_context_in_this_process')]} |",
    ]
    g = f.get("grpo")
    if g:
        ratio = (
            g["step_time_measured_s"] / g["step_time_predicted_s"]
            if g["step_time_measured_s"] and g["step_time_predicted_s"]
            else None
        )
        lines += [
            f"| GRPO ({g['steps']} steps, {g['completions_per_step']} completions of up to {g['max_completion_length']} "
            f"tokens a step{', LoRA rank 16' if g['lora_rank'] else ''}): generation on | {g['where'] or '-'}"
            + (f", decoded with {g['decoding']}" if g.get("decoding") else "")
            + " |",
            f"| GRPO generated tokens/s (median, all ranks) | {num(g['generated_tokens_per_s'], '{:,.0f}')} "
            f"(generation {num(g['generation_share'], '{:.0%}')} of the step) |",
            f"| GRPO step time: measured / predicted | {num(g['step_time_measured_s'], '{:.3f}')} s / "
            f"{num(g['step_time_predicted_s'], '{:.3f}')} s ({num(ratio)}x) |",
        ]
        peer = g.get("peer") or {}
        if "ways" in peer:
            ways = peer["ways"]
            rate = lambda w: "-" if "skipped" in ways.get(w, {"skipped": 1}) else f"{ways[w]['tokens_per_s']:,.0f}"  # noqa: E731
            per_gpu = g["generated_tokens_per_s"] / f["ranks"] if g["generated_tokens_per_s"] else None
            lines += [
                f"| GRPO generated tokens/s per GPU: the run / transformers' static-cache generate ({peer['prompts']} "
                f"completions) | {num(per_gpu, '{:,.0f}')} / {rate('hf_static')} |",
                f"| decoding alone, tokens/s: static / CUDA graphs / the weights read once a step | {rate('static')} / "
                f"{rate('graphs')} / {num(peer.get('weight_read_bound_tokens_per_s'), '{:,.0f}')} |",
            ]
        elif peer:
            lines.append(f"| decoding peer | failed: {peer.get('error')} |")
        if g.get("plan_generation_peak_bytes"):
            lines.append(
                f"| GRPO max_memory_allocated (rank 0) / plan of generation | "
                f"{num(g['max_memory_allocated_gib'])} GiB / {gib(g['plan_generation_peak_bytes'])} |"
            )
    for link in f.get("links", []):
        what = f"{link['backend']}" + (
            f", P2P {'on' if link['p2p'] else 'off (NCCL_P2P_DISABLE=1)'}" if link["backend"] == "nccl" else ""
        )
        value = (
            f"all-gather {link['all_gather_gbps']:.2f} GB/s, reduce-scatter {link['reduce_scatter_gbps']:.2f} GB/s"
            if "error" not in link
            else f"failed: {link['error']}"
        )
        lines.append(f"| link ({what}) | {value} |")
    return lines
