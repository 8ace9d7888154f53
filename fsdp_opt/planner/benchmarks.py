"""lm-eval's scoring in the plan (--eval_tasks at each save; `evaluate --tasks`): its memory per GPU and its time.

What the tasks ask is counted from their requests once they are read (engine/benchmarks.py `request_counts`): the
tokens of the loglikelihood requests (a forward each, at most --batch_size at a time, longest first) and the
generate_until requests (a prefill, then up to max_gen_toks decoding steps a batch).

Memory while scoring at a save (the training state stays: planner/generation.py's accounting of a generation phase,
with the rank's batch as its requests): the model gathered whole in the compute dtype (or one block at a time on the
shards), a batch's forward at the longest request's tokens (its transient tensors in one block), the KV cache of a
generation batch, and the output layer's fp32 log-probabilities at the continuation's positions.

Time: the forwards' FLOPs at --tflops (engine/lmeval.py runs the output layer at the continuations only), the
decoding steps as GRPO's generation counts them (planner/generation.py generation_time), and one gather of the model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fsdp_opt.base import gib
from fsdp_opt.model.shapes import Shape
from fsdp_opt.planner.generation import generation_memory, generation_time
from fsdp_opt.planner.inputs import Inputs, shard_factor
from fsdp_opt.planner.steptime import Rates
from fsdp_opt.runtime.distributed import DistEnv


def scoring_memory(
    shape: Shape, strategy: str, inputs: Inputs, batch_size: int, length: int, gathered: bool = True
) -> dict[str, int]:
    """Bytes per GPU at the scoring's peak, by component: a generation phase of `batch_size` requests of `length`
    tokens (the training state, the gathered model, the KV cache, a block's transient tensors, the logits)."""
    at = dataclasses.replace(inputs, max_length=length)
    return generation_memory(shape, strategy, at, batch_size, gathered=gathered)


def scoring_plan(
    shape: Shape,
    strategy: str,
    inputs: Inputs,
    counts: dict[str, Any],
    batch_size: int,
    rates: Rates | None = None,
    gathered: bool = True,
) -> dict[str, Any]:
    """The scoring's memory (by component, and its peak per GPU) and time, from the tasks' request counts. Its time is
    every rank's at once: the loglikelihood tokens' forwards, the generation batches' decoding, the gather."""
    rates = rates or Rates()
    memory = scoring_memory(shape, strategy, inputs, batch_size, counts["longest"], gathered)
    ranks = max(1, inputs.gpus)
    forward = counts["tokens"] / ranks * 2.0 * shape.flop_params / (rates.tflops * 1e12)
    decode = 0.0
    if counts["generations"]:
        per_rank = math.ceil(counts["generations"] / ranks)
        at = dataclasses.replace(inputs, max_length=counts["longest"])
        one = generation_time(shape, strategy, at, min(batch_size, per_rank), counts["max_gen_toks"], rates, gathered)
        decode = math.ceil(per_rank / batch_size) * one["decode_s"]
    f = shard_factor(strategy, inputs)
    c = 4 if inputs.precision == "fp32" else 2
    gather = (f - 1) / f * c * shape.params / (rates.link_gbps * 1e9) if f > 1 else 0.0
    return {
        "memory": memory,
        "peak_bytes": sum(memory.values()),
        "time": {"forward_s": forward, "decode_s": decode, "gather_s": gather, "seconds": forward + decode + gather},
        "counts": counts,
        "gathered": gathered,
    }


def scoring_line(plan: dict[str, Any]) -> str:
    """The plan's line for the scoring at each save."""
    counts, time = plan["counts"], plan["time"]
    return (
        f"lm-eval at each save: {counts['requests']:,} requests ({counts['tokens']:,} tokens scored, "
        f"{counts['generations']:,} generations of up to {counts['max_gen_toks']} tokens), predicted "
        f"{time['seconds']:.1f} s, peak {gib(plan['peak_bytes'])} per GPU with the training state it keeps "
        f"(on {'the model gathered once' if plan['gathered'] else 'the shards'})"
    )


def gathered_scoring_fits(model_config, env: DistEnv, precision: str, batch_size: int, strategy: str) -> bool:  # noqa: ANN001
    """Whether the model gathered whole, a batch's forward and its KV cache fit this GPU beside what is allocated now
    (always on CPU, whose memory the plan shares out otherwise)."""
    if env.device.type != "cuda":
        return True
    import torch

    shape = Shape.of(model_config)
    inputs = Inputs(gpus=env.world_size, nodes=env.num_nodes, precision=precision)
    length = int(getattr(model_config, "max_position_embeddings", 2048) or 2048)
    need = scoring_memory(shape, strategy, inputs, batch_size, length, gathered=True)
    wanted = need["gathered_weights"] + need["kv_cache"] + need["prefill"] + need["logits"]
    free, _ = torch.cuda.mem_get_info(env.device)
    return wanted <= free
