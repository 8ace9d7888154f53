"""A generation: the completions a rank samples for its prompts of one or more optimizer steps, laid into each
step's micro-batches, with what the loss needs of them kept beside. One sampler for every method that samples
(GRPO, RLOO, distillation); a method whose completions are scored (`Scoring`: GRPO, RLOO) adds their rewards and
advantages on top.

- **Slices.** A generation takes the prompts of `slices` optimizer steps (--steps_per_generation / --accum_steps)
  and samples them at once; each step trains one slice's completions. Advantages are taken over the whole generation
  (a prompt's group lies in one slice; --scale_rewards batch, --normalize_advantages: the generation's rewards, all
  ranks).
- **Kept beside.** Per micro-batch: the reference's token log-probabilities (a KL term), and the policy's own at
  sampling time (the "old" log-probabilities a ratio is taken against, when the generation is trained on more than
  once; RLOO's KL in the reward reads them too).
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
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdp_opt.data.prompts import Prompts
from fsdp_opt.engine.decoding import Decoder
from fsdp_opt.engine.generation import Decoding, Generated, Sampling, completion_keys, gathered, generate
from fsdp_opt.engine.groups import nan_stats, reduce_max, reduce_sum, std_of
from fsdp_opt.engine.logprobs import head_logps
from fsdp_opt.engine.loss import HeadLoss, member_sums
from fsdp_opt.engine.scoring import Completions, Scored, Scoring, mean_rewards, rewards, scores
from fsdp_opt.runtime.distributed import DistEnv


@dataclass
class Slice:
    """One optimizer step's worth of a generation, on this rank, and its totals over the ranks."""

    sequences: list[list[int]]  # prompt + completion tokens of each of this rank's completions
    targets: list[list[bool]]  # the tokens that carry loss (the completion's, up to its end)
    advantages: torch.Tensor  # [n] float32 (zeros for completions that are not scored)
    micro: list[list[int]]  # this rank's completions in each micro-batch (the same count on every rank)
    reference: list[torch.Tensor | None]  # per micro-batch: the reference's token log-probabilities
    old: list[torch.Tensor | None]  # per micro-batch: the policy's at sampling time
    totals: dict[str, float]  # over ranks: completions, tokens, seen, truncated, ...
    records: list[dict[str, Any]]  # this rank's completions, for completions.jsonl
    micro_tokens: list[float] = field(default_factory=list)  # each micro-batch's tokens (--loss_type bnpo)
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
    model,  # noqa: ANN001
    cfg: Decoding,
    prompts: list[list[int]],
    keys: torch.Tensor,
    sampling: Sampling,
    pad_id: int,
    env: DistEnv,
    tokenizer,  # noqa: ANN001
    decoder: Decoder | None,
) -> Generated:
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
            batch_size=cfg.generation_batch,
            decoder=decoder,
        )


def completion_text(tokenizer, ids: list[int], ended: bool, stop: str | None) -> str:  # noqa: ANN001
    """A completion's text as the reward functions get it: without special tokens, and without the template's
    end-of-turn marker where that is plain text."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if stop and ended and text.rstrip().endswith(stop):
        text = text.rstrip()[: -len(stop)]
    return text


def micro_batches(sequences: list[list[int]], batch_size: int, prompts: Prompts, env: DistEnv) -> list[list[int]]:
    """These completions laid into micro-batches in order, as many as fit each; every rank runs as many."""
    out: list[list[int]] = [[]]
    for i, seq in enumerate(sequences):
        lengths = [len(sequences[j]) for j in out[-1]] + [len(seq)]
        if out[-1] and not prompts.layout.fits(lengths, batch_size):
            out.append([])
        out[-1].append(i)
    mine = len(out) if sequences else 0
    count = int(reduce_max(torch.tensor([float(mine)]), env)[0])
    return (out if sequences else []) + [[] for _ in range(count - mine)]


def pack_members(sl: Slice, members: list[int], prompts: Prompts, device: torch.device):  # noqa: ANN201
    """A micro-batch of these completions of the slice (data/sequences.py pack): the batch, and each position's
    member index (-1: none)."""
    return prompts.layout.pack([sl.sequences[i] for i in members], [sl.targets[i] for i in members], device)


@dataclass
class Sampler:
    """What a generation is sampled with: the decoding, the prompts and the tokenizer, the decoder (a static KV cache;
    None: transformers' generate), the model's output layer at the targets, the completions per prompt, whether a
    never-ended completion carries loss, and the scoring (None: the completions are not scored)."""

    decoding: Decoding
    prompts: Prompts
    tokenizer: Any
    decoder: Decoder | None
    head: HeadLoss | None
    generations: int = 1
    mask_truncated: bool = False
    scoring: Scoring | None = None


def sample_generation(run, step, sampler: Sampler) -> Generation:  # noqa: ANN001 - engine/step.py StepRun, StepBatch
    """Sample, score and lay out the generation `step` opens (every rank; the collectives are the statistics')."""
    started = time.perf_counter()
    env, slot, prompts, cfg = run.env, step.generation, sampler.prompts, sampler.decoding
    parts = [[int(p) for p in part] for part in slot.prompts]
    requests = [(p, g) for part in parts for p in part for g in range(sampler.generations)]
    made = Made(requests, [int(prompts.index[p]) for p, _ in requests], [g for _, g in requests])
    at_step = run.state.global_step - slot.index  # the generation's first step: its keys, whenever it is sampled
    keys = completion_keys(cfg.seed, at_step, made.rows, made.places)
    sampling_started = time.perf_counter()
    made.generated = decode(
        run.model,
        cfg,
        [prompts.ids[p] for p, _ in requests],
        keys,
        cfg.sampling,
        prompts.pad_id,
        env,
        sampler.tokenizer,
        sampler.decoder,
    )
    sampling = time.perf_counter() - sampling_started
    made.lay_out(sampler)
    bounds = [0]
    for part in parts:
        bounds.append(bounds[-1] + len(part) * sampler.generations)
    pieces = [made.piece(run, sampler, lo, hi, slot.count > 1) for lo, hi in zip(bounds, bounds[1:])]
    scored = scored_of(run, sampler, made, pieces)
    slices = [_slice(run, sampler, made, scored, piece, at_step + 1 + j, sampling) for j, piece in enumerate(pieces)]
    return Generation(
        epoch=step.epoch,
        begin=slot.begin,
        step=at_step,
        slices=slices,
        tokens=sum(sl.totals["tokens"] for sl in slices),
        generated=sum(sl.totals["generated"] for sl in slices),
        seconds=float(reduce_max(torch.tensor([sampling]), env)[0]),
        prepare_seconds=time.perf_counter() - started,
    )


@dataclass
class Piece:
    """One slice's completions [lo, hi) of the generation on this rank: their micro-batches, and per micro-batch what
    the loss reads of other models (the reference) or of this one before its updates (the old log-probabilities)."""

    lo: int
    hi: int
    micro: list[list[int]]
    reference: list[torch.Tensor | None]
    old: list[torch.Tensor | None]
    log_ratio: torch.Tensor  # [hi - lo] each completion's summed log-ratio to the reference (RLOO's KL), else zeros


@dataclass
class Made:
    """What one rank sampled for a generation, in request order."""

    requests: list[tuple[int, int]]  # (prompt, place in its group)
    rows: list[int]
    places: list[int]
    generated: Generated | None = None
    texts: list[str] = field(default_factory=list)
    sequences: list[list[int]] = field(default_factory=list)  # prompt + completion
    targets: list[list[bool]] = field(default_factory=list)  # the completion's tokens (none of a masked one)

    def lay_out(self, sampler: Sampler) -> None:
        g, prompts, stop = self.generated, sampler.prompts, sampler.decoding.stop
        self.texts = [completion_text(sampler.tokenizer, ids, ended, stop) for ids, ended in zip(g.ids, g.ended)]
        for (p, _), ids, ended in zip(self.requests, g.ids, g.ended):
            carries = not (sampler.mask_truncated and not ended)
            self.sequences.append(list(prompts.ids[p]) + list(ids))
            self.targets.append([False] * len(prompts.ids[p]) + [carries] * len(ids))

    def completions(self) -> Completions:
        """What the reward functions read of these completions."""
        g = self.generated
        return Completions([p for p, _ in self.requests], self.texts, g.ids, self.rows, g.ended, self.places)

    def piece(self, run, sampler: Sampler, lo: int, hi: int, trained_again: bool) -> Piece:  # noqa: ANN001
        """Completions [lo, hi) as one slice's micro-batches, and what the loss keeps of each (every rank)."""
        prompts, env = sampler.prompts, run.env
        micro = micro_batches(self.sequences[lo:hi], run.plan.batch_size, prompts, env)
        scoring = sampler.scoring
        settings = scoring.settings if scoring else None
        use_reference = scoring is not None and scoring.reference_logps is not None and settings.beta > 0
        kl_in_reward = use_reference and settings.kl_in_reward
        temperature = sampler.decoding.sampling.temperature
        piece = Piece(lo, hi, micro, [], [], torch.zeros(hi - lo))
        for members in micro:
            batch, slot = prompts.layout.pack(
                [self.sequences[lo + i] for i in members], [self.targets[lo + i] for i in members], env.device
            )
            reference = scoring.reference_logps(batch) if use_reference else None
            old = None
            if members and (trained_again or kl_in_reward):  # the log-probabilities it was sampled with
                with torch.no_grad():
                    old = head_logps(run.model, sampler.head, batch, temperature)[0]
            if use_reference:
                piece.reference.append(reference)
            if trained_again:
                piece.old.append(old)
            if kl_in_reward and members:
                piece.log_ratio[members] = member_sums(old - reference, batch["labels"], slot, len(members)).cpu()
        return piece


def scored_of(run, sampler: Sampler, made: Made, pieces: list[Piece]) -> Scored | None:  # noqa: ANN001
    """The generation's scores (None: its completions are not scored); every rank calls it."""
    if sampler.scoring is None:
        return None
    log_ratio = torch.cat([piece.log_ratio for piece in pieces]) if pieces else torch.zeros(0)
    return scores(sampler.scoring.settings, sampler.prompts, made.completions(), log_ratio, run.env)


def _slice(
    run, sampler: Sampler, made: Made, scored: Scored | None, piece: Piece, first_step: int, sampling: float
) -> Slice:  # noqa: ANN001
    """One slice's completions: its totals over the ranks and its records."""
    env, prompts, lo, hi = run.env, sampler.prompts, piece.lo, piece.hi
    g = made.generated
    ids, ended, targets = g.ids[lo:hi], g.ended[lo:hi], made.targets[lo:hi]
    tokens = [sum(t) for t in targets]
    local = torch.tensor(
        [
            hi - lo,
            sum(tokens),
            sum(len(q) for q in made.sequences[lo:hi]),
            sum(not e for e in ended),
            float(scored.zero[lo:hi].float().sum()) if scored else 0.0,
            float(sum(len(i) for i in ids)),
            float(piece.log_ratio.sum()),
        ],
        dtype=torch.float64,
    )
    functions = scored.per_func.shape[1] if scored else 0
    reward = scored.reward[lo:hi] if scored else torch.zeros(0)
    reward_sums = torch.cat(
        [nan_stats(reward)[:2], *(nan_stats(scored.per_func[lo:hi, j])[:2] for j in range(functions))]
    ) if scored else torch.zeros(0, dtype=torch.float64)  # fmt: skip
    # a mixture: the tokens trained of each source's completions (the prompts' sources are known, their completions'
    # lengths only now)
    by_source = torch.zeros(0, dtype=torch.float64)
    if prompts.sources is not None:
        origin = prompts.sources[torch.tensor([p for p, _ in made.requests[lo:hi]], dtype=torch.long)]
        by_source = torch.bincount(
            origin, weights=torch.tensor(tokens, dtype=torch.float64), minlength=len(prompts.source_names)
        )
    std_stats = nan_stats(reward) if scored else torch.zeros(0, dtype=torch.float64)
    summed = reduce_sum(torch.cat([local, reward_sums, std_stats, by_source]), env)
    longest = reduce_max(torch.tensor([float(max((len(i) for i in ids), default=0)), sampling]), env)
    names = ("completions", "tokens", "seen", "truncated", "zero_std", "generated", "log_ratio")
    totals = dict(zip(names, summed[:7].tolist()))
    totals.update(length_max=float(longest[0]), generation_seconds=float(longest[1]))
    at = 7
    if scored:
        cfg = sampler.scoring.settings
        totals.update(reward_count=float(summed[at]), reward_sum=float(summed[at + 1]))
        for j, r in enumerate(cfg.rewards):
            count, total = float(summed[at + 2 + 2 * j]), float(summed[at + 3 + 2 * j])
            totals[f"reward_{r.label}"] = total / max(1.0, count)
        at += 2 + 2 * functions
        totals["reward_std"] = std_of(summed[at : at + 3])
        at += 3
    source_tokens = [int(v) for v in summed[at:].tolist()] if len(by_source) else None
    records = []
    for i in range(hi - lo):
        p, place = made.requests[lo + i]
        record = {
            "step": first_step,
            "row": made.rows[lo + i],
            "place": place,
            "prompt": sampler.tokenizer.decode(prompts.ids[p], skip_special_tokens=False),
            "completion": made.texts[lo + i],
            "completion_ids": [] if sampler.mask_truncated and not ended[i] else list(ids[i]),
            "ended": bool(ended[i]),
        }
        if scored:
            record["rewards"] = {
                rw.label: None if math.isnan(v) else v
                for rw, v in zip(sampler.scoring.settings.rewards, scored.per_func[lo + i].tolist())
            }
            record["reward"] = None if math.isnan(float(scored.reward[lo + i])) else float(scored.reward[lo + i])
            record["advantage"] = float(scored.advantages[lo + i])
        records.append(record)
    return Slice(
        made.sequences[lo:hi],
        targets,
        scored.advantages[lo:hi].float() if scored else torch.zeros(hi - lo),
        piece.micro,
        piece.reference,
        piece.old,
        totals,
        records,
        micro_tokens=[float(sum(tokens[i] for i in mb)) for mb in piece.micro],
        source_tokens=source_tokens,
    )


def held_out(model, prompts: Prompts, sampler: Sampler, env: DistEnv) -> Made:  # noqa: ANN001
    """One greedy completion of each held-out prompt, this rank's share (every world_size-th), in eval mode."""
    mine = list(range(env.rank, len(prompts), env.world_size))
    made = Made([(p, 0) for p in mine], [int(prompts.index[p]) for p in mine], [0] * len(mine))
    greedy = Sampling(sampler.decoding.sampling.max_new_tokens, top_k=1)
    made.generated = decode(
        model,
        sampler.decoding,
        [prompts.ids[p] for p in mine],
        torch.zeros(len(mine), dtype=torch.int64),
        greedy,
        prompts.pad_id,
        env,
        sampler.tokenizer,
        sampler.decoder,
    )
    made.lay_out(sampler)
    return made


def held_out_rewards(model, sampler: Sampler, env: DistEnv) -> dict[str, Any]:  # noqa: ANN001
    """One greedy completion of each held-out prompt (`sampler.prompts`), scored: the mean reward in total and per
    function, over ranks, and this rank's completions (`samples`)."""
    settings, prompts = sampler.scoring.settings, sampler.prompts
    made = held_out(model, prompts, sampler, env)
    done = made.completions()
    done.places = None  # one greedy completion a prompt: no group
    per_func, reward = rewards(settings, prompts, done)
    out: dict[str, Any] = {**mean_rewards(settings, per_func, reward, env), "prompts": len(prompts)}
    out["samples"] = [
        {"row": r, "completion": t, "completion_ids": list(i), "reward": None if math.isnan(float(v)) else float(v)}
        for r, t, i, v in zip(made.rows, made.texts, done.ids, reward.tolist())
    ]
    return out
