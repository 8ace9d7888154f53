"""On-policy distillation (--method distill): a step's prepare phase samples one completion of each of its prompts from
the model (the same sampling as GRPO's: engine/rollout.py `decode`, each completion's draws keyed by the seed, the
step, its row), then each micro-batch of completions runs the model and the teacher, and every completion token's
next-token distributions are compared. TRL 1.16's DistillationTrainer loss:

- the distributions are the softmax of each model's logits divided by --temperature, fp32;
- per completion token, the generalized Jensen-Shannon divergence of --beta: with the mixture m = (1 - beta) p_model +
  beta p_teacher, beta KL(p_teacher || m) + (1 - beta) KL(p_model || m); at beta 0 the forward KL(p_teacher ||
  p_model), at beta 1 the reverse KL(p_model || p_teacher) (those two limits in closed form: the mixture's would be 0);
- the tokens are a completion's own, up to and including its end; the loss is their sum over the step (all ranks, all
  micro-batches) divided by their count. The gradient reaches the model only: the teacher runs without it.

Every rank runs as many micro-batches (fillers where it has fewer completions) and the teacher's forward in each, so
the teacher's sharded collectives line up.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_opt.data.blocks import IGNORE_INDEX, GenerationSlot, StepBatch, model_inputs
from fsdp_opt.engine.decoding import Decoder
from fsdp_opt.engine.generation import Sampling, completion_keys
from fsdp_opt.engine.groups import reduce_max, reduce_sum
from fsdp_opt.engine.logprobs import first_prompts_loss
from fsdp_opt.engine.loss import next_token_targets
from fsdp_opt.engine.microbatches import run_micro_batches
from fsdp_opt.engine.rollout import completion_text, decode, micro_batches, pack_members


def divergence(
    student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] generalized JSD of `beta` between the model's and the teacher's next-token distributions, from their [n,
    vocabulary] logits, and [n] the model's entropy (no gradient); fp32."""
    s = F.log_softmax(student.float() / temperature, dim=-1)
    t = F.log_softmax(teacher.float() / temperature, dim=-1)
    if beta == 0.0:
        d = (t.exp() * (t - s)).sum(-1)
    elif beta == 1.0:
        d = (s.exp() * (s - t)).sum(-1)
    else:
        m = torch.logaddexp(s + math.log(1 - beta), t + math.log(beta))
        d = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
    with torch.no_grad():
        entropy = -(s.exp() * s).sum(-1)
    return d, entropy


@dataclass
class DistillSettings:
    """What a distillation step needs of the flags, decided once (`decode` reads gather, eos_ids, stop)."""

    sampling: Sampling
    beta: float
    seed: int
    eos_ids: list[int]
    stop: str | None
    gather: bool = True
    generation_batch: int = 0
    decoding: str = "static"


@dataclass
class Completions:
    """One step's completions on this rank: the sequences (prompt + completion), their targets (the completion's
    tokens), this rank's micro-batches, the totals over the ranks, the records for completions.jsonl."""

    sequences: list[list[int]]
    targets: list[list[bool]]
    micro: list[list[int]]
    totals: dict[str, float]
    records: list[dict[str, Any]]


def sample_completions(
    model: nn.Module,
    env,  # noqa: ANN001
    cfg: DistillSettings,
    prompts,  # noqa: ANN001 - data/prompts.py Prompts
    mine: list[int],
    tokenizer,  # noqa: ANN001
    decoder: Decoder | None,
    at_step: int,
    batch_size: int,
    sampling: Sampling | None = None,
) -> Completions:
    """One completion of each of this rank's prompts `mine`, drawn with its key (seed, step, row), laid into
    micro-batches; every rank calls it."""
    started = time.perf_counter()
    rows = [int(prompts.index[p]) for p in mine]
    keys = completion_keys(cfg.seed, at_step, rows, [0] * len(rows))
    made = decode(
        model,
        cfg,
        [prompts.ids[p] for p in mine],
        keys,
        sampling or cfg.sampling,
        prompts.pad_id,
        env,
        tokenizer,
        decoder,
        cfg.generation_batch,
    )
    seconds = time.perf_counter() - started
    sequences = [list(prompts.ids[p]) + list(ids) for p, ids in zip(mine, made.ids)]
    targets = [[False] * len(prompts.ids[p]) + [True] * len(ids) for p, ids in zip(mine, made.ids)]
    micro = micro_batches(sequences, batch_size, prompts, env)
    local = torch.tensor(
        [len(mine), float(sum(len(i) for i in made.ids)), float(sum(len(q) for q in sequences))],
        dtype=torch.float64,
    )
    summed = reduce_sum(local, env)
    longest = reduce_max(torch.tensor([float(max((len(i) for i in made.ids), default=0)), seconds]), env)
    truncated = reduce_sum(torch.tensor([float(sum(not e for e in made.ended))], dtype=torch.float64), env)
    totals = {
        "completions": float(summed[0]),
        "tokens": float(summed[1]),
        "seen": float(summed[2]),
        "length_max": float(longest[0]),
        "seconds": float(longest[1]),
        "truncated": float(truncated[0]),
    }
    records = [
        {
            "step": at_step + 1,
            "row": r,
            "prompt": tokenizer.decode(prompts.ids[p], skip_special_tokens=False),
            "completion": completion_text(tokenizer, ids, ended, cfg.stop),
            "completion_ids": list(ids),
            "ended": bool(ended),
        }
        for p, r, ids, ended in zip(mine, rows, made.ids, made.ended)
    ]
    return Completions(sequences, targets, micro, totals, records)


def micro_divergence(
    model: nn.Module,
    teacher: nn.Module,
    c: Completions,
    members: list[int],
    prompts,  # noqa: ANN001
    cfg: DistillSettings,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One micro-batch's summed divergence over its completion tokens (with the model's gradient), their summed
    entropy, and the model's logits (kept alive through the backward). The teacher runs on every rank's micro-batch,
    fillers too."""
    batch, _ = pack_members(c, members, prompts, device)
    inputs = model_inputs(batch)
    logits = model(**inputs).logits
    with torch.no_grad():
        taught = teacher(**inputs).logits
    on = (next_token_targets(batch["labels"]) != IGNORE_INDEX).reshape(-1)
    if not members:  # a filler: the same backward (and collectives) as every rank's, of nothing
        return logits.sum() * 0.0, logits.new_zeros((), dtype=torch.float32), logits
    rows = on.nonzero().squeeze(1)
    flat = logits.reshape(-1, logits.shape[-1]).index_select(0, rows)
    d, entropy = divergence(
        flat, taught.reshape(-1, taught.shape[-1]).index_select(0, rows), cfg.beta, cfg.sampling.temperature
    )
    return d.sum(), entropy.sum(), logits


class DistillLoss:
    """--method distill's step (engine/step.py StepLoss). `prompts`: the slice's Prompts; `teacher`: the teacher model
    (sharded, frozen)."""

    names = ("loss", "entropy")

    def __init__(self, settings: DistillSettings, prompts, tokenizer, teacher: nn.Module) -> None:  # noqa: ANN001
        self.s, self.prompts, self.tokenizer, self.teacher = settings, prompts, tokenizer, teacher
        self.decoder = Decoder(graphs=settings.decoding == "graphs") if settings.decoding != "generate" else None
        self.current: Completions | None = None
        self.slot: GenerationSlot | None = None

    def prepare(self, s, step: StepBatch) -> None:  # noqa: ANN001
        """The step's completions, sampled from the model as it is now."""
        self.slot = step.generation
        mine = [int(p) for p in step.generation.prompts[step.generation.slice]]
        self.current = sample_completions(
            s.model,
            s.env,
            self.s,
            self.prompts,
            mine,
            self.tokenizer,
            self.decoder,
            s.state.global_step,
            s.plan.batch_size,
        )

    @property
    def pending(self) -> bool:
        return False  # a step's completions are its own: no checkpoint falls inside them

    def accumulate(self, s, step: StepBatch, scale: float) -> torch.Tensor:  # noqa: ANN001
        c = self.current
        weight = scale / max(1.0, c.totals["tokens"])
        sums = torch.zeros(len(self.names), device=s.env.device, dtype=torch.float32)

        def loss_of(i: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
            total, entropy, logits = micro_divergence(
                s.model, self.teacher, c, c.micro[i], self.prompts, self.s, s.env.device
            )
            added = torch.stack([total.detach() / max(1.0, c.totals["tokens"]), entropy])
            return total * weight, added, logits

        run_micro_batches(s.model, len(c.micro), loss_of, sync_each=s.reduce_each_microbatch, sums=sums)
        return sums

    def first_loss(self, s, first: StepBatch | None) -> torch.Tensor:  # noqa: ANN001
        """The next-token loss of this rank's first prompts (the fp16 probe)."""
        return first_prompts_loss(s, self.prompts, first)

    def record(self, sums: dict[str, float], step: StepBatch, seconds: float) -> dict[str, Any]:
        t = self.current.totals
        completions = max(1.0, t["completions"])
        out: dict[str, Any] = {
            "tokens": int(t["tokens"]),
            "tokens_seen": int(t["seen"]),
            "completions": int(t["completions"]),
            "completion_length": t["tokens"] / completions,
            "completion_length_max": int(t["length_max"]),
            "truncated": t["truncated"] / completions,
            "entropy": sums["entropy"] / max(1.0, t["tokens"]),
            "generation_share": min(1.0, t["seconds"] / seconds) if seconds > 0 else 0.0,
            "generated_tokens_per_second": t["tokens"] / max(1e-9, t["seconds"]),
        }
        return out


@torch.no_grad()
def held_out_divergence(
    model: nn.Module,
    teacher: nn.Module,
    prompts,
    tokenizer,
    cfg: DistillSettings,
    env,
    batch_size: int,  # noqa: ANN001
    decoder: Decoder | None = None,
) -> dict[str, Any]:
    """One greedy completion of each held-out prompt (this rank's share: every world_size-th), and the mean divergence
    per completion token from the teacher over them all, in eval mode."""
    mine = list(range(env.rank, len(prompts), env.world_size))
    greedy = Sampling(cfg.sampling.max_new_tokens, top_k=1)
    was = model.training
    model.eval()
    try:
        c = sample_completions(model, env, cfg, prompts, mine, tokenizer, decoder, 0, batch_size, greedy)
        local = torch.zeros(2, dtype=torch.float64)
        for members in c.micro:
            total, entropy, _ = micro_divergence(model, teacher, c, members, prompts, cfg, env.device)
            local += torch.stack([total.double().cpu(), entropy.double().cpu()])
    finally:
        model.train(was)
    summed = reduce_sum(local, env)
    tokens = max(1.0, c.totals["tokens"])
    return {
        "divergence": float(summed[0]) / tokens,
        "entropy": float(summed[1]) / tokens,
        "prompts": len(prompts),
        "tokens": int(c.totals["tokens"]),
    }
