"""Prompt rows (--method grpo) as token ids, and the order in which steps take them.

A prompt is tokenized as a prompt/completion row's prompt is (data/tokens.py encode_prompts). A prompt longer than
--max_length less --max_completion_length leaves no room for its completion: it is dropped and counted. The row's
other columns stay with it, for the reward functions.

A step takes --global_batch completions (batch x ranks x accumulation, whatever the packing): a whole number of
groups of --num_generations, so global_batch / G prompts. An epoch's prompts are shuffled by the seed and the epoch,
then taken that many at a time; each rank generates for every world_size-th prompt of the step. The position a
checkpoint keeps is the count of prompts of the epoch trained.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from fsdp_opt.base import ConfigError, DataError
from fsdp_opt.data.blocks import GenerationSlot, StepBatch, count_by_source, epoch_order
from fsdp_opt.data.formats import Rows
from fsdp_opt.data.sequences import Fit, Packing, Sequences
from fsdp_opt.data.tokens import encode_prompts


class Prompts(Sequences):
    """The prompts of a slice: token ids (each all targets: a forward over them is the fp16 probe's), the rows
    themselves (prompt and other columns), each row's dataset index."""

    noun = "prompt"

    def __init__(self, ids: list[list[int]], rows: list[dict[str, Any]], *args, conversational: bool, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(ids, [[True] * len(q) for q in ids], *args, **kwargs)
        self.rows, self.conversational = rows, conversational
        # the columns besides the prompt that any row has (a mixture's sources may differ)
        self.column_names = list(dict.fromkeys(k for row in rows for k in row if k != "prompt"))

    def digest(self) -> str:
        """A fingerprint of the prompts' tokens (the data pin's)."""
        digest = hashlib.sha256()
        for ids in self.ids:
            digest.update(torch.tensor(ids, dtype=torch.int32).numpy().tobytes() + b"|")
        return digest.hexdigest()[:32]

    def source_totals(self, taken: Sequence[int] | torch.Tensor | None = None) -> dict[str, list[int]] | None:
        """A mixture's prompts (all, or these): how many each source gave (their completions' tokens are known once
        sampled)."""
        if self.sources is None:
            return None
        return count_by_source(self.sources if taken is None else self.sources[taken], len(self.source_names))

    def columns(self, prompt: int) -> dict[str, Any]:
        """A row's columns besides its prompt (what the reward functions get as keyword arguments)."""
        return {k: v for k, v in self.rows[prompt].items() if k != "prompt"}

    def column_lists(self, prompts: Sequence[int]) -> dict[str, list[Any]]:
        """The reward functions' keyword arguments for these prompts: each column's values in their order. A mixture's
        sources may hold other columns: a row without one gives None for it."""
        return {k: [self.rows[p].get(k) for p in prompts] for k in self.column_names}


def prompts_from_rows(rows: Rows, tokenizer, packing: Packing, *, max_completion_length: int) -> Prompts:
    """The checked prompt rows of a slice as Prompts; a prompt with no room left for a completion is dropped."""
    ids = encode_prompts([r["prompt"] for r in rows.rows], tokenizer, rows.indices)
    max_length = packing.max_length
    room = max_length - max_completion_length
    kept = [k for k, row_ids in enumerate(ids) if len(row_ids) <= room]
    if not kept:
        raise DataError(
            f"--max_length {max_length}: no prompt of this slice leaves --max_completion_length "
            f"{max_completion_length} tokens for its completion (the shortest has {min(map(len, ids))} "
            "tokens)"
        )
    fit = Fit(
        len(ids),
        "prompt",
        dropped=len(ids) - len(kept),
        why_dropped="longer than --max_length less --max_completion_length (no room for their completions)",
    )
    sources = [rows.sources[k] for k in kept] if rows.sources is not None else None
    return Prompts(
        [ids[k] for k in kept],
        [rows.rows[k] for k in kept],
        [rows.indices[k] for k in kept],
        packing,
        fit,
        sources,
        rows.source_names,
        conversational=rows.conversational,
    )


def check_groups(global_batch: int, generations: int) -> int:
    """The prompts of a step: its completions must be a whole number of groups."""
    if global_batch % generations:
        raise ConfigError(
            f"--num_generations {generations}: a step's {global_batch} completions (--global_batch, or "
            f"--batch_size x ranks x --accum_steps) are not a whole number of groups of {generations}; "
            f"use a global batch that is a multiple of it"
        )
    return global_batch // generations


def generation_slices(steps_per_generation: int | None, accum_steps: int | None) -> int:
    """The optimizer steps' worth of prompts one generation takes: --steps_per_generation in steps of --accum_steps
    (None: not decided yet, --batch_size auto; checked again once it is)."""
    if accum_steps is None:
        return 1
    spg = steps_per_generation or accum_steps
    if spg % accum_steps:
        raise ConfigError(
            f"--steps_per_generation {spg}: must be a multiple of --accum_steps ({accum_steps}), so that "
            "a generation feeds whole optimizer steps"
        )
    return spg // accum_steps


class PromptPlan:
    """The steps of each epoch over prompts: StepPlan's interface (data/blocks.py), with prompts for samples. A
    step's `micro_batches` holds one entry, this rank's prompts: its micro-batches of completions are laid out once
    they are generated (engine/grpo.py).

    A generation takes `slices` steps' worth of prompts (--steps_per_generation / --accum_steps) and feeds
    slices x `iterations` optimizer steps (--num_iterations): its slices in order, then again. The position a
    checkpoint keeps is the generation's start until its last step is done (with the steps done of it, `within`),
    then its end."""

    def __init__(
        self,
        prompts: Prompts,
        *,
        batch_size: int,
        accum_steps: int,
        rank: int,
        world_size: int,
        seed: int,
        generations: int,
        slices: int = 1,
        iterations: int = 1,
    ) -> None:
        self.prompts = prompts
        self.num_samples = len(prompts)
        self.batch_size, self.accum_steps, self.generations = batch_size, accum_steps, generations
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.global_batch = batch_size * world_size * accum_steps  # completions per step
        self.per_step = check_groups(self.global_batch, generations)
        self.slices, self.iterations = slices, iterations
        self.per_generation = self.per_step * slices

    def epoch_order(self, epoch: int) -> torch.Tensor:
        return epoch_order(self.seed, epoch, self.num_samples)

    def _generation_steps(self, begin: int) -> int:
        taken = min(self.per_generation, self.num_samples - begin)
        return -(-taken // self.per_step) * self.iterations

    def steps_per_epoch(self, start_offset: int = 0, within: int = 0) -> int:
        return (
            sum(self._generation_steps(b) for b in range(start_offset, self.num_samples, self.per_generation)) - within
        )

    def steps(self, epoch: int, start_offset: int = 0, within: int = 0) -> Iterator[StepBatch]:
        order = self.epoch_order(epoch)
        first_step = start_offset // self.per_step * self.iterations + within
        k = 0
        for begin in range(start_offset, self.num_samples, self.per_generation):
            taken = order[begin : begin + self.per_generation]
            parts = [taken[j : j + self.per_step] for j in range(0, taken.numel(), self.per_step)]
            mine = tuple(part[self.rank :: self.world_size] for part in parts)
            count = len(parts) * self.iterations
            for index in range(within if begin == start_offset else 0, count):
                iteration, j = divmod(index, len(parts))
                slot = GenerationSlot(begin=begin, index=index, count=count, slice=j, iteration=iteration, prompts=mine)
                yield StepBatch(
                    epoch=epoch,
                    step_in_epoch=first_step + k,
                    micro_batches=[mine[j]],
                    samples=parts[j].numel(),
                    target_tokens=0,
                    seen_tokens=0,
                    end_offset=begin + taken.numel() if index == count - 1 else begin,
                    units=1,
                    by_source=self.prompts.source_totals(parts[j]),
                    generation=slot,
                )
                k += 1


def row_key(row: dict[str, Any]) -> str:
    """A prompt row as JSON, for completions.jsonl."""
    return json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)
