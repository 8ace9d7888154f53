"""Group Relative Policy Optimization (--method grpo): a step's prepare phase samples --num_generations completions of
each of its prompts from the policy, scores them with the reward functions, and turns the rewards into advantages;
then the same micro-batches, optimizer step and checkpoint as any method. TRL 1.16's GRPOTrainer loss:

- advantages: A = (r - mean of its group) / (std of its group + 1e-4), the std with Bessel's correction
  (--scale_rewards group; batch: the std of the step's rewards on all ranks; none: no division); r is the weighted
  sum of the reward functions' values; a completion whose every reward is None has no r, stays out of its group's
  mean and std, and gets A = 0;
- per token of a completion: -min(rho A, clip(rho, 1 - eps, 1 + eps_high) A) + beta rho k3, with rho = exp(logp -
  logp.detach()) (one update per generation: 1 in value, A grad logp in gradient) and k3 = exp(ref - logp) - (ref -
  logp) - 1 (the factor rho on it is TRL 1.16's default, use_bias_correction_kl); log-probabilities of the logits
  divided by the temperature, in fp32;
- the mask: a completion's tokens up to and including its end; none of a completion that never ended, with
  --mask_truncated_completions;
- --loss_type: dapo divides the step's summed token losses by its completion tokens (all ranks); grpo averages each
  completion's token mean over the step's completions; dr_grpo divides by completions x --max_completion_length;
  bnpo divides each micro-batch's sum by its own tokens (and by the step's micro-batches).

A step's completions are packed into micro-batches as DPO packs its pairs (data/sequences.py): every sequence a
document of its own. Each rank generates and scores its own prompts (a prompt's group stays on one rank); the
statistics that span ranks (the step's token and completion counts, the batch std, the metrics) are all-reduced.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from fsdp_opt.data.blocks import IGNORE_INDEX, model_inputs
from fsdp_opt.data.sequences import fits, pack
from fsdp_opt.engine.dpo import head_logps, token_logps
from fsdp_opt.engine.loss import next_token_targets
from fsdp_opt.engine.generation import Generated, Sampling, completion_keys, gathered, generate
from fsdp_opt.engine.rewards import Reward, score
from fsdp_opt.runtime.distributed import all_ranks_ok


@dataclass
class GroupSettings:
    """What a GRPO step needs of the flags, decided once."""

    generations: int
    sampling: Sampling
    epsilon: float
    epsilon_high: float
    beta: float
    loss_type: str
    scale_rewards: str
    mask_truncated: bool
    rewards: list[Reward]
    weights: list[float]
    seed: int
    eos_ids: list[int]
    stop: str | None  # the chat template's end-of-turn text, where it is several tokens
    gather: bool = True  # generate on the model gathered once (else on its shards)
    generation_batch: int = 0  # requests generated at once per rank (0: all)


def advantages(rewards: torch.Tensor, generations: int, scale: str, batch_std: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] advantages of n = groups x G total rewards (NaN: no reward), and [n] whether each one's group has zero
    std. `batch_std`: the std over the step's rewards on all ranks (--scale_rewards batch)."""
    grouped = rewards.view(-1, generations)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    count = (~torch.isnan(grouped)).sum(1, keepdim=True)
    var = torch.nanmean((grouped - mean) ** 2, dim=1, keepdim=True) * count / (count - 1).clamp(min=1)
    group_std = torch.where(count > 1, var.sqrt(), torch.full_like(var, math.nan))
    adv = grouped - mean
    if scale == "group":
        adv = adv / (group_std + 1e-4)
    elif scale == "batch":
        adv = adv / ((batch_std if batch_std is not None else math.nan) + 1e-4)
    zero = torch.isclose(group_std, torch.zeros_like(group_std)).expand_as(grouped)
    return torch.nan_to_num(adv, nan=0.0).reshape(-1), zero.reshape(-1)


def nan_stats(values: torch.Tensor) -> torch.Tensor:
    """[count, sum, sum of squares] of the non-NaN values (for a std over ranks)."""
    ok = ~torch.isnan(values)
    v = values[ok].double()
    return torch.stack([ok.sum().double(), v.sum(), (v * v).sum()])


def std_of(stats: torch.Tensor) -> float:
    count, total, squares = (float(x) for x in stats)
    if count < 2:
        return math.nan
    return math.sqrt(max(0.0, (squares - total * total / count) / (count - 1)))


@dataclass
class StepCompletions:
    """What a step's prepare phase made on this rank, and the step's totals over ranks."""

    sequences: list[list[int]]  # prompt + completion tokens of each of this rank's completions
    targets: list[list[bool]]  # the tokens that carry loss (the completion's, up to its end)
    advantages: torch.Tensor  # [n] float32
    micro: list[list[int]]  # this rank's completions in each micro-batch (the same count on every rank)
    reference: list[torch.Tensor | None]  # per micro-batch: the reference's token log-probabilities (beta > 0)
    totals: dict[str, float]  # over ranks: completions, tokens, seen, truncated, ...
    records: list[dict[str, Any]]  # this rank's completions, for completions.jsonl
    seconds: float = 0.0  # the prepare phase's time
    generation_seconds: float = 0.0
    micro_tokens: list[float] = field(default_factory=list)  # --loss_type bnpo: each micro-batch's tokens
    source_tokens: list[int] | None = None  # a mixture's step: the tokens trained of each source's completions


class GroupLoss:
    """--method grpo's step (engine/step.py StepLoss). `prompts`: the slice's Prompts; `reference_logps(batch)`:
    the reference's token log-probabilities of a packed micro-batch (beta > 0)."""

    names = ("loss", "kl")

    def __init__(self, settings: GroupSettings, prompts, tokenizer, reference_logps: Callable | None = None) -> None:  # noqa: ANN001
        self.s, self.prompts, self.tokenizer, self.reference_logps = settings, prompts, tokenizer, reference_logps
        self.current: StepCompletions | None = None

    # ------------------------------------------------------------ the prepare phase

    def prepare(self, s, step) -> None:  # noqa: ANN001
        started = time.perf_counter()
        cfg, env, prompts = self.s, s.env, self.prompts
        mine = [int(p) for p in step.micro_batches[0]]
        requests = [(p, g) for p in mine for g in range(cfg.generations)]
        rows = [int(prompts.index[p]) for p, _ in requests]
        keys = completion_keys(cfg.seed, s.state.global_step, rows, [g for _, g in requests])
        gen_started = time.perf_counter()
        with gathered(s.model, cfg.gather):
            made = generate(s.model, [prompts.ids[p] for p, _ in requests], keys, cfg.sampling, eos_ids=cfg.eos_ids,
                            pad_id=prompts.pad_id, device=env.device, stop=cfg.stop, tokenizer=self.tokenizer,
                            synced=not cfg.gather and env.world_size > 1, batch_size=cfg.generation_batch)  # fmt: skip
        generation_seconds = time.perf_counter() - gen_started
        texts = [self._text(ids, ended) for ids, ended in zip(made.ids, made.ended)]
        asked = [prompts.rows[p]["prompt"] for p, _ in requests]
        completions = [[{"role": "assistant", "content": t}] for t in texts] if prompts.conversational else texts
        columns = prompts.column_lists([p for p, _ in requests]) if mine else {}
        per_func = all_ranks_ok(lambda: score(cfg.rewards, asked, completions, made.ids, columns, rows, made.ended))
        per_func = torch.tensor(per_func, dtype=torch.float32).view(len(requests), len(cfg.rewards))
        weights = torch.tensor(cfg.weights, dtype=torch.float32)
        unscorable = torch.isnan(per_func).all(dim=1)
        reward = torch.where(unscorable, torch.full((len(requests),), math.nan), (per_func * weights).nansum(dim=1))
        reward_stats = self._sum(nan_stats(reward), env)  # the step's rewards on all ranks
        batch_std = std_of(reward_stats) if cfg.scale_rewards == "batch" else None
        adv, zero = advantages(reward, cfg.generations, cfg.scale_rewards, batch_std) if requests else (
            torch.zeros(0), torch.zeros(0, dtype=torch.bool))  # fmt: skip
        sequences, targets = [], []
        for p_g, ids, ended in zip(requests, made.ids, made.ended):
            prompt = prompts.ids[p_g[0]]
            counts = not (cfg.mask_truncated and not ended)
            sequences.append(list(prompt) + list(ids))
            targets.append([False] * len(prompt) + [counts] * len(ids))
        micro = self._micro_batches(sequences, s, env)
        tokens = [sum(t) for t in targets]
        local = torch.tensor([len(requests), sum(tokens), sum(len(q) for q in sequences), sum(not e for e in made.ended),
                              float(zero.float().sum()), float(sum(len(i) for i in made.ids)),
                              float(max((len(i) for i in made.ids), default=0)), generation_seconds], dtype=torch.float64)  # fmt: skip
        reward_sums = torch.cat([nan_stats(reward)[:2], *(nan_stats(per_func[:, j])[:2] for j in range(len(cfg.rewards)))])
        # a mixture: the tokens trained of each source's completions (the prompts' sources are known, their
        # completions' lengths only now)
        by_source = torch.zeros(0, dtype=torch.float64)
        if prompts.sources is not None:
            origin = prompts.sources[torch.tensor([p for p, _ in requests], dtype=torch.long)]
            by_source = torch.bincount(origin, weights=torch.tensor(tokens, dtype=torch.float64),
                                       minlength=len(prompts.source_names))  # fmt: skip
        summed = self._sum(torch.cat([local[:6], reward_sums, by_source]), env)
        maxed = self._max(local[6:], env)
        totals = dict(zip(("completions", "tokens", "seen", "truncated", "zero_std", "generated"), summed[:6].tolist()))
        totals.update(length_max=float(maxed[0]), generation_seconds=float(maxed[1]), reward_count=float(summed[6]),
                      reward_sum=float(summed[7]), reward_std=std_of(reward_stats))  # fmt: skip
        for j, r in enumerate(cfg.rewards):
            totals[f"reward_{r.name}"] = float(summed[8 + 2 * j + 1] / max(1.0, float(summed[8 + 2 * j])))
        source_tokens = [int(v) for v in summed[len(summed) - len(by_source):].tolist()] if len(by_source) else None
        micro_tokens = [float(sum(tokens[i] for i in m)) for m in micro]
        records = [{"step": s.state.global_step + 1, "row": r, "prompt": self.tokenizer.decode(prompts.ids[p],
                    skip_special_tokens=False), "completion": t, "completion_ids": list(ids) if not (cfg.mask_truncated
                    and not e) else [], "rewards": {rw.name: None if math.isnan(v) else v for rw, v in zip(cfg.rewards,
                    per_func[i].tolist())}, "reward": None if math.isnan(float(reward[i])) else float(reward[i]),
                    "advantage": float(adv[i])}
                   for i, ((p, _), r, t, ids, e) in enumerate(zip(requests, rows, texts, made.ids, made.ended))]  # fmt: skip
        self.current = StepCompletions(sequences, targets, adv.float(), micro, [], totals, records,
                                       generation_seconds=generation_seconds, micro_tokens=micro_tokens,
                                       source_tokens=source_tokens)  # fmt: skip
        if cfg.beta > 0 and self.reference_logps is not None:
            self.current.reference = [self.reference_logps(self._pack(m, s)[0]) for m in micro]
        self.current.seconds = time.perf_counter() - started

    def _text(self, ids: list[int], ended: bool) -> str:
        """A completion's text as the reward functions get it: without special tokens, and without the template's
        end-of-turn marker where that is plain text."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stop = self.s.stop
        if stop and ended and text.rstrip().endswith(stop):
            text = text.rstrip()[: -len(stop)]
        return text

    def _micro_batches(self, sequences: list[list[int]], s, env) -> list[list[int]]:  # noqa: ANN001
        """This rank's completions laid into micro-batches in order, as many as fit each; every rank runs as many."""
        out: list[list[int]] = [[]]
        batch, max_length, packing = s.plan.batch_size, self.prompts.max_length, self.prompts.packing
        for i, seq in enumerate(sequences):
            if out[-1] and not fits([len(sequences[j]) for j in out[-1]] + [len(seq)], max_length, packing, batch):
                out.append([])
            out[-1].append(i)
        count = int(self._max(torch.tensor([float(len(out) if sequences else 0)]), env)[0])
        return (out if sequences else []) + [[] for _ in range(count - (len(out) if sequences else 0))]

    def _pack(self, members: list[int], s) -> tuple[dict[str, torch.Tensor], torch.Tensor]:  # noqa: ANN001
        c = self.current
        return pack([c.sequences[i] for i in members], [c.targets[i] for i in members], self.prompts.pad_id,
                    self.prompts.max_length, self.prompts.packing, s.env.device, self.prompts.attention,
                    self.prompts.pattern)  # fmt: skip

    @staticmethod
    def _sum(t: torch.Tensor, env) -> torch.Tensor:  # noqa: ANN001
        if env.world_size > 1:
            t = t.to(env.device)
            dist.all_reduce(t)
        return t.cpu()

    @staticmethod
    def _max(t: torch.Tensor, env) -> torch.Tensor:  # noqa: ANN001
        if env.world_size > 1:
            t = t.to(env.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.cpu()

    # ------------------------------------------------------------ the micro-batches

    def accumulate(self, s, step, scale: float) -> torch.Tensor:  # noqa: ANN001
        c, cfg, env = self.current, self.s, s.env
        sums = torch.zeros(len(self.names), device=env.device, dtype=torch.float32)
        n_micro = len(c.micro)
        for i, members in enumerate(c.micro):
            if not s.reduce_each_microbatch:
                s.model.set_requires_gradient_sync(i == n_micro - 1)
            batch, slot = self._pack(members, s)
            logp, _ = head_logps(s.model, s.head_loss, batch, cfg.sampling.temperature)
            if not members:  # a filler micro-batch: the same backward (and collectives) as every rank's, the output
                # layer's included (its log-probabilities of no tokens)
                (logp.sum() * 0.0).backward()
                continue
            loss, kl = self.token_losses(logp, batch["labels"], slot, members, c.reference[i] if c.reference else None)
            weight = self._weights(batch["labels"], slot, members, c, i)
            total = (loss * weight).sum()
            (total * scale).backward()
            sums[0] += total.detach()
            if kl is not None:
                sums[1] += kl.sum().detach()
        return sums

    def token_losses(self, logp: torch.Tensor, labels: torch.Tensor, slot: torch.Tensor, members: list[int],
                     reference: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """[batch, length] per-token loss (0 where no completion token is predicted), and its k3 (beta > 0)."""
        cfg, c = self.s, self.current
        owner = torch.nn.functional.pad(slot[:, 1:], (0, 1), value=-1)  # the sequence of the token each position predicts
        on = (next_token_targets(labels) != IGNORE_INDEX) & (owner >= 0)
        adv = c.advantages.to(logp.device)[torch.tensor(members, device=logp.device)[owner.clamp(min=0)]]
        adv = torch.where(on, adv, torch.zeros_like(adv))
        ratio = torch.exp(logp - logp.detach())
        clipped = torch.clamp(ratio, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
        loss = -torch.min(ratio * adv, clipped * adv)
        kl = None
        if cfg.beta > 0 and reference is not None:
            d = reference.to(logp.device) - logp
            kl = torch.where(on, torch.exp(d) - d - 1, torch.zeros_like(d))
            loss = loss + cfg.beta * ratio * kl
        return torch.where(on, loss, torch.zeros_like(loss)), kl

    def _weights(self, labels: torch.Tensor, slot: torch.Tensor, members: list[int], c: StepCompletions,
                 micro: int) -> torch.Tensor:  # fmt: skip
        """What each position's loss is divided by, for --loss_type (0 where nothing is predicted)."""
        cfg = self.s
        owner = torch.nn.functional.pad(slot[:, 1:], (0, 1), value=-1)
        on = ((next_token_targets(labels) != IGNORE_INDEX) & (owner >= 0)).float()
        t = c.totals
        if cfg.loss_type == "dapo":
            return on / max(1.0, t["tokens"])
        if cfg.loss_type == "dr_grpo":
            return on / (max(1.0, t["completions"]) * cfg.sampling.max_new_tokens)
        if cfg.loss_type == "bnpo":
            micro_total = len(c.micro) * max(1, dist.get_world_size() if dist.is_initialized() else 1)
            return on / (max(1.0, c.micro_tokens[micro]) * micro_total)
        # grpo: each completion's token mean, averaged over the step's completions
        per_seq = torch.tensor([max(1, sum(c.targets[i])) for i in members], dtype=torch.float32, device=labels.device)
        return on / (per_seq[owner.clamp(min=0)] * max(1.0, t["completions"]))

    def first_loss(self, s, first) -> torch.Tensor:  # noqa: ANN001
        """The next-token loss of this rank's first prompts (a forward whose loss must be finite: the fp16 probe)."""
        total = torch.zeros(2, device=s.env.device, dtype=torch.float32)
        mine = [int(p) for p in first.micro_batches[0]][: s.plan.batch_size] if first is not None else []
        ids = [self.prompts.ids[p] for p in mine]
        batch, _ = pack(ids, [[True] * len(q) for q in ids], self.prompts.pad_id, self.prompts.max_length,
                        self.prompts.packing, s.env.device, self.prompts.attention, self.prompts.pattern)  # fmt: skip
        logp = token_logps(s.model(**model_inputs(batch)).logits, batch["labels"], None)
        if ids:
            on = next_token_targets(batch["labels"]) != IGNORE_INDEX
            total[0] = -(logp * on).sum()
            total[1] = on.sum()
        return total

    def record(self, sums: dict[str, float], step, seconds: float) -> dict[str, Any]:  # noqa: ANN001
        """The step's metrics: rewards, completion lengths, the KL, generation's share of the step."""
        t, cfg = self.current.totals, self.s
        completions = max(1.0, t["completions"])
        out: dict[str, Any] = {
            "tokens": int(t["tokens"]), "tokens_seen": int(t["seen"]), "completions": int(t["completions"]),
            "reward": t["reward_sum"] / max(1.0, t["reward_count"]), "reward_std": t["reward_std"],
            **{f"reward_{r.name}": t[f"reward_{r.name}"] for r in cfg.rewards},
            "completion_length": t["generated"] / completions, "completion_length_max": int(t["length_max"]),
            "truncated": t["truncated"] / completions, "zero_std_groups": t["zero_std"] / completions,
            "kl": sums["kl"] / max(1.0, t["tokens"]) if cfg.beta > 0 else None,
            "generation_share": min(1.0, t["generation_seconds"] / seconds) if seconds > 0 else 0.0,
            "generated_tokens_per_second": t["generated"] / max(1e-9, t["generation_seconds"]),
        }  # fmt: skip
        if self.current.source_tokens is not None:  # a mixture: beside source_rows (the step plan's)
            out["source_tokens"] = self.current.source_tokens
        return out


def held_out_rewards(model, prompts, tokenizer, settings: GroupSettings, env, batch_size: int = 0) -> dict[str, Any]:  # noqa: ANN001
    """One greedy completion of each held-out prompt (this rank's share: every world_size-th), scored: the mean reward
    in total and per function, over ranks, and this rank's completions."""
    mine = list(range(env.rank, len(prompts), env.world_size))
    greedy = Sampling(settings.sampling.max_new_tokens, top_k=1)
    keys = torch.zeros(len(mine), dtype=torch.int64)
    with gathered(model, settings.gather):
        made: Generated = generate(model, [prompts.ids[p] for p in mine], keys, greedy, eos_ids=settings.eos_ids,
                                   pad_id=prompts.pad_id, device=env.device, stop=settings.stop, tokenizer=tokenizer,
                                   synced=not settings.gather and env.world_size > 1, batch_size=batch_size)  # fmt: skip
    loss = GroupLoss(settings, prompts, tokenizer)
    texts = [loss._text(ids, e) for ids, e in zip(made.ids, made.ended)]
    completions = [[{"role": "assistant", "content": t}] for t in texts] if prompts.conversational else texts
    rows = [int(prompts.index[p]) for p in mine]
    columns = prompts.column_lists(mine)
    per_func = all_ranks_ok(lambda: score(settings.rewards, [prompts.rows[p]["prompt"] for p in mine], completions,
                                          made.ids, columns, rows, made.ended))  # fmt: skip
    per_func = torch.tensor(per_func, dtype=torch.float32).view(len(mine), len(settings.rewards))
    weights = torch.tensor(settings.weights, dtype=torch.float32)
    reward = (per_func * weights).nansum(dim=1)
    reward[torch.isnan(per_func).all(dim=1)] = math.nan
    stats = torch.cat([nan_stats(reward)[:2], *(nan_stats(per_func[:, j])[:2] for j in range(len(settings.rewards)))])
    stats = GroupLoss._sum(stats, env)
    out: dict[str, Any] = {"reward": float(stats[1] / max(1.0, float(stats[0]))), "prompts": len(prompts)}
    for j, r in enumerate(settings.rewards):
        out[f"reward_{r.name}"] = float(stats[2 + 2 * j + 1] / max(1.0, float(stats[2 + 2 * j])))
    out["samples"] = [{"row": r, "completion": t, "reward": None if math.isnan(float(v)) else float(v)}
                      for r, t, v in zip(rows, texts, reward.tolist())]  # fmt: skip
    return out
