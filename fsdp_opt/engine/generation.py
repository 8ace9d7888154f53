"""Sampling completions from the policy (--method grpo): transformers' `generate` with its KV cache, on the model
gathered once.

- **The model gathered once.** A sharded model gathers every block in each forward, and a decoded token is a
  forward: generating on shards would gather the whole model once per token. `gathered` unshards every FSDP unit
  first, with resharding after forward switched off (each forward's hook would undo `unshard()` otherwise), and
  reshards and restores it after: no collective per token. Where the planner finds that the gathered model and the
  KV cache do not fit, generation runs on the shards instead (`gather=False`), every rank running every decoding
  step (transformers' `synced_gpus`) so no rank is left in a collective alone.
- **LoRA merged while gathered.** A decoding step on a GPU costs the host's kernel launches, not the GPU's time
  (benchmarks/decode_step.py: 12.7 ms for opt-1.3b's step, whose weights take 0.55 ms to read on an H200), and peft's
  adapters beside each weight took the trainer's step from 20.8 to 36.9 ms. Gathered, each adapted layer of a 16-bit
  base has its adapters added into the gathered copy of its weight (model/adapters.py `merge_adapters`) and taken out
  again before the reshard drops the copy: the weights FSDP keeps never change. The NF4 base and generation on the
  shards keep them beside.
- **Draws that depend on nothing but the completion.** Each completion's random numbers come from a counter:
  (seed, step, prompt row, place in the group, position in the completion) hashed to a uniform. A logits processor
  turns it into the token where the processed distribution's cumulative probability passes it (temperature, top-k,
  top-p as transformers samples; then inverse-CDF sampling), and generate's greedy choice takes that token.
  Generation stays batched, and a completion is the same whatever the rank, the rank count or the prompts beside it
  (bit for bit when the batches are the same: on the same number of GPUs, as a resumed session runs). No global
  random stream is read or reseeded: dropout's is left as it was.
- **Where a completion ends.** At its first end-of-text token (the tokenizer's, the generation config's, the chat
  template's end of turn when that is one token) or the first time its text holds the template's end-of-turn marker
  (several tokens, in a small tokenizer: generation stops when a row's last tokens are the marker's own, and the text
  is cut where the marker ends whichever tokens make it): the completion keeps that end. One that reaches
  --max_completion_length without it is truncated.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_opt.engine.decoding import Decoder, supports_static
from fsdp_opt.model.adapters import merge_adapters, unmerge_adapters
from fsdp_opt.model.gathering import forward_hooks_off, fsdp_groups, fsdp_units, gathered_copies

MASK32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """(a * b) mod 2^32 for a in [0, 2^32), in int64 without overflow (two 16-bit halves)."""
    return ((((a >> 16) * b) & 0xFFFF) << 16) + (a & 0xFFFF) * b & MASK32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer: every input bit moves every output bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def completion_keys(seed: int, step: int, rows: Sequence[int], places: Sequence[int]) -> torch.Tensor:
    """One 32-bit key per completion: its seed, optimizer step, prompt row and place in the group."""
    h = torch.full((len(rows),), (seed * 0x9E3779B1) & MASK32, dtype=torch.int64)
    for part in (
        torch.full_like(h, step & MASK32),
        torch.tensor(rows, dtype=torch.int64) & MASK32,
        torch.tensor(places, dtype=torch.int64) & MASK32,
    ):
        h = _fmix(h ^ _fmix(part + 0x68E31DA4 & MASK32))
    return h


def uniforms(keys: torch.Tensor, position: int) -> torch.Tensor:
    """[len(keys)] uniforms in (0, 1), float64: each completion's draw at one position of it."""
    h = _fmix(keys ^ _fmix(torch.full_like(keys, (position * 0x27D4EB2F + 0x165667B1) & MASK32)))
    low = _fmix(h ^ 0x2545F491)
    return ((h >> 8).double() * 16777216.0 + (low >> 8).double() + 0.5) / 2.0**48


class CounterSample:
    """A logits processor (transformers' interface) that makes generate's greedy choice a draw: from the processed
    scores' distribution (softmax), the token where the cumulative probability passes the completion's uniform for
    this position (inverse-CDF sampling). Every other token's score becomes -inf."""

    def __init__(self, keys: torch.Tensor, prompt_length: int) -> None:
        self.keys, self.prompt_length = keys, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        u = uniforms(self.keys, input_ids.shape[1] - self.prompt_length).to(scores.device)
        cdf = torch.softmax(scores.double(), dim=-1).cumsum(dim=-1)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).clamp(max=scores.shape[-1] - 1)
        out = torch.full_like(scores, -math.inf)
        return out.scatter_(1, pick, 0.0)


class StopOnTokens:
    """A stopping criterion (transformers' interface): a row is done once its last tokens are the stop text's
    (the chat template's end-of-turn marker where it is several tokens)."""

    def __init__(self, stop_ids: Sequence[int], prompt_length: int) -> None:
        self.stop = torch.tensor(list(stop_ids), dtype=torch.long)
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:  # noqa: ANN003
        n = len(self.stop)
        if input_ids.shape[1] - self.prompt_length < n:
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return (input_ids[:, -n:] == self.stop.to(input_ids.device)).all(dim=1)


@dataclass
class Sampling:
    """What decides a draw: TRL's names and meanings."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off; 1: the greedy choice (no noise matters)


@dataclass(kw_only=True)
class Decoding:
    """How a method that samples decodes its completions, decided once (engine/rollout.py `decode` reads it)."""

    sampling: Sampling
    seed: int  # the completions' draws are keyed by it, the step and the row
    eos_ids: list[int]
    stop: str | None  # the chat template's end-of-turn text, where it is several tokens
    gather: bool = True  # generate on the model gathered once (else on its shards)
    generation_batch: int = 0  # requests generated at once per rank (0: all)
    decoding: str = "static"  # --decoding


def processors(sampling: Sampling, keys: torch.Tensor, prompt_length: int):  # noqa: ANN201
    """temperature, top-k, top-p (as transformers samples), then the counter's draw."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    out = LogitsProcessorList()
    if sampling.temperature != 1.0:
        out.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        out.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        out.append(TopPLogitsWarper(sampling.top_p))
    if sampling.top_k != 1:
        out.append(CounterSample(keys, prompt_length))
    return out


@contextmanager
def gathered(model: nn.Module, gather: bool = True) -> Iterator[None]:
    """Every FSDP unit unsharded once for the block inside (and resharded after), in eval mode, LoRA adapters merged
    into the gathered copies of a 16-bit base's weights (taken out again before resharding, which drops the copies),
    FSDP's forward hooks off (model/gathering.py: a decoding step then runs the plain model, and a CUDA graph can
    capture it); without `gather`, only eval mode (each forward gathers as it runs)."""
    was_training = model.training
    model.eval()
    units = fsdp_units(model) if gather else []
    before = [_reshards(u) for u in units]
    merged: list[nn.Module] = []
    try:
        for u in units:
            u.set_reshard_after_forward(False, recurse=False)
        for u in units:
            u.unshard()
        if units:  # LoRA: the adapters added into the gathered copies of the weights (a 16-bit base)
            merged = merge_adapters(model, gathered_copies(model))
        with forward_hooks_off(model, units):  # every unit stays gathered: FSDP's forward hooks have nothing to do
            yield
    finally:
        unmerge_adapters(merged)
        for u in units:
            u.reshard()
        for u, was in zip(units, before):
            u.set_reshard_after_forward(was, recurse=False)
        model.train(was_training)


def _reshards(unit: nn.Module) -> bool:
    """Whether the unit reshards after forward now (what fully_shard was given, or set since)."""
    return any(g.post_forward_mesh_info is not None for g in fsdp_groups(unit))


@dataclass
class Generated:
    """One rank's completions, in the order of its requests: the tokens each keeps (its end included), and whether
    it ended (False: it reached --max_completion_length: truncated)."""

    ids: list[list[int]]
    ended: list[bool]


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    keys: torch.Tensor,
    sampling: Sampling,
    *,
    eos_ids: Sequence[int],
    pad_id: int,
    device: torch.device,
    stop: str | None = None,
    tokenizer=None,
    synced: bool = False,
    batch_size: int = 0,
    decoder: Decoder | None = None,
) -> Generated:  # noqa: ANN001
    """Completions of each prompt (left-padded into batches of `batch_size` requests, 0: all at once), each drawn
    with its own key. With a `decoder` (engine/decoding.py), each batch decodes with a static KV cache (replayed as a
    CUDA graph when it captures); without one, or `synced` (generation on the shards: every rank runs every decoding
    step), transformers' generate decodes."""
    stop_ids = tokenizer(stop, add_special_tokens=False)["input_ids"] if stop and tokenizer is not None else []
    ids_out: list[list[int]] = []
    ended_out: list[bool] = []
    size = batch_size or max(1, len(prompts))
    for start in range(0, max(1, len(prompts)), size):
        chunk = list(prompts[start : start + size])
        chunk_keys = keys[start : start + size]
        if not chunk:  # a rank with no prompt still runs the synced steps of the others
            chunk, chunk_keys = [[pad_id]], torch.zeros(1, dtype=torch.int64)
        longest = max(len(p) for p in chunk)
        warp = processors(sampling, chunk_keys, longest)
        if decoder is not None and not synced and supports_static(model):
            rows = decoder.decode(
                model,
                chunk,
                lambda ids, logits: warp(ids, logits).argmax(dim=-1),
                max_new_tokens=sampling.max_new_tokens,
                eos_ids=eos_ids,
                pad_id=pad_id,
                device=device,
                stop_ids=stop_ids,
            )
        else:
            rows = _hf_generate(model, chunk, warp, sampling, eos_ids, pad_id, device, stop_ids, synced)
        if start >= len(prompts):
            break
        for row in rows:
            kept, done = cut(row, eos_ids, stop, tokenizer)
            ids_out.append(kept)
            ended_out.append(done)
    return Generated(ids_out, ended_out)


def _hf_generate(
    model: nn.Module,
    chunk: list[Sequence[int]],
    warp,
    sampling: Sampling,
    eos_ids: Sequence[int],
    pad_id: int,
    device: torch.device,
    stop_ids: Sequence[int],
    synced: bool,
) -> list[list[int]]:  # noqa: ANN001
    """transformers' generate (its dynamic KV cache) of one left-padded batch: each row's generated tokens."""
    from transformers import GenerationConfig, StoppingCriteriaList

    longest = max(len(p) for p in chunk)
    input_ids = torch.full((len(chunk), longest), pad_id, dtype=torch.long)
    attention = torch.zeros((len(chunk), longest), dtype=torch.long)
    for i, p in enumerate(chunk):
        input_ids[i, longest - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        attention[i, longest - len(p) :] = 1
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=sampling.max_new_tokens,
        eos_token_id=list(eos_ids),
        pad_token_id=pad_id,
        use_cache=True,
        num_beams=1,
    )
    stopping = StoppingCriteriaList([StopOnTokens(stop_ids, longest)]) if stop_ids else None
    out = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        generation_config=config,
        logits_processor=warp,
        stopping_criteria=stopping,
        synced_gpus=synced,
    )
    return out[:, longest:].tolist()


def cut(tokens: list[int], eos_ids: Sequence[int], stop: str | None, tokenizer) -> tuple[list[int], bool]:  # noqa: ANN001
    """A generated row up to and including its end (an end-of-text token, or the tokens that complete the stop
    text), and whether it has one."""
    ends = set(eos_ids)
    first = next((i for i, t in enumerate(tokens) if t in ends), None)
    if stop and tokenizer is not None:
        upto = first + 1 if first is not None else len(tokens)
        holds = lambda k: stop in tokenizer.decode(tokens[:k], skip_special_tokens=False)  # noqa: E731
        if holds(upto):  # the fewest tokens whose text holds the marker (holding it only grows with k)
            low, high = 1, upto
            while low < high:
                mid = (low + high) // 2
                low, high = (low, mid) if holds(mid) else (mid + 1, high)
            return tokens[:low], True
    if first is not None:
        return tokens[: first + 1], True
    return tokens, False
