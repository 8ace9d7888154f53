"""Host RAM per rank through a session, phase by phase, and per machine against `--host_memory`.

Phases (the engine's order):
  start    a fresh run: rank 0 holds the model's full fp32 weights to broadcast them (from_pretrained)
  resume   on one machine every rank maps the checkpoint file and copies its own slices, one tensor at a time;
           across machines rank 0 reads it all and broadcasts it, one tensor at a time
  step     a training step (on CPU the device memory of plan.memory() lives in host RAM too)
  save     rank 0 gathers the full state (12 bytes per parameter with AdamW, 4 without) and writes it, with
           --async_save while the next steps run; every rank holds one bucket of the gather at a time. A sharded
           save writes each rank's own shard instead.

Between phases the engine hands freed memory back (hostmem.configure_allocator and release_host_memory), so
the phases do not stack. The figures were checked against measured per-phase peaks (VmHWM) at opt-125m's and
opt-350m's shapes on CPU; the CUDA process overhead is a published estimate until a GPU run measures it.
"""

from __future__ import annotations

import math
from typing import Any

from fsdp_opt.base import GIB, gib
from fsdp_opt.checkpoint.state import BUCKET_BYTES
from fsdp_opt.model.shapes import Shape
from fsdp_opt.planner.inputs import Inputs, shard_factor
from fsdp_opt.planner.lora import adapter_params
from fsdp_opt.planner.memory import memory, peak_bytes

# A worker on CPU before setup: Python, torch 2.13, transformers 5.23 and the process group. It varies with the
# machine's libraries (0.40 GiB here, on two machines within 20 MB of each other).
IMPORTS_BYTES = int(0.40 * GIB)
# The same worker once setup is done, beside what the phases below count (the dataset, the tokenizer, the model's
# code, the allocator's heap): measured per phase on two machines, 0.48-0.51 GiB on rank 0.
PROCESS_BYTES = int(0.49 * GIB)
# The other ranks read no dataset (rank 0 reads the rows and hands them on): 48 MiB less each (the built-in
# python-docs: datasets' import and its table), 0.43-0.47 GiB measured.
OTHER_PROCESS_BYTES = PROCESS_BYTES - 48 * 2**20

# Added by the first CUDA use (kernel images, the driver's host side): about 1.2 GB, pytorch/pytorch#106511.
CUDA_PROCESS_BYTES = int(1.2 * GIB)


def host_memory(
    shape: Shape,
    strategy: str,
    inputs: Inputs,
    *,
    save_optimizer: bool = True,
    sharded: bool = False,
    offload: bool = False,
    async_save: bool | None = None,
) -> dict[str, Any]:
    """Peak host bytes of rank 0 and of every other rank in each phase, and the machine's peak.

    `offload` (--cpu_offload) keeps the sharded fp32 parameters, gradients and AdamW state in host RAM on a GPU run.
    `async_save` (--async_save; None: the engine's auto, on with CUDA): a full checkpoint is written while the next
    steps run, so on rank 0 the gathered state is held alongside a step's host memory.
    """
    n = shape.params
    per = math.ceil(n / shard_factor(strategy, inputs))
    base = PROCESS_BYTES + (CUDA_PROCESS_BYTES if inputs.cuda else 0)
    base_other = base - PROCESS_BYTES + OTHER_PROCESS_BYTES
    # Where the sharded state lives in host RAM (CPU runs, or --cpu_offload): fp32 weights; between steps
    # also AdamW's moments (gradients are freed after each step); and at an optimizer step the gradients and
    # one foreach temporary besides, 20 bytes per local parameter. A resume creates AdamW's state directly
    # (optim.create_state), without such a step.
    held = not inputs.cuda or offload
    params_held = 4 * per if held else 0
    between_steps = 12 * per if held else 0
    optimizer_step = 20 * per if held else 0
    step = optimizer_step if inputs.cuda else max(optimizer_step, peak_bytes(memory(shape, strategy, inputs)))
    lora = bool(getattr(inputs, "lora_rank", 0))
    if lora:
        saved = adapter_params(shape, inputs)
        per = math.ceil(saved / shard_factor(strategy, inputs))  # the trainable state: the adapters'
    full = (12 if save_optimizer else 4) * (saved if lora else n)
    # One full tensor received at a time (a fresh start's weights, a resume across machines): host memory on CPU; on
    # a GPU it is device memory.
    largest = 0 if inputs.cuda else 4 * shape.largest_param
    # Each rank's part of a sharded checkpoint.
    own = math.ceil(full / max(1, inputs.gpus))
    # A full one is gathered bucket by bucket (checkpoint.state.gather_to_rank0), the model's state, then AdamW's
    # (twice the model's): each rank holds its piece of a bucket (BUCKET_BYTES at most, or one tensor's piece when that
    # is larger) and the bucket gathered from every rank of its shard group. On CPU that is host memory on every rank,
    # and gloo stages the gathered bucket once more; on a GPU it is device memory, and rank 0 copies each gathered
    # bucket to the host.
    group = shard_factor(strategy, inputs)
    biggest = (8 if save_optimizer else 4) * (saved if lora else n)
    one_tensor = 0 if lora else math.ceil(4 * shape.largest_param / group)
    piece = max(min(BUCKET_BYTES, math.ceil(biggest / group)), one_tensor)
    gather0, gather_other = (group * piece, 0) if inputs.cuda else ((2 * group + 1) * piece,) * 2
    background = (inputs.cuda if async_save is None else async_save) and not sharded
    saving = between_steps + (own if sharded else full + gather0)
    # Resuming a full checkpoint on one machine: every rank maps the file and copies only its slices of it, each
    # tensor's pages leaving RSS once copied (hostmem.drop_pages): one slice of the largest tensor is resident at a
    # time. Across machines (no shared filesystem assumed) rank 0 reads it all and the others receive one tensor
    # at a time.
    if sharded:
        read0 = read_other = own
    elif inputs.nodes == 1:
        read0 = read_other = math.ceil(4 * shape.largest_param / shard_factor(strategy, inputs))
    else:
        read0, read_other = full, largest
    # Rank 0 reads the whole model to broadcast it: fp32 for full fine-tuning; a LoRA base in the compute dtype (fp16
    # weights are quantized to NF4 after they are read), and again at a resume, whose checkpoint has no base.
    c = 4 if inputs.precision == "fp32" else 2
    start = c * n if lora else 4 * n
    if lora:
        read0 = max(read0, start)
    rank0 = {
        "start": base + params_held + start,
        "resume": base + between_steps + read0,
        "step": base + step,
        "save": base + (max(saving, step + full) if background else saving),
    }
    other = {
        "start": base_other + params_held + largest,  # receives each full tensor in turn
        "resume": base_other + between_steps + read_other,
        "step": base_other + step,
        "save": base_other + between_steps + (own if sharded else gather_other),
    }
    local = max(1, inputs.gpus // max(1, inputs.nodes))
    machine = {phase: rank0[phase] + (local - 1) * other[phase] for phase in rank0}
    fresh = ("start", "step", "save")
    resumed = ("resume", "step", "save")
    return {
        "rank0": rank0,
        "other": other,
        "machine": machine,
        "ranks_per_machine": local,
        "peak_fresh": {
            "rank0": max(rank0[p] for p in fresh),
            "other": max(other[p] for p in fresh),
            "machine": max(machine[p] for p in fresh),
        },
        "peak_resumed": {
            "rank0": max(rank0[p] for p in resumed),
            "other": max(other[p] for p in resumed),
            "machine": max(machine[p] for p in resumed),
        },
    }


def render_host(host: dict[str, Any], host_memory_bytes: int, source: str = "--host_memory") -> list[str]:
    """The host-RAM table of the plan's text output."""
    labels = {
        "start": "start (rank 0 holds the model to broadcast)",
        "resume": "resume (read the checkpoint)",
        "step": "training step",
        "save": "save (rank 0 gathers the full state)",
    }
    local = host["ranks_per_machine"]
    lines = [
        f"host RAM (per rank, and for the {local} rank(s) of one machine):",
        "",
        "| phase | rank 0 | each other rank | machine |",
        "| --- | --- | --- | --- |",
    ]
    for phase, label in labels.items():
        lines.append(
            f"| {label} | {gib(host['rank0'][phase])} | {gib(host['other'][phase])} | {gib(host['machine'][phase])} |"
        )
    worst = max(host["peak_fresh"]["machine"], host["peak_resumed"]["machine"])
    verdict = (
        "fits"
        if worst <= host_memory_bytes
        else "DOES NOT FIT (try --state_dict_type sharded or --save_optimizer false)"
    )
    lines += [
        "",
        f"machine peak: {gib(host['peak_fresh']['machine'])} fresh, {gib(host['peak_resumed']['machine'])} resumed, "
        f"of {gib(host_memory_bytes)} ({source}): {verdict}",
    ]
    return lines
