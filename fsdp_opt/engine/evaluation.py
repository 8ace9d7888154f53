"""Held-out loss and generation on any number of ranks. Each rank takes every world_size-th block; ranks with fewer
blocks run filler rows (no targets), so every rank makes the same forward calls, which a sharded model needs. Sums of
loss and target tokens are all-reduced."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from fsdp_opt.data.blocks import IGNORE_INDEX, Blocks
from fsdp_opt.engine.loss import HeadLoss, forward_loss_sum
from fsdp_opt.runtime.distributed import DistEnv


def rank_batches(num_blocks: int, batch_size: int, rank: int, world_size: int) -> list[torch.Tensor]:
    """This rank's block indices in micro-batches; -1 pads so every rank has the same batch shapes and count."""
    per_rank = math.ceil(num_blocks / world_size)
    mine = torch.arange(rank, num_blocks, world_size)
    mine = torch.cat([mine, torch.full((per_rank - len(mine),), -1, dtype=mine.dtype)])
    return [mine[i : i + batch_size] for i in range(0, per_rank, batch_size)]


@torch.no_grad()
def evaluate_loss(model: nn.Module, blocks: Blocks, batch_size: int, env: DistEnv) -> dict[str, float]:
    """{"loss": token-mean loss, "perplexity": exp(loss), "tokens": target tokens} over all of `blocks`. The output
    layer runs at the target tokens only where the model allows it (engine/loss.py HeadLoss), as in training."""
    head = HeadLoss.for_run(model, 0)
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)
    try:
        for index in rank_batches(len(blocks), batch_size, env.rank, env.world_size):
            batch = blocks.batch(index, env.device)
            totals[0] += forward_loss_sum(model, head, batch)[1].double()
            totals[1] += (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    finally:
        model.train(was_training)
    if env.world_size > 1:
        dist.all_reduce(totals)
    loss_sum, tokens = totals.tolist()
    loss = loss_sum / max(1.0, tokens)
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(tokens)}


@torch.no_grad()
def generate(
    model: nn.Module,
    tokenizer,
    prompts: list[str],
    env: DistEnv,
    *,
    max_new_tokens: int,
    do_sample: bool,
    temperature: float,
    top_p: float,
    seed: int,
    rendered: bool = False,
    stop: str | None = None,
) -> list[str]:
    """Continuations of each prompt. Every rank runs the same calls with the same seed (a sharded model
    gathers its weights in each forward), so all ranks produce the same text.

    `rendered` prompts come from a chat template, which writes its own special tokens: they are tokenized without
    the tokenizer's. With `stop` (the template's end-of-turn marker) generation ends at the marker, which the text
    keeps, so a reader sees whether the answer ended as the template says."""
    model.eval()
    outputs = []
    for prompt in prompts:
        torch.manual_seed(seed)
        enc = tokenizer(prompt, return_tensors="pt", add_special_tokens=not rendered)
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_p": top_p} if do_sample else {"do_sample": False}
        )
        if stop is not None:
            sampling.update(stop_strings=[stop], tokenizer=tokenizer)
        out = model.generate(
            input_ids=enc["input_ids"].to(env.device),
            attention_mask=enc["attention_mask"].to(env.device),
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            use_cache=True,
            **sampling,
        )
        new = out[0, enc["input_ids"].shape[1] :]
        if stop is None:
            outputs.append(tokenizer.decode(new, skip_special_tokens=True))
            continue
        text = tokenizer.decode(new, skip_special_tokens=False)
        if stop in text:
            text = text[: text.index(stop) + len(stop)]
        outputs.append(text.replace(tokenizer.pad_token or "\0", ""))
    return outputs
