"""A GRPO generation (--method grpo): the completions a rank samples for its prompts of one or more optimizer steps,
scored, turned into advantages and laid into each step's micro-batches, with what the loss needs of them kept
beside: the reference's token log-probabilities (--beta > 0) and, when the generation is trained on more than once
(--num_iterations, --steps_per_generation), the policy's own at sampling time (the "old" log-probabilities the
probability ratio is taken against).

- **Slices.** A generation takes the prompts of `slices` optimizer steps (--steps_per_generation / --accum_steps)
  and samples them at once; each step trains one slice's completions. Advantages are taken over the whole generation
  (a prompt's group lies in one slice; --scale_rewards batch: the std of the generation's rewards, all ranks).
- **Counts.** Each slice keeps its totals over the ranks (completions, tokens, rewards, ...) for its steps' loss and
  metrics; the generation keeps its completion tokens, all ranks (--loss_type dapo divides by them, rescaled to one
  step: TRL's normalizer).
- **Kept whole.** A checkpoint saved between the steps of a generation holds it (every rank's part), so a session
  resumed there trains on the same completions and the same old log-probabilities, bit for bit, instead of sampling
  again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdp_opt.data.blocks import StepBatch
from fsdp_opt.data.sequences import fits, pack
from fsdp_opt.engine.decoding import Decoder
from fsdp_opt.engine.generation import Decoding, Generated, Sampling, completion_keys, gathered, generate
from fsdp_opt.engine.groups import (
    GroupSettings,
    advantages,
    nan_stats,
    reduce_max,
    reduce_sum,
    std_of,
    weighted_rewards,
)
from fsdp_opt.engine.logprobs import head_logps
from fsdp_opt.engine.rewards import score
from fsdp_opt.runtime.distributed import all_ranks_ok


@dataclass
class Slice:
    """One optimizer step's worth of a generation, on this rank, and its totals over the ranks."""

    sequences: list[list[int]]  # prompt + completion tokens of each of this rank's completions
    targets: list[list[bool]]  # the tokens that carry loss (the completion's, up to its end)
    advantages: torch.Tensor  # [n] float32
    micro: list[list[int]]  # this rank's completions in each micro-batch (the same count on every rank)
    reference: list[torch.Tensor | None]  # per micro-batch: the reference's token log-probabilities (beta > 0)
    old: list[torch.Tensor | None]  # per micro-batch: the policy's at sampling time (a generation trained on again)
    totals: dict[str, float]  # over ranks: completions, tokens, seen, truncated, ...
    records: list[dict[str, Any]]  # this rank's completions, for completions.jsonl
    micro_tokens: list[float] = field(default_factory=list)  # --loss_type bnpo: each micro-batch's tokens
    source_tokens: list[int] | None = None  # a mixture's step: the tokens trained of each source's completions


@dataclass
class Generation:
    """A rank's part of one generation: its slices, and what spans them."""

    epoch: int
    begin: int  # the epoch's position of its first prompt
    step: int  # the global step that sampled it (its completions' counter keys)
    slices: list[Slice]
    tokens: float  # its completion tokens that carry loss, all ranks
    generated: float  # tokens generated, all ranks
    seconds: float  # sampling, the slowest rank
    prepare_seconds: float  # sampling, scoring and the log-probabilities it keeps

    def state(self) -> dict[str, Any]:
        """Plain lists and CPU tensors (a checkpoint reads them back with weights_only)."""
        cpu = lambda ts: [None if t is None else t.detach().cpu() for t in ts]  # noqa: E731
        return {
            **{k: getattr(self, k) for k in ("epoch", "begin", "step", "tokens", "generated", "seconds")},
            "prepare_seconds": self.prepare_seconds,
            "slices": [
                {**vars(sl), "advantages": sl.advantages.cpu(), "reference": cpu(sl.reference), "old": cpu(sl.old)}
                for sl in self.slices
            ],
        }

    @classmethod
    def from_state(cls, saved: dict[str, Any]) -> Generation:
        slices = [Slice(**sl) for sl in saved["slices"]]
        return cls(**{**saved, "slices": slices})


def decode(
    model,
    cfg: Decoding,
    prompts: list[list[int]],
    keys: torch.Tensor,
    sampling: Sampling,
    pad_id: int,  # noqa: ANN001
    env,
    tokenizer,
    decoder: Decoder | None,
    batch_size: int = 0,
) -> Generated:  # noqa: ANN001
    """This rank's completions of `prompts`, on the model gathered once (or its shards), each drawn with its key."""
    with gathered(model, cfg.gather):
        return generate(
            model,
            prompts,
            keys,
            sampling,
            eos_ids=cfg.eos_ids,
            pad_id=pad_id,
            device=env.device,
            stop=cfg.stop,
            tokenizer=tokenizer,
            synced=not cfg.gather and env.world_size > 1,
            batch_size=batch_size,
            decoder=decoder,
        )


def completion_text(tokenizer, ids: list[int], ended: bool, stop: str | None) -> str:  # noqa: ANN001
    """A completion's text as the reward functions get it: without special tokens, and without the template's
    end-of-turn marker where that is plain text."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if stop and ended and text.rstrip().endswith(stop):
        text = text.rstrip()[: -len(stop)]
    return text


def micro_batches(sequences: list[list[int]], batch_size: int, prompts, env) -> list[list[int]]:  # noqa: ANN001
    """These completions laid into micro-batches in order, as many as fit each; every rank runs as many."""
    out: list[list[int]] = [[]]
    for i, seq in enumerate(sequences):
        lengths = [len(sequences[j]) for j in out[-1]] + [len(seq)]
        if out[-1] and not fits(lengths, prompts.max_length, prompts.packing, batch_size):
            out.append([])
        out[-1].append(i)
    mine = len(out) if sequences else 0
    count = int(reduce_max(torch.tensor([float(mine)]), env)[0])
    return (out if sequences else []) + [[] for _ in range(count - mine)]


def pack_members(sl: Slice, members: list[int], prompts, device: torch.device):  # noqa: ANN001, ANN201
    """A micro-batch of these completions of the slice (data/sequences.py pack): the batch, and each position's
    member index (-1: none)."""
    return pack(
        [sl.sequences[i] for i in members],
        [sl.targets[i] for i in members],
        prompts.pad_id,
        prompts.max_length,
        prompts.packing,
        device,
        prompts.attention,
        prompts.pattern,
    )


def sample_generation(
    s,  # noqa: ANN001 - the step's run (engine/step.py StepRun)
    step: StepBatch,
    cfg: GroupSettings,
    prompts,  # noqa: ANN001 - data/prompts.py Prompts
    tokenizer,  # noqa: ANN001
    decoder: Decoder | None,
    reference_logps: Callable | None,
) -> Generation:
    """Sample, score and lay out the generation `step` opens (every rank; the collectives are the statistics')."""
    started = time.perf_counter()
    env, slot = s.env, step.generation
    parts = [[int(p) for p in part] for part in slot.prompts]
    requests = [(p, g) for part in parts for p in part for g in range(cfg.generations)]
    rows = [int(prompts.index[p]) for p, _ in requests]
    places = [g for _, g in requests]
    at_step = s.state.global_step - slot.index  # the generation's first step: its keys, whenever it is sampled
    keys = completion_keys(cfg.seed, at_step, rows, places)
    sampling_started = time.perf_counter()
    made = decode(
        s.model,
        cfg,
        [prompts.ids[p] for p, _ in requests],
        keys,
        cfg.sampling,
        prompts.pad_id,
        env,
        tokenizer,
        decoder,
        cfg.generation_batch,
    )
    sampling = time.perf_counter() - sampling_started
    texts = [completion_text(tokenizer, ids, ended, cfg.stop) for ids, ended in zip(made.ids, made.ended)]
    completions = [[{"role": "assistant", "content": t}] for t in texts] if prompts.conversational else texts
    asked = [prompts.rows[p]["prompt"] for p, _ in requests]
    columns = prompts.column_lists([p for p, _ in requests]) if requests else {}
    per_func = all_ranks_ok(lambda: score(cfg.rewards, asked, completions, made.ids, columns, rows, made.ended, places))
    per_func = torch.tensor(per_func, dtype=torch.float32).view(len(requests), len(cfg.rewards))
    reward = weighted_rewards(per_func, cfg.weights)
    generation_stats = reduce_sum(nan_stats(reward), env)  # the generation's rewards on all ranks
    batch_std = std_of(generation_stats) if cfg.scale_rewards == "batch" else None
    if requests:
        adv, zero = advantages(reward, cfg.generations, cfg.scale_rewards, batch_std)
    else:
        adv, zero = torch.zeros(0), torch.zeros(0, dtype=torch.bool)
    sequences, targets = [], []
    for (p, _), ids, ended in zip(requests, made.ids, made.ended):
        counts = not (cfg.mask_truncated and not ended)
        sequences.append(list(prompts.ids[p]) + list(ids))
        targets.append([False] * len(prompts.ids[p]) + [counts] * len(ids))
    made_here = _Made(requests, rows, places, texts, made, per_func, reward, adv, zero, sequences, targets)
    slices, lo = [], 0
    for j, part in enumerate(parts):
        hi = lo + len(part) * cfg.generations
        slices.append(_slice(made_here, lo, hi, s, cfg, prompts, tokenizer, at_step + 1 + j, sampling))
        lo = hi
    generation = Generation(
        epoch=step.epoch,
        begin=slot.begin,
        step=at_step,
        slices=slices,
        tokens=sum(sl.totals["tokens"] for sl in slices),
        generated=sum(sl.totals["generated"] for sl in slices),
        seconds=float(reduce_max(torch.tensor([sampling]), env)[0]),
        prepare_seconds=0.0,
    )
    for sl in slices:  # what the loss reads of other models (or of this one before its updates), per micro-batch
        batches = [pack_members(sl, members, prompts, env.device)[0] for members in sl.micro]
        if cfg.beta > 0 and reference_logps is not None:
            sl.reference = [reference_logps(b) for b in batches]
        if slot.count > 1:  # trained on more than once: the log-probabilities it was sampled with
            with torch.no_grad():
                sl.old = [
                    head_logps(s.model, s.head_loss, b, cfg.sampling.temperature)[0] if members else None
                    for b, members in zip(batches, sl.micro)
                ]
    generation.prepare_seconds = time.perf_counter() - started
    return generation


@dataclass
class _Made:
    """What one rank sampled and scored for a generation, in request order."""

    requests: list[tuple[int, int]]
    rows: list[int]
    places: list[int]
    texts: list[str]
    made: Generated
    per_func: torch.Tensor
    reward: torch.Tensor
    adv: torch.Tensor
    zero: torch.Tensor
    sequences: list[list[int]]
    targets: list[list[bool]]


def _slice(
    m: _Made,
    lo: int,
    hi: int,
    s,
    cfg: GroupSettings,
    prompts,
    tokenizer,
    first_step: int,  # noqa: ANN001
    sampling: float,
) -> Slice:
    """Requests [lo, hi) as one step's slice: its micro-batches, its totals over the ranks, its records."""
    env = s.env
    ids, ended = m.made.ids[lo:hi], m.made.ended[lo:hi]
    sequences, targets = m.sequences[lo:hi], m.targets[lo:hi]
    per_func, reward = m.per_func[lo:hi], m.reward[lo:hi]
    tokens = [sum(t) for t in targets]
    micro = micro_batches(sequences, s.plan.batch_size, prompts, env)
    local = torch.tensor(
        [
            hi - lo,
            sum(tokens),
            sum(len(q) for q in sequences),
            sum(not e for e in ended),
            float(m.zero[lo:hi].float().sum()),
            float(sum(len(i) for i in ids)),
        ],
        dtype=torch.float64,
    )
    funcs = range(len(cfg.rewards))
    reward_sums = torch.cat([nan_stats(reward)[:2], *(nan_stats(per_func[:, j])[:2] for j in funcs)])
    # a mixture: the tokens trained of each source's completions (the prompts' sources are known, their completions'
    # lengths only now)
    by_source = torch.zeros(0, dtype=torch.float64)
    if prompts.sources is not None:
        origin = prompts.sources[torch.tensor([p for p, _ in m.requests[lo:hi]], dtype=torch.long)]
        weights = torch.tensor(tokens, dtype=torch.float64)
        by_source = torch.bincount(origin, weights=weights, minlength=len(prompts.source_names))
    summed = reduce_sum(torch.cat([local, reward_sums, nan_stats(reward), by_source]), env)
    longest = reduce_max(torch.tensor([float(max((len(i) for i in ids), default=0)), sampling]), env)
    names = ("completions", "tokens", "seen", "truncated", "zero_std", "generated")
    totals = dict(zip(names, summed[:6].tolist()))
    stats_at = 8 + 2 * len(cfg.rewards)
    totals.update(
        length_max=float(longest[0]),
        generation_seconds=float(longest[1]),
        reward_count=float(summed[6]),
        reward_sum=float(summed[7]),
        reward_std=std_of(summed[stats_at : stats_at + 3]),
    )
    for j, r in enumerate(cfg.rewards):
        totals[f"reward_{r.label}"] = float(summed[8 + 2 * j + 1] / max(1.0, float(summed[8 + 2 * j])))
    source_tokens = [int(v) for v in summed[stats_at + 3 :].tolist()] if len(by_source) else None
    micro_tokens = [float(sum(tokens[i] for i in mb)) for mb in micro]
    records = []
    for i in range(hi - lo):
        p, g = m.requests[lo + i]
        masked = cfg.mask_truncated and not ended[i]
        rewards = {rw.label: None if math.isnan(v) else v for rw, v in zip(cfg.rewards, per_func[i].tolist())}
        records.append(
            {
                "step": first_step,
                "row": m.rows[lo + i],
                "place": g,
                "prompt": tokenizer.decode(prompts.ids[p], skip_special_tokens=False),
                "completion": m.texts[lo + i],
                "completion_ids": [] if masked else list(ids[i]),
                "rewards": rewards,
                "reward": None if math.isnan(float(reward[i])) else float(reward[i]),
                "advantage": float(m.adv[lo + i]),
            }
        )
    return Slice(
        sequences,
        targets,
        m.adv[lo:hi].float(),
        micro,
        [],
        [],
        totals,
        records,
        micro_tokens=micro_tokens,
        source_tokens=source_tokens,
    )


def held_out_rewards(
    model,  # noqa: ANN001
    prompts,  # noqa: ANN001
    tokenizer,  # noqa: ANN001
    settings: GroupSettings,
    env,  # noqa: ANN001
    batch_size: int = 0,
    decoder: Decoder | None = None,
) -> dict[str, Any]:
    """One greedy completion of each held-out prompt (this rank's share: every world_size-th), scored: the mean reward
    in total and per function, over ranks, and this rank's completions."""
    mine = list(range(env.rank, len(prompts), env.world_size))
    if decoder is None and settings.decoding != "generate":
        decoder = Decoder()
    greedy = Sampling(settings.sampling.max_new_tokens, top_k=1)
    keys = torch.zeros(len(mine), dtype=torch.int64)
    made = decode(
        model,
        settings,
        [prompts.ids[p] for p in mine],
        keys,
        greedy,
        prompts.pad_id,
        env,
        tokenizer,
        decoder,
        batch_size,
    )
    texts = [completion_text(tokenizer, ids, e, settings.stop) for ids, e in zip(made.ids, made.ended)]
    completions = [[{"role": "assistant", "content": t}] for t in texts] if prompts.conversational else texts
    rows = [int(prompts.index[p]) for p in mine]
    columns = prompts.column_lists(mine)
    asked = [prompts.rows[p]["prompt"] for p in mine]
    per_func = all_ranks_ok(lambda: score(settings.rewards, asked, completions, made.ids, columns, rows, made.ended))
    per_func = torch.tensor(per_func, dtype=torch.float32).view(len(mine), len(settings.rewards))
    reward = weighted_rewards(per_func, settings.weights)
    funcs = range(len(settings.rewards))
    stats = reduce_sum(torch.cat([nan_stats(reward)[:2], *(nan_stats(per_func[:, j])[:2] for j in funcs)]), env)
    out: dict[str, Any] = {"reward": float(stats[1] / max(1.0, float(stats[0]))), "prompts": len(prompts)}
    for j, r in enumerate(settings.rewards):
        out[f"reward_{r.label}"] = float(stats[2 + 2 * j + 1] / max(1.0, float(stats[2 + 2 * j])))
    out["samples"] = [
        {"row": r, "completion": t, "completion_ids": list(i), "reward": None if math.isnan(float(v)) else float(v)}
        for r, t, i, v in zip(rows, texts, made.ids, reward.tolist())
    ]
    return out
