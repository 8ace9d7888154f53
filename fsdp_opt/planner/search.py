"""The fastest configuration that fits, for a number of sequences per optimizer step: the search behind `plan`'s
`recommended` and `by_gpu_count` and the trainer's `--batch_size auto`.

For the given sequences per step (all GPUs) it tries every micro-batch that divides one GPU's share (the rest is
accumulation), every strategy and reduce mode, loss chunking on and off, activation checkpointing on and off, the
fp16 reduce where allowed, and CPU offload (full fine-tuning on GPUs) only where nothing fits without it. Each is judged by the memory model
(`memory.peak_bytes` against the GPU's usable memory; with offload also the host's RAM) and ranked by the step-time
model (`steptime.step_time`); the fastest one that fits wins, the smaller peak on a tie.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from fsdp_opt.base import gib
from fsdp_opt.model.shapes import Shape
from fsdp_opt.planner.host import host_memory as host_phases
from fsdp_opt.planner.inputs import Inputs
from fsdp_opt.planner.memory import memory, peak_bytes
from fsdp_opt.planner.steptime import Rates, step_time

LOSS_CHUNK = 1024  # tokens per chunk when the search turns loss chunking on
MICRO_BATCH_LIMIT = 256

# The keys of a configuration as `plan --json` gives it (`recommended`, each of `by_gpu_count`).
KEYS = (
    "batch_size",
    "accum_steps",
    "gpus",
    "sharding_strategy",
    "reduce_every_microbatch",
    "reduce_dtype",
    "loss_chunk_tokens",
    "activation_checkpointing",
    "cpu_offload",
    "predicted_step_time_s",
    "peak_bytes",
)


@dataclass(frozen=True)
class Space:
    """What the search may vary; a fixed flag is a one-element tuple."""

    strategies: tuple[str, ...] = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    reduce_every: tuple[bool, ...] = (False, True)
    reduce_dtypes: tuple[str, ...] = ("fp32",)
    checkpointing: tuple[bool, ...] = (True, False)
    chunking: bool = True
    offload: bool = True  # tried where nothing fits without it (GPU runs only)


@dataclass(frozen=True)
class Limits:
    """What a configuration is held to besides the GPUs' memory: the rates it is timed at, what the search may vary,
    one machine's host RAM (None: not checked) and whether saves are sharded (no gather to rank 0)."""

    rates: Rates = field(default_factory=Rates)
    space: Space = Space()
    host_memory: int | None = None
    sharded: bool = False


def reduce_dtypes(choice: str, precision: str) -> tuple[str, ...]:
    """The reduce dtypes --reduce_dtype lets the search try: the one given, or with auto the fp16 reduce too where
    the compute is fp16."""
    if choice == "auto":
        return ("fp32", "fp16") if precision == "fp16" else ("fp32",)
    return (choice,)


def divisors(n: int, limit: int = MICRO_BATCH_LIMIT) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _options(shape: Shape, inputs: Inputs, per_gpu: int, space: Space, offload: bool):  # noqa: ANN202
    for b in divisors(per_gpu):
        accum = per_gpu // b
        chunks = (0, LOSS_CHUNK) if space.chunking and b * inputs.max_length > LOSS_CHUNK else (0,)
        for strategy in space.strategies:
            for every in space.reduce_every if accum > 1 else (False,):
                for rdtype in space.reduce_dtypes:
                    for ac in space.checkpointing:
                        for chunk in chunks:
                            yield (
                                strategy,
                                replace(
                                    inputs,
                                    batch_size=b,
                                    accum_steps=accum,
                                    reduce_every_microbatch=every,
                                    reduce_dtype=rdtype,
                                    activation_checkpointing=ac,
                                    loss_chunk_tokens=chunk,
                                    cpu_offload=offload,
                                ),
                            )


def describe_option(
    shape: Shape, strategy: str, inputs: Inputs, rates: Rates, host_memory: int | None, sharded: bool = False
) -> dict[str, Any]:
    """One configuration as the plan reports it, with its peak, whether it fits, and its predicted step."""
    peak = peak_bytes(memory(shape, strategy, inputs))
    fits = peak <= inputs.gpu_memory
    host_peak = None
    if fits and inputs.cpu_offload and host_memory is not None:
        phases = host_phases(shape, strategy, inputs, save_optimizer=True, sharded=sharded, offload=True)
        host_peak = max(phases["peak_fresh"]["machine"], phases["peak_resumed"]["machine"])
        fits = host_peak <= host_memory
    t = step_time(shape, strategy, inputs, rates)
    return {
        "batch_size": inputs.batch_size,
        "accum_steps": inputs.accum_steps,
        "gpus": inputs.gpus,
        "sharding_strategy": strategy,
        "reduce_every_microbatch": inputs.reduce_every_microbatch and inputs.accum_steps > 1,
        "reduce_dtype": inputs.reduce_dtype,
        "loss_chunk_tokens": inputs.loss_chunk_tokens,
        "activation_checkpointing": inputs.activation_checkpointing,
        "cpu_offload": inputs.cpu_offload,
        "predicted_step_time_s": t["step_s"],
        "peak_bytes": peak,
        "fits": fits,
        "prediction": t,
        "host_peak_bytes": host_peak,
    }


def recommend(shape: Shape, inputs: Inputs, samples: int, limits: Limits = Limits()) -> dict[str, Any] | None:
    """The fastest configuration of `samples` sequences per step on inputs.gpus GPUs that fits; None when none does
    (or when the GPUs do not divide `samples`)."""
    return _search(shape, inputs, samples, limits)[0]


def _search(shape: Shape, inputs: Inputs, samples: int, limits: Limits) -> tuple[dict[str, Any] | None, str]:
    """The best configuration, or None and why."""
    rates, space, host_memory, sharded = limits.rates, limits.space, limits.host_memory, limits.sharded
    if samples % inputs.gpus:
        return None, f"{samples} sequences do not split over {inputs.gpus} GPUs"
    least_host = None
    per_gpu = samples // inputs.gpus
    # Offload is for full fine-tuning: a LoRA run's state is small, and its base shrinks with --base_bits 4 instead.
    modes = [False] + ([True] if space.offload and inputs.cuda and not inputs.lora_rank else [])
    for offload in modes:  # offload only where nothing fits without it
        best = None
        for strategy, this in _options(shape, inputs, per_gpu, space, offload):
            if strategy == "HYBRID_SHARD" and this.nodes < 2:
                continue
            option = describe_option(shape, strategy, this, rates, host_memory, sharded)
            if option["host_peak_bytes"] is not None and not option["fits"]:
                least_host = min(least_host or option["host_peak_bytes"], option["host_peak_bytes"])
            if option["fits"] and (
                best is None
                or (option["predicted_step_time_s"], option["peak_bytes"])
                < (best["predicted_step_time_s"], best["peak_bytes"])
            ):
                best = option
        if best is not None:
            return best, ""
    if least_host is not None:
        return None, (
            f"it fits the GPU only with --cpu_offload, and then host RAM peaks at {gib(least_host)} "
            f"(a full save included) of {gib(host_memory)}"
        )
    if inputs.lora_rank and inputs.base_bits == 16:
        return None, "nothing fits the GPU's memory (a 4-bit base, --base_bits 4, is smaller)"
    return None, "nothing fits the GPU's memory"


SUGGESTED_RANK = 16  # the LoRA rank a suggestion names


def cheapest_change(shape: Shape, inputs: Inputs, samples: int, limits: Limits = Limits()) -> dict[str, Any] | None:
    """When nothing fits: the first change that does, in order of what it gives up: LoRA (rank 16) instead of
    full fine-tuning, then a 4-bit base, then a shorter --max_length (halved, down to 128). Returns the fastest
    configuration with that change, with "change" (the flags), "max_length" and "inputs" (the plan's inputs with the
    change made) in it; None when none fits."""
    tries: list[tuple[list[str], Inputs]] = []
    lora = inputs
    if not inputs.lora_rank:
        lora = replace(inputs, lora_rank=SUGGESTED_RANK)
        tries.append(([f"--lora_rank {SUGGESTED_RANK}"], lora))
    flags = [] if inputs.lora_rank else [f"--lora_rank {SUGGESTED_RANK}"]
    small = lora
    if lora.base_bits != 4:
        small = replace(lora, base_bits=4)
        flags = flags + ["--base_bits 4"]
        tries.append((flags, small))
    length = inputs.max_length // 2
    while length >= 128:
        tries.append((flags + [f"--max_length {length}"], replace(small, max_length=length)))
        length //= 2
    for change, this in tries:
        best = recommend(shape, this, samples, limits)
        if best is not None:
            return {**best, "change": " ".join(change), "max_length": this.max_length, "inputs": this}
    return None


def change_line(full: bool, inputs: Inputs, found: dict[str, Any] | None) -> str:
    """The plan's line when nothing fits: what does, e.g. "full fine-tuning does not fit 2 x 14.50 GiB; --lora_rank 16
    fits, 10.40 s per step"."""
    what = (
        "full fine-tuning"
        if full
        else f"LoRA rank {inputs.lora_rank}" + (" on a 4-bit base" if inputs.base_bits == 4 else "")
    )
    line = f"{what} does not fit {inputs.gpus} x {inputs.gpu_memory / 2**30:.2f} GiB"
    if found is None:
        return line + "; nor does LoRA on a 4-bit base at 128 tokens"
    return line + f"; {found['change']} fits, {found['predicted_step_time_s']:.2f} s per step ({describe(found)})"


def by_gpu_count(shape: Shape, inputs: Inputs, samples: int, limits: Limits = Limits()) -> list[dict[str, Any]]:
    """The best configuration for 1, 2, ... inputs.gpus GPUs at the same sequences per step (on one node while the
    count fits in one: gpus per node = inputs.gpus / inputs.nodes)."""
    per_node = max(1, inputs.gpus // inputs.nodes)
    out = []
    for g in range(1, inputs.gpus + 1):
        nodes = 1 if g <= per_node else -(-g // per_node)
        if g % nodes:
            continue
        this = replace(inputs, gpus=g, nodes=nodes)
        best, why = _search(shape, this, samples, limits)
        out.append(best if best is not None else {"gpus": g, "fits": False, "why": why})
    return out


def describe(c: dict[str, Any]) -> str:
    """A configuration in words, as the plan and the trainer print it."""
    parts = [f"micro-batch {c['batch_size']} x accum {c['accum_steps']} x {c['gpus']} GPU(s)", c["sharding_strategy"]]
    if c["accum_steps"] > 1:
        parts.append("reduce every micro-batch" if c["reduce_every_microbatch"] else "reduce on the last micro-batch")
    if c["reduce_dtype"] != "fp32":
        parts.append(f"{c['reduce_dtype']} reduce")
    parts.append(f"loss in chunks of {c['loss_chunk_tokens']} tokens" if c["loss_chunk_tokens"] else "loss not chunked")
    parts.append("activation checkpointing " + ("on" if c["activation_checkpointing"] else "off"))
    if c["cpu_offload"]:
        parts.append("CPU offload")
    return ", ".join(parts)


# What a searched configuration decides of the flags (the inputs' and the run's Layout's names for them).
CHOSEN = (
    "batch_size",
    "accum_steps",
    "reduce_dtype",
    "loss_chunk_tokens",
    "activation_checkpointing",
    "cpu_offload",
)


def chosen(c: dict[str, Any]) -> dict[str, Any]:
    """A searched configuration's choices, but for its strategy and reduce mode."""
    return {k: c[k] for k in CHOSEN}


def applied(inputs: Inputs, c: dict[str, Any]) -> Inputs:
    """The inputs with a searched configuration's choices in place."""
    return replace(inputs, reduce_every_microbatch=c["reduce_every_microbatch"], **chosen(c))


def recommended_line(
    recommended: dict[str, Any] | None,
    given: dict[str, Any] | None,
    samples: int,
    whole: tuple[float, float | None, str] | None = None,
) -> str:
    """The plan's one line: the recommendation against the flags given. `whole`: a method's whole steps, (the
    recommendation's, the flags' (None: they do not fit), what they add to training: "generation, teacher"), which
    the two are compared by: training is only part of such a step."""
    if recommended is None:
        return f"recommended: nothing fits {samples} sequences per step"
    training = recommended["predicted_step_time_s"]
    if whole is None:
        mine, theirs = training, given["step_s"] if given else None
        line = f"recommended: {describe(recommended)}: {mine:.2f} s per step of {samples}"
    else:
        mine, theirs, what = whole
        line = (
            f"recommended: {describe(recommended)}: {mine:.2f} s per step of {samples} ({what} included; training "
            f"{training:.2f} s of it)"
        )
    if theirs is None:
        return line + "; the flags given do not fit"
    ratio = theirs / mine
    if ratio < 1.005:
        return line + f", the same as the flags given ({theirs:.2f} s)"
    return line + f", {ratio:.2f}x faster than the flags given ({theirs:.2f} s)"


def gpu_count_line(rows: list[dict[str, Any]]) -> str:
    """One line: how the most GPUs compare with one (or which count is fastest)."""
    ok = [r for r in rows if r.get("fits")]
    if not ok:
        return f"GPUs: nothing fits on 1 to {rows[-1]['gpus'] if rows else 0} GPU(s)"
    one = next((r for r in ok if r["gpus"] == 1), None)
    most = max(ok, key=lambda r: r["gpus"])
    fastest = min(ok, key=lambda r: r["predicted_step_time_s"])
    if one is None:
        why = next((r["why"] for r in rows if r["gpus"] == 1), "")
        return f"{most['gpus']} GPUs: {most['predicted_step_time_s']:.2f} s per step; one GPU does not fit ({why})" + (
            ""
            if fastest is most
            else f"; {fastest['gpus']} GPUs are fastest ({fastest['predicted_step_time_s']:.2f} s)"
        )
    if most is one:
        return "1 GPU: the only count that fits"
    speedup = one["predicted_step_time_s"] / most["predicted_step_time_s"]
    if speedup >= 1:
        return (
            f"{most['gpus']} GPUs: {speedup:.2f}x one GPU ({most['predicted_step_time_s']:.2f} s against "
            f"{one['predicted_step_time_s']:.2f} s per step)"
        )
    return (
        f"1 GPU: {1 / speedup:.2f}x {most['gpus']} GPUs ({one['predicted_step_time_s']:.2f} s against "
        f"{most['predicted_step_time_s']:.2f} s per step): the link costs more than the second GPU gives"
    )
