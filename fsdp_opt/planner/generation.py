"""--method grpo in the plan: the memory and time of a step's generation phase, beside its training.

Memory per GPU while generating (the optimizer state stays; the gradients are freed):
- the training state: fp32 weights and AdamW's moments, sharded (LoRA: the frozen base in its storage dtype and the
  adapters' state);
- the model gathered whole in the compute dtype (gathered once: engine/generation.py), or one block at a time when
  generating on the shards (layer by layer);
- the KV cache of the rank's completions: 2 (keys, values) x layers x kv heads x head dim x --max_length tokens x
  the compute dtype's bytes, for each completion (its prompt and completion);
- the prefill's transient tensors in one block (planner/generation.py prefill_bytes);
- a decoding step's logits: each completion's last position over the vocabulary, in fp32, twice (the scores and the
  processed ones);
- a reference model kept beside the policy (--beta > 0 with --ref_model or full fine-tuning): sharded, compute dtype.

Time: the prompts' prefill from FLOPs (2 N per token at --tflops); each decoding step reads the gathered weights and
the KV cache from GPU memory (--hbm_gbps, 320 GB/s on a T4), computes its tokens, or waits for the host to launch its
kernels, whichever is longest (HOST_S_PER_BLOCK and the rest below: on a GPU a small batch's step is the host's); on
the shards, each decoding step also all-gathers the whole model over the link (--link_gbps). Then the reference's
forward over the completions (--beta > 0) and the training step at the layout's micro-batches.

The graph path (--decoding graphs, engine/decoding.py) replaces the host's launches of a step by one replay: a step
is then the GPU's own time, reading or computing, plus each block's kernels run back to back (GRAPH_S_PER_BLOCK) and
the sampler launched after it (SAMPLER_S), once per generation a capture (CAPTURE_S). Its memory adds the graph's
pool: one decoding step's transient tensors. Those constants come from one measurement of a plain CUDA graph around an
eager decoding step (Qwen2.5-1.5B's shape, fp16, 8 completions, one H200: captured in 26 ms, 4.66 ms a step), not
from this package's graph path, which no GPU has run yet: the plan prints the eager figure beside it.

A generation fed to more than one step (--steps_per_generation, --num_iterations) is sampled once: a step's share of
it, of the reference's forward and of the forward that keeps the old log-probabilities is the generation's over its
steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fsdp_opt.base import gib
from fsdp_opt.model.shapes import Shape
from fsdp_opt.planner.inputs import CUDA_CONTEXT_BYTES, FRAGMENTATION, NCCL_BUFFER_BYTES, Inputs, shard_factor
from fsdp_opt.planner.lora import adapter_params, block_base_bytes, chosen
from fsdp_opt.planner.steptime import Rates, forward_time

LOGIT_COPIES = 2  # a decoding step's fp32 scores and the processed ones

# The host's time in one decoding step (transformers' generate, eager: Python and kernel launches), which the GPU's
# own work runs under. Fitted to the trainer's own GRPO steps on the H200 machine lent to this project (its host CPU;
# opt-1.3b, 24 blocks of 6 linear layers, LoRA rank 16, fp16, 8 completions of 128 tokens, 1 rank): 20.8 ms a step
# with the adapters merged into the gathered 16-bit base, 36.9 ms with them beside it, 66.6 ms on the NF4 base.
# benchmarks/decode_step.py shows the host's share does not grow with the weights: opt-350m's step took what
# opt-1.3b's did. A slower host CPU (Kaggle's) takes longer than these.
HOST_S_PER_BLOCK = 0.87e-3  # a block (its adapters merged, or none)
HOST_S_PER_ADAPTER = 0.11e-3  # a LoRA layer whose adapters run beside its weight (the NF4 base, or on the shards)
HOST_S_PER_NF4 = 0.21e-3  # an NF4 weight's dequantization before its matmul
# The graph path (--decoding graphs): estimates from a plain CUDA graph around Qwen2.5-1.5B's eager step on an H200
# (4.66 ms a step where its weights take 0.73 ms to read, over 28 blocks); not yet measured on this package's path.
GRAPH_S_PER_BLOCK = 0.14e-3  # a block's kernels replayed back to back (the GPU's launch gaps, not the host's)
SAMPLER_S = 0.15e-3  # the sampler's kernels after each replay (temperature, top-k, top-p, the counter's draw)
CAPTURE_S = 26e-3  # one capture per generation (the gathered weights move between generations)


def requests_per_rank(global_batch: int, generations: int, gpus: int) -> int:
    """Completions one rank generates in a step (its prompts x G; the prompts spread evenly over the ranks)."""
    prompts = max(1, global_batch // max(1, generations))
    return math.ceil(prompts / max(1, gpus)) * generations


def generation_memory(
    shape: Shape,
    strategy: str,
    inputs: Inputs,
    requests: int,
    gathered: bool = True,
    reference_model: bool = False,
    beside: Shape | None = None,
    beside_bits: int = 16,
) -> dict[str, int]:
    """Bytes per GPU of the generation phase by component (each at its peak; they add up). `reference_model`: a
    model of its own kept beside, sharded in the compute dtype (`beside_bits` 4: its blocks' linear weights in NF4),
    of shape `beside` (default: the model's)."""
    f = shard_factor(strategy, inputs)
    c = 4 if inputs.precision == "fp32" else 2
    lora = bool(inputs.lora_rank)
    if lora:
        base = block_base_bytes(shape, inputs, c) * shape.layers + c * shape.root_params
        adapters = adapter_params(shape, inputs)
        state = math.ceil(base / f) + 12 * math.ceil(adapters / f)  # the base; the adapters' weights and moments
        whole = base + c * adapters
    else:
        state = 12 * math.ceil(shape.params / f)  # fp32 weights and AdamW's two moments
        whole = c * shape.params
    unit = max(c * shape.root_params, c * shape.block_params)
    out = {
        "training_state": state,
        "gathered_weights": whole if gathered else c * shape.root_params + 2 * unit,
        "kv_cache": requests * inputs.max_length * shape.layers * 2 * shape.kv_dim * c,
        "prefill": prefill_bytes(shape, requests, inputs.max_length, c),
        "logits": requests * shape.vocab * 4 * LOGIT_COPIES,
        "reference": math.ceil(stored_bytes(beside or shape, inputs, c, beside_bits) / f) if reference_model else 0,
    }
    if inputs.cuda:
        nccl = NCCL_BUFFER_BYTES if inputs.gpus > 1 else 0
        out["runtime"] = CUDA_CONTEXT_BYTES + nccl + int(FRAGMENTATION * sum(out.values()))
    return out


def stored_bytes(shape: Shape, inputs: Inputs, c: int, bits: int) -> float:
    """A frozen model's bytes as stored: in the compute dtype, or (4 bits) its blocks' linear weights in NF4."""
    blocks = block_base_bytes(shape, dataclasses.replace(inputs, base_bits=bits), c) * shape.layers
    return blocks + c * (shape.params - shape.layers * shape.block_params)


def prefill_bytes(shape: Shape, requests: int, length: int, c: int) -> int:
    """A block's transient tensors in the prefill of the prompts (no gradient: nothing is kept for backward), at
    --max_length tokens (a bound on the prompts'): the MLP's outputs of its width live at once (three for a gated MLP:
    the activation, the up projection's output and their product; two for OPT's) and about eight of the hidden size
    (the residual stream, the norm's output, queries, the keys and values repeated to every head, attention's output).
    Fitted to the simulated prefill (plan --simulate, --method grpo) of Qwen2.5-1.5B, Qwen3-1.7B, Llama-3.2-1B
    (3 x width + 9.1, 6.4 and 7.5 x hidden) and opt-1.3b (2 x width + 8.8 x hidden)."""
    width = shape.intermediate or 4 * shape.hidden
    return ((3 if shape.gated_mlp else 2) * width + 8 * shape.hidden) * requests * length * c


def host_seconds_per_step(blocks: int, adapters: int = 0, nf4: int = 0) -> float:
    """The host's time to run one decoding step of `blocks` blocks, with `adapters` layers running LoRA beside their
    weights and `nf4` weights dequantized."""
    return blocks * HOST_S_PER_BLOCK + adapters * HOST_S_PER_ADAPTER + nf4 * HOST_S_PER_NF4


def generation_time(
    shape: Shape,
    strategy: str,
    inputs: Inputs,
    requests: int,
    completion_length: int,
    rates: Rates | None = None,
    gathered: bool = True,
    graphs: bool = False,
) -> dict[str, float]:
    """Seconds of one rank's generation in a step: the prefill of its prompts, then the decoding steps (each a CUDA
    graph's replay with `graphs`, on the gathered model)."""
    rates = rates or Rates()
    c = 4 if inputs.precision == "fp32" else 2
    f = shard_factor(strategy, inputs)
    prompt = max(1, inputs.max_length - completion_length)
    weights = c * shape.params
    prefill = requests * prompt * 2.0 * shape.flop_params / (rates.tflops * 1e12)
    kv_per_token = shape.layers * 2 * shape.kv_dim * c
    nf4 = inputs.lora_rank > 0 and inputs.base_bits == 4
    merged = gathered and not nf4  # engine/generation.py merges a 16-bit base's adapters when gathered
    adapters = shape.layers * len(chosen(shape, inputs.lora_targets)) if inputs.lora_rank and not merged else 0
    host = host_seconds_per_step(shape.layers, adapters, shape.layers * len(shape.linears) if nf4 else 0)
    replayed = graphs and gathered
    decode = CAPTURE_S + 2 * host if replayed else 0.0  # the capture and its warm-up steps
    for t in range(completion_length):  # each step reads the weights and the cache so far, computes, or waits
        read = (weights + requests * (prompt + t) * kv_per_token) / (rates.hbm_gbps * 1e9)
        compute = requests * 2.0 * shape.flop_params / (rates.tflops * 1e12)
        if replayed:
            decode += max(read, compute) + shape.layers * GRAPH_S_PER_BLOCK + SAMPLER_S
        else:
            decode += max(read, compute, host)
    gather = 0.0
    if not gathered and f > 1:  # every decoding step (and the prefill) gathers the whole model over the link
        gather = (completion_length + 1) * (f - 1) / f * weights / (rates.link_gbps * 1e9)
    elif f > 1:  # gathered once
        gather = (f - 1) / f * weights / (rates.link_gbps * 1e9)
    seconds = prefill + decode + gather
    return {
        "prefill_s": prefill,
        "decode_s": decode,
        "gather_s": gather,
        "seconds": seconds,
        "tokens_per_second": requests * completion_length / seconds if seconds else 0.0,
    }


def graph_pool_bytes(shape: Shape, requests: int, c: int) -> int:
    """The CUDA graph's own memory (--decoding graphs): one decoding step's transient tensors, one token per
    completion (a block's, as the prefill counts them, and the step's logits in the compute dtype)."""
    return prefill_bytes(shape, requests, 1, c) + requests * shape.vocab * c


@dataclasses.dataclass(frozen=True)
class Phase:
    """A step that generates, as the plan and the run's prediction count it: the sequences of an optimizer step (all
    GPUs), the completions sampled per prompt and their length, the steps one generation feeds and how often it is
    trained on, and a model kept beside whose forward runs on the completions (GRPO's reference at --beta > 0,
    distillation's teacher; of shape `beside`, default the model's)."""

    samples: int
    generations: int
    completion_length: int
    steps_per_generation: int = 1
    iterations: int = 1
    forward_beside: bool = False
    beside: Shape | None = None

    @property
    def shared(self) -> int:
        """The steps one generation's cost is shared among."""
        return self.steps_per_generation * self.iterations

    def requests(self, inputs: Inputs) -> int:
        return requests_per_rank(self.samples * self.steps_per_generation, self.generations, inputs.gpus)


def forwards(shape: Shape, strategy: str, inputs: Inputs, phase: Phase, rates: Rates) -> tuple[float, float]:
    """A generation's forwards beside its sampling, in seconds: the model kept beside on its completions, and the
    policy's own that keeps the old log-probabilities (a generation trained on more than once)."""
    rows = phase.samples * phase.steps_per_generation
    beside_s = (
        forward_time(phase.beside or shape, strategy, inputs, rows, rates)["seconds"] if phase.forward_beside else 0.0
    )
    old_s = forward_time(shape, strategy, inputs, rows, rates)["seconds"] if phase.shared > 1 else 0.0
    return beside_s, old_s


def grpo_plan(
    shape: Shape,
    strategy: str,
    inputs: Inputs,
    phase: Phase,
    training_s: float | None,
    rates: Rates | None = None,
    decoding: str = "static",
    reference_model: bool = False,
    beside_name: str = "reference",
    beside_bits: int = 16,
) -> dict[str, Any]:
    """The generation phase (gathered once, and layer by layer beside it; decoded unreplayed and as CUDA graphs), the
    forward of the model kept beside (`reference_model`: a model of its own in memory, `beside_bits` its weights'
    bits) and the step (`training_s`, the training step's). A generation of several steps' prompts, trained more than
    once, costs each of its steps its share."""
    rates = rates or Rates()
    requests = phase.requests(inputs)
    graphs = decoding == "graphs"
    out: dict[str, Any] = {
        "requests_per_rank": requests,
        "generations": phase.generations,
        "completion_length": phase.completion_length,
        "strategy": strategy,
        "decoding": decoding,
        "steps_per_generation": phase.shared,
        "beside": beside_name,
        # NO_SHARD (or one GPU) keeps the whole model on every GPU: neither path gathers it, so their times agree
        "whole_on_each_gpu": None
        if shard_factor(strategy, inputs) > 1
        else "one GPU holds the whole model"
        if inputs.gpus == 1
        else f"under {strategy} every GPU holds the whole model",
    }
    c = 4 if inputs.precision == "fp32" else 2
    length = phase.completion_length
    for name, gathered in (("gathered", True), ("layer_by_layer", False)):
        memory = generation_memory(
            shape, strategy, inputs, requests, gathered, reference_model, phase.beside, beside_bits
        )
        if graphs and gathered:
            memory["graph_pool"] = graph_pool_bytes(shape, requests, c)
        peak = sum(memory.values())
        time = generation_time(shape, strategy, inputs, requests, length, rates, gathered, graphs)
        out[name] = {"components": memory, "peak_bytes": peak, "fits": peak <= inputs.gpu_memory, **time}
    eager = generation_time(shape, strategy, inputs, requests, length, rates, True, False)
    replayed = generation_time(shape, strategy, inputs, requests, length, rates, True, True)
    out["eager"], out["graphs"] = eager, replayed
    reference_s, old_s = forwards(shape, strategy, inputs, phase, rates)
    generation = out["gathered"] if out["gathered"]["fits"] else out["layer_by_layer"]
    training = training_s or 0.0  # None: the training step fits no layout
    per_step = lambda g: (g + reference_s + old_s) / phase.shared + training  # noqa: E731
    out.update(
        reference_s=reference_s / phase.shared,
        old_logps_s=old_s / phase.shared,
        training_s=training_s,
        uses="gathered" if out["gathered"]["fits"] else "layer_by_layer",
        step_s=per_step(generation["seconds"]),
    )
    out["layer_by_layer_step_s"] = per_step(out["layer_by_layer"]["seconds"])
    out["eager_step_s"], out["graphs_step_s"] = per_step(eager["seconds"]), per_step(replayed["seconds"])
    out["fits"] = training_s is not None and (out["gathered"]["fits"] or out["layer_by_layer"]["fits"])
    return out


def with_generation(
    prediction: dict[str, Any], shape: Shape, strategy: str, inputs: Inputs, phase: Phase, gathered: bool, graphs: bool
) -> dict[str, Any]:
    """A run's step-time prediction (the training step's, planner/layout.py) with its share of the generation phase,
    the forward of the model beside and the old log-probabilities' forward added, at the prediction's own rates: what
    a step's measured time (the mean over a generation's steps) is held against."""
    rates = Rates(
        tflops=prediction["tflops"],
        link_gbps=prediction["link_gbps"],
        hbm_gbps=prediction.get("hbm_gbps", Rates().hbm_gbps),
    )
    requests = phase.requests(inputs)
    generation = generation_time(shape, strategy, inputs, requests, phase.completion_length, rates, gathered, graphs)
    reference_s, old_s = forwards(shape, strategy, inputs, phase, rates)
    share = (generation["seconds"] + reference_s + old_s) / phase.shared
    return {
        **prediction,
        "training_s": prediction["step_s"],
        "generation_s": generation["seconds"] / phase.shared,
        "reference_s": reference_s / phase.shared,
        "old_logps_s": old_s / phase.shared,
        "step_s": prediction["step_s"] + share,
        "shared_steps": phase.shared,
    }


def grpo_lines(g: dict[str, Any], gpu_memory: int, method: str = "grpo") -> list[str]:
    """The plan's lines on a step that generates (GRPO's, distillation's)."""
    a, b = g["gathered"], g["layer_by_layer"]
    uses = (
        "the model gathered once" if g["uses"] == "gathered" else "the shards, layer by layer (gathered does not fit)"
    )
    shared, beside = g["steps_per_generation"], g.get("beside", "reference")
    pool = a["components"].get("graph_pool")
    lines = [
        f"{method} generation ({g['requests_per_rank']} completions of up to {g['completion_length']} tokens per GPU), "
        f"gathered once: {gib(a['peak_bytes'])} per GPU of {gib(gpu_memory)} ({'fits' if a['fits'] else 'does NOT fit'}: "
        f"KV cache {gib(a['components']['kv_cache'])}, model {gib(a['components']['gathered_weights'])}"
        + (f", {beside} {gib(a['components']['reference'])}" if a["components"]["reference"] else "")
        + (f", CUDA graph {gib(pool)}" if pool else "")
        + f"), {a['seconds']:.2f} s ({a['tokens_per_second']:,.0f} "
        "tokens/s per GPU)",
        f"{method} decoding (--decoding): unreplayed (static, generate) {g['eager']['decode_s']:.2f} s "
        f"({g['eager']['tokens_per_second']:,.0f} tokens/s per GPU, the host's launches); as CUDA graphs (graphs) "
        f"{g['graphs']['decode_s']:.2f} s ({g['graphs']['tokens_per_second']:,.0f} tokens/s, estimated: not measured "
        f"on a GPU yet); a step {g['eager_step_s']:.2f} s against {g['graphs_step_s']:.2f} s",
        f"{method} generation layer by layer: {gib(b['peak_bytes'])} per GPU ({'fits' if b['fits'] else 'does NOT fit'}), "
        f"{b['seconds']:.2f} s ({b['tokens_per_second']:,.0f} tokens/s per GPU)"
        + (
            f"; the same time as gathered once: {g['whole_on_each_gpu']}, so neither gathers it"
            if g.get("whole_on_each_gpu")
            else ""
        ),
        f"{method} step ({g['strategy']}, --decoding {g['decoding']}): generation on {uses}, {beside} "
        f"{g['reference_s']:.2f} s, "
        + (f"old log-probabilities {g['old_logps_s']:.2f} s, " if shared > 1 else "")
        + (f"each generation feeding {shared} steps, " if shared > 1 else "")
        + "training "
        + (
            f"{g['training_s']:.2f} s: {g['step_s']:.2f} s per step (layer by layer: {g['layer_by_layer_step_s']:.2f} s)"
            if g["training_s"] is not None
            else "does NOT fit"
        ),
    ]
    return lines


def gathered_fits(model_config, inputs: Inputs, generations: int, global_batch: int) -> bool:  # noqa: ANN001
    """Whether the model gathered whole and its KV cache fit the GPU beside the training state: the plan's generation
    memory at this run's sizes (`inputs`: its ranks, length, precision, LoRA and GPU memory, or --max_gpu_memory)
    against the GPU's memory."""
    requests = requests_per_rank(global_batch, generations, inputs.gpus)
    memory = generation_memory(Shape.of(model_config), "FULL_SHARD", inputs, requests, True)
    return sum(memory.values()) <= inputs.gpu_memory
