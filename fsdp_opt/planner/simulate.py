"""The plan's memory figures checked by running the engine's own training step at the real shape, on fake tensors.

    python -m fsdp_opt.plan --model facebook/opt-1.3b --simulate

One process stands in for rank 0 of `--gpus` ranks: a fake process group (no communication) and torch's
FakeTensorMode (tensors with shapes and no storage), so opt-1.3b's step runs on a laptop CPU without its memory.
The model is sharded by the engine's own `shard_model` (wrap policy, mixed precision, activation checkpointing,
FULL_SHARD or SHARD_GRAD_OP), the loss is the engine's (the output layer run by the loss, `--loss_chunk_tokens` target
tokens at a time, with every position a target; whole logits for a model whose logits are not a plain projection),
and the micro-batches of one optimizer step run with or without gradient sync between them, as `--reduce_every_microbatch`
says. torch's FSDP2 memory tracker (`FSDPMemTracker`) labels every tensor the step creates; this module keeps the
largest value each label reaches and the labels at the moment of the total peak.

What the tracker is not given:
- AdamW's state. On fake tensors the tracker counts the optimizer's state several times over (its per-tensor
  records are right, two moments per parameter, but its total for opt-125m's shape is 10 shard sizes where the
  same step on real tensors counts 2.0). The state is created directly (`optim.create_state`), as a resume does,
  and its exact bytes are added; the fused AdamW step itself allocates nothing beyond it (real tensors, same check).
- The device: tensors are fake CPU tensors, because FSDP2 needs CUDA streams for CUDA tensors. Byte counts are
  the same; the CUDA context, the allocator's rounding and its cache are not seen (the plan's `runtime` row).
- Attention kernels: CPU's SDPA kernel stands in for the GPU's. Its saved tensors (output and log-sum-exp) are
  the same sizes as those of the memory-efficient kernel a T4 runs.
"""

from __future__ import annotations

import random
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_opt.config.choices import shard_count
from fsdp_opt.config.layout import LoraConfig
from fsdp_opt.data.packing import document_mask, segment_positions
from fsdp_opt.data.pairs import Pairs
from fsdp_opt.data.sequences import Packing
from fsdp_opt.engine.dpo import dpo_terms
from fsdp_opt.engine.generation import gathered
from fsdp_opt.engine.logprobs import micro_logps
from fsdp_opt.engine.loss import HeadLoss, forward_loss_sum
from fsdp_opt.engine.microbatches import run_micro_batches
from fsdp_opt.engine.optim import build_optimizer, create_state
from fsdp_opt.model.adapters import Adapters
from fsdp_opt.model.loader import meta_model
from fsdp_opt.model.parallelize import DTYPES, shard_model
from fsdp_opt.model.shapes import model_config
from fsdp_opt.runtime.distributed import DistEnv

# Groups compared with the plan: simulated labels on the left, the plan's components on the right.
GROUPS = {
    "parameters": (("Sharded Param",), ("parameters",)),
    "gradients": (("Sharded Grad",), ("gradients",)),
    "optimizer": ((), ("optimizer",)),
    "gathered_weights": (("Unsharded Param", "All Gather"), ("gathered_weights",)),
    # Measured between micro-batches (the tracker labels these "Temp"): FSDP's unsharded fp32 gradients held for the
    # next micro-batch when accumulating without sync.
    "accumulated_gradients": ((), ("accumulated_gradients",)),
    "reduce_scatter": (("Unsharded Grad", "Reduce Scatter"), ("reduce_scatter",)),
    # Less the accumulated gradients, which sit in the tracker's "Temp".
    "activations_and_logits": (("Activation", "Temp", "Inputs", "Buffer"), ("activations", "logits", "attention_mask")),
}


def micro_batch(vocab_size: int, inputs, device: torch.device) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """One micro-batch of model inputs in the form the engine feeds for `inputs.packing`.

    docs: two documents per row (positions restart halfway), with the engine's own block-diagonal mask.
    pad: the last row a quarter padding, as the [b, 1, L, L] boolean mask transformers makes of a padding mask for
    SDPA (built here: transformers inspects the padding's values, which fake tensors do not have).
    concat: whole rows, no mask."""

    b, s = inputs.batch_size, inputs.max_length
    batch = {"input_ids": torch.randint(0, vocab_size, (b, s), device=device)}
    if inputs.packing == "docs":
        positions = segment_positions([0, s // 2], s).long().repeat(b, 1).to(device)
        batch.update(position_ids=positions, attention_mask=document_mask(positions, inputs.attn_implementation))
    elif inputs.packing == "pad":
        keys = torch.ones(b, s, dtype=torch.bool, device=device)
        keys[-1, s - s // 4 :] = False
        causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
        mask = keys[:, None, None, :] & causal
        if inputs.attn_implementation == "eager":  # additive, in the compute dtype
            dtype = DTYPES[inputs.precision]
            mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)
        # the positions OPT would count from a right-padded [b, L] mask: 0.. along every row
        batch.update(attention_mask=mask, position_ids=torch.arange(s, device=device).repeat(b, 1))
    return batch


def accumulated_gradient_bytes(model) -> int:  # noqa: ANN001
    """Bytes of the unsharded gradients FSDP2 keeps between micro-batches that skip the reduce-scatter."""
    from torch.distributed.fsdp import FSDPModule

    total = 0
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for fp in group.fsdp_params if group is not None else ():
            grad = fp.unsharded_accumulated_grad
            if (
                grad is None and getattr(fp, "_unsharded_param", None) is not None
            ):  # same dtype: accumulated in the parameter's .grad
                grad = getattr(fp._unsharded_param, "grad", None)
            total += 0 if grad is None else grad.numel() * grad.element_size()
    return total


def _label(key: Any) -> str:
    return str(getattr(key, "value", key))


def _tracker_class():
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY as _TOTAL

    class PeakTracker(FSDPMemTracker):
        """FSDPMemTracker that also keeps each group's own largest value over the step."""

        group_peaks: dict[str, int]
        group_moments: dict[str, dict[str, int]]  # every label at the moment each group peaked

        def _update_peak_stats(self, peak_state) -> None:  # noqa: ANN001
            # The device's peak and each group's. Not the per-module peaks FSDPMemTracker keeps besides (a walk over
            # every tracked module on every operator, most of a simulation's time): nothing here reads them.
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL]:
                    self._peak_mem[dev] = snap[_TOTAL]
                    self._peak_mem_snap[dev] = dict(snap)
                by_label = {_label(k): v for k, v in snap.items()}
                for group, (labels, _) in GROUPS.items():
                    value = sum(by_label.get(label, 0) for label in labels)
                    if value > self.group_peaks.get(group, 0):
                        self.group_peaks[group] = value
                        self.group_moments[group] = {k: v for k, v in by_label.items() if k != "Total"}

    return PeakTracker


def _rank0(inputs) -> DistEnv:  # noqa: ANN001
    """Rank 0 of `--gpus` ranks: a fake process group (no communication) unless one exists already."""
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=inputs.gpus)
    world = dist.get_world_size()
    return DistEnv(
        rank=dist.get_rank(),
        world_size=world,
        local_rank=0,
        local_world_size=max(1, world // inputs.nodes),
        device=torch.device("cpu"),
    )


def _meta_model(model_name: str, inputs):  # noqa: ANN001, ANN202
    """The model's config (with --attn_implementation) and the model built on the meta device."""
    config = model_config(model_name)
    if inputs.attn_implementation:
        config._attn_implementation = inputs.attn_implementation
    return config, meta_model(config)


def _optimizer_bytes(optimizer) -> int:  # noqa: ANN001
    """AdamW's state of this rank (its shards), in bytes."""
    return sum(
        t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if t.dim() > 0
    )


def simulate(model_name: str, inputs, strategy: str, *, fake: bool = True, micro_batches: int = 2) -> dict[str, Any]:
    """Peak bytes of rank 0 in one optimizer step, by group and at the total's peak. Needs a process of its own:
    it starts a process group (fake unless one exists already: `fake=False` runs on real tensors in a real one).

    `micro_batches` of the step are run (2 shows what accumulation holds between micro-batches; more repeat it).
    """
    env = _rank0(inputs)
    world = env.world_size
    config, model = _meta_model(model_name, inputs)
    if inputs.lora_rank:  # the adapters on a frozen base in the compute dtype, as the trainer adds them (16-bit base)
        settings = LoraConfig(
            lora_rank=inputs.lora_rank, lora_targets=inputs.lora_targets, lora_dropout=inputs.lora_dropout
        )
        Adapters(settings, model_name, DTYPES[inputs.precision], 0).add_to(
            model, shard_count(strategy, world, max(1, world // inputs.nodes))
        )
    shard_model(
        model,
        env,
        strategy=strategy,
        precision=inputs.precision,
        activation_checkpointing=inputs.activation_checkpointing,
        prefetch=inputs.prefetch,
    )
    micro = min(micro_batches, inputs.accum_steps)
    pairs = DpoMicroBatch(config.vocab_size, inputs, env.device) if inputs.method.spec.sequences_per_row == 2 else None
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext()
    with mode:
        model.to_empty(device=env.device)
        if not fake:
            torch.manual_seed(0)
            for p in model.parameters():
                p.data.normal_(0, 0.02)
        model.train()
        optimizer = build_optimizer(model, 1e-4, 0.0, env.device)
        create_state(optimizer)
        optimizer_bytes = _optimizer_bytes(optimizer)
        # the engine's loss, every position a target (the plan's worst case; fake tensors hold no labels to select by)
        head = HeadLoss.for_run(model, inputs.loss_chunk_tokens, select=False)
        tracker = _tracker_class()(model)
        tracker.group_peaks, tracker.group_moments = {}, {}
        accumulated = [0]

        def loss_of(i: int) -> tuple[torch.Tensor, None, tuple]:
            tracker.reset_mod_stats()  # the tracker follows one forward per module between resets
            if pairs is not None:  # the engine's pair loss, from the engine's packed pairs
                loss, out = pairs.loss(model, head)
                return loss, None, (out,)
            batch = micro_batch(config.vocab_size, inputs, env.device)
            # the engine's forward and loss (every token a target: its own next token's label)
            out, loss = forward_loss_sum(model, head, {**batch, "labels": batch["input_ids"]})
            # with the micro-batch and its output alive through backward, as in the engine's step
            return loss, None, (out, batch)

        def after(i: int) -> None:
            if i < micro - 1:
                accumulated[0] = max(accumulated[0], accumulated_gradient_bytes(model))

        with tracker:
            # the engine's own loop over micro-batches: its gradient sync, its backward
            run_micro_batches(model, micro, loss_of, sync_each=inputs.reduce_every_microbatch, after=after)
        accumulated = accumulated[0]
        peak = {_label(k): v for k, v in next(iter(tracker.get_tracker_snapshot("peak").values())).items()}
    groups = dict(tracker.group_peaks)
    groups["optimizer"] = optimizer_bytes
    groups["accumulated_gradients"] = accumulated
    groups["activations_and_logits"] = groups.get("activations_and_logits", 0) - accumulated
    for group in GROUPS:
        groups.setdefault(group, 0)
    peak_total = peak.pop("Total") + optimizer_bytes
    return {
        "groups": groups,
        "at_peak": peak,
        "group_moments": tracker.group_moments,
        "peak_total": peak_total,
        "micro_batches": micro,
        "world_size": world,
        "fake": fake,
    }


class DpoMicroBatch:
    """One micro-batch of preference pairs, made by the engine's own Pairs (data/pairs.py) and built once, on real
    tensors (its mask is built from the documents' positions, which fake tensors do not hold): --batch_size pairs
    whose sequences fill it as the engine packs them (docs: each block one pair, chosen and rejected of half a block
    each; pad: a row per sequence). The second half of each sequence is its answer."""

    per_unit = Pairs.per_unit

    def __init__(self, vocab_size: int, inputs, device: torch.device) -> None:  # noqa: ANN001
        n = inputs.max_length // 2 if inputs.packing == "docs" else inputs.max_length
        draw = random.Random(0)
        ids = [[draw.randrange(vocab_size) for _ in range(n)] for _ in range(2 * inputs.batch_size)]
        targets = [[k >= n // 2 for k in range(n)] for _ in ids]
        laid = Packing(0, inputs.max_length, inputs.packing, inputs.attn_implementation or "sdpa")
        self.pairs = Pairs(ids, targets, list(range(inputs.batch_size)), laid)
        self.members = list(range(inputs.batch_size))
        self.built = self.pairs.micro(self.members, device)

    def micro(self, members: list[int], device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Pairs.micro's answer, as built."""
        return self.built

    def logps(self, model, head: HeadLoss | None) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        """The engine's summed answer log-probabilities of the pairs, and the forward's output (engine/dpo.py
        micro_logps)."""
        return micro_logps(model, self, self.members, self.built[1].device, head)  # type: ignore[arg-type]

    def loss(self, model, head: HeadLoss | None) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        """The step's pair loss as accumulate_pairs computes it (dpo_terms), against a reference of zeros (its
        log-probabilities are numbers read from the checkpoint, not tensors of the step), and the forward's output,
        which the step holds through backward."""
        pi, out = self.logps(model, head)
        return dpo_terms(pi, torch.zeros_like(pi), 0.1)[0].sum(), out


def simulate_reference(model_name: str, inputs, strategy: str) -> dict[str, Any]:  # noqa: ANN001
    """Peak bytes of rank 0 in the DPO reference pass: the model frozen in the compute dtype, one micro-batch forward
    without gradients (one process of its own, as simulate)."""
    env = _rank0(inputs)
    world = env.world_size
    config, model = _meta_model(model_name, inputs)
    dtype = DTYPES[inputs.precision]
    for p in model.parameters():
        p.requires_grad_(False)
        p.data = p.data.to(dtype)
    shard_model(
        model,
        env,
        strategy=strategy,
        precision=inputs.precision,
        activation_checkpointing=False,
        prefetch=inputs.prefetch,
    )
    pairs = DpoMicroBatch(config.vocab_size, inputs, env.device)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device=env.device)
        model.eval()
        tracker = _tracker_class()(model)
        tracker.group_peaks, tracker.group_moments = {}, {}
        with (
            tracker,
            torch.no_grad(),
        ):  # the reference pass's forward (engine/logprobs.py scored_logps), every position a target
            pairs.logps(model, HeadLoss.for_run(model, 0, select=False))
        peak = {_label(k): v for k, v in next(iter(tracker.get_tracker_snapshot("peak").values())).items()}
    return {"peak_total": peak.pop("Total"), "at_peak": peak, "world_size": world}


def simulate_generation(model_name: str, inputs, strategy: str, requests: int) -> dict[str, Any]:  # noqa: ANN001
    """Peak bytes of rank 0 in GRPO's generation phase: the training state (sharded weights, AdamW's moments), the
    model gathered once (engine/generation.py `gathered`), and a prefill of `requests` sequences of --max_length
    tokens that fills the KV cache, its logits of the last position only (one process of its own, as simulate)."""
    env = _rank0(inputs)
    world = env.world_size
    config, model = _meta_model(model_name, inputs)
    if inputs.lora_rank:
        settings = LoraConfig(lora_rank=inputs.lora_rank, lora_targets=inputs.lora_targets, lora_dropout=0.0)
        Adapters(settings, model_name, DTYPES[inputs.precision], 0).add_to(
            model, shard_count(strategy, world, max(1, world // inputs.nodes))
        )
    shard_model(model, env, strategy=strategy, precision=inputs.precision, activation_checkpointing=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device=env.device)
        optimizer = build_optimizer(model, 1e-4, 0.0, env.device)
        create_state(optimizer)
        optimizer_bytes = _optimizer_bytes(optimizer)
        tracker = _tracker_class()(model)
        tracker.group_peaks, tracker.group_moments = {}, {}
        ids = torch.randint(0, config.vocab_size, (requests, inputs.max_length))
        with tracker, torch.no_grad(), gathered(model):
            model(input_ids=ids, use_cache=True, logits_to_keep=1)
        peak = {_label(k): v for k, v in next(iter(tracker.get_tracker_snapshot("peak").values())).items()}
    return {
        "peak_total": peak.pop("Total") + optimizer_bytes,
        "at_peak": peak,
        "world_size": world,
        "requests": requests,
    }
