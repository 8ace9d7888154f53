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

from fsdp_opt.data.blocks import GenerationSlot, StepBatch
from fsdp_opt.engine.decoding import Decoder
from fsdp_opt.engine.generation import Decoding, Sampling, completion_keys
from fsdp_opt.engine.groups import reduce_max, reduce_sum
from fsdp_opt.engine.logprobs import first_prompts_loss
from fsdp_opt.engine.loss import HeadLoss, target_logits
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


@dataclass(kw_only=True)
class DistillSettings(Decoding):
    """What a distillation step needs of the flags, decided once: its decoding, and the divergence's beta."""

    beta: float


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
    local = [len(mine), sum(len(i) for i in made.ids), sum(len(q) for q in sequences), sum(not e for e in made.ended)]
    summed = reduce_sum(torch.tensor(local, dtype=torch.float64), env).tolist()
    longest = reduce_max(torch.tensor([float(max((len(i) for i in made.ids), default=0)), seconds]), env).tolist()
    totals = dict(zip(("completions", "tokens", "seen", "truncated"), summed))
    totals.update(length_max=longest[0], seconds=longest[1])
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


@dataclass
class Models:
    """The trained model and the teacher, each with its output layer run at the completion tokens only where the
    model allows it (engine/loss.py HeadLoss; None: its whole logits, then those rows)."""

    model: nn.Module
    head: HeadLoss | None
    teacher: nn.Module
    teacher_head: HeadLoss | None


def micro_divergence(
    m: Models,
    c: Completions,
    members: list[int],
    prompts,
    cfg: DistillSettings,
    device: torch.device,  # noqa: ANN001
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One micro-batch's summed divergence over its completion tokens (with the model's gradient), their summed
    entropy, and the model's logits there (kept alive through the backward). A filler micro-batch has no completion
    token: its sums are 0, its backward (and every collective, the teacher's too) the same as every rank's."""
    batch, _ = pack_members(c, members, prompts, device)
    student = target_logits(m.model, m.head, batch)
    with torch.no_grad():
        taught = target_logits(m.teacher, m.teacher_head, batch)
    d, entropy = divergence(student, taught, cfg.beta, cfg.sampling.temperature)
    return d.sum(), entropy.sum(), student


class DistillLoss:
    """--method distill's step (engine/step.py StepLoss). `prompts`: the slice's Prompts; `teacher`: the teacher model
    (sharded, frozen)."""

    names = ("loss", "entropy")

    def __init__(self, settings: DistillSettings, prompts, tokenizer, teacher: nn.Module) -> None:  # noqa: ANN001
        self.s, self.prompts, self.tokenizer, self.teacher = settings, prompts, tokenizer, teacher
        self.teacher_head = HeadLoss.for_run(teacher, 0)
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

    def accumulate(self, s, step: StepBatch, scale: float) -> torch.Tensor:  # noqa: ANN001
        c = self.current
        weight = scale / max(1.0, c.totals["tokens"])
        sums = torch.zeros(len(self.names), device=s.env.device, dtype=torch.float32)
        models = self.models(s.model, s.head_loss)

        def loss_of(i: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
            total, entropy, logits = micro_divergence(models, c, c.micro[i], self.prompts, self.s, s.env.device)
            added = torch.stack([total.detach() / max(1.0, c.totals["tokens"]), entropy])
            return total * weight, added, logits

        run_micro_batches(s.model, len(c.micro), loss_of, sync_each=s.reduce_each_microbatch, sums=sums)
        return sums

    def models(self, model: nn.Module, head: HeadLoss | None) -> Models:
        return Models(model, head, self.teacher, self.teacher_head)

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
    m: Models,
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
    was = m.model.training
    m.model.eval()
    try:
        c = sample_completions(m.model, env, cfg, prompts, mine, tokenizer, decoder, 0, batch_size, greedy)
        local = torch.zeros(2, dtype=torch.float64, device=env.device)
        for members in c.micro:
            total, entropy, _ = micro_divergence(m, c, members, prompts, cfg, env.device)
            local += torch.stack([total, entropy]).double()
    finally:
        m.model.train(was)
    summed = reduce_sum(local, env)
    tokens = max(1.0, c.totals["tokens"])
    return {
        "divergence": float(summed[0]) / tokens,
        "entropy": float(summed[1]) / tokens,
        "prompts": len(prompts),
        "tokens": int(c.totals["tokens"]),
    }
