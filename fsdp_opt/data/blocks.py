"""Rows -> tokens -> fixed-length blocks -> a rank-independent sequence of global batches.

Every rank builds the same blocks and the same order. The order of an epoch depends only on the seed
and the epoch; an optimizer step takes the next `global_batch` samples of that order. Which rank
computes which sample changes with the rank count; the samples of each step, and the step's loss,
do not. That is what lets a run continue on another number of GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from fsdp_opt.base import DataError
from fsdp_opt.config.choices import PACKING_MODES
from fsdp_opt.data.packing import document_mask, pack_documents

IGNORE_INDEX = -100


def tokenize(texts: Sequence[str], tokenizer, batch: int = 1000) -> list[list[int]]:
    """Token ids per row, EOS appended, no BOS: rows are separated by EOS once packed."""
    eos = tokenizer.eos_token_id
    out: list[list[int]] = []
    for i in range(0, len(texts), batch):
        ids = tokenizer(list(texts[i : i + batch]), add_special_tokens=False, verbose=False)["input_ids"]
        out.extend(row + [eos] for row in ids)
    return out


@dataclass
class Blocks:
    """Fixed-length training sequences, right-padded; `lengths` counts the real tokens of each.

    `positions` is set for document-aware blocks (`--packing docs`): each token's position inside its document,
    0 where a document starts. Such blocks are fed with `position_ids` and a block-diagonal causal mask, and a
    document's first token is never a target. Without it a block is one sequence, positions counted by the model.
    """

    input_ids: torch.Tensor  # [n, max_length] int32
    lengths: torch.Tensor  # [n] int64
    pad_id: int
    positions: torch.Tensor | None = None  # [n, max_length] int32
    attention: str = "sdpa"  # the model's attention implementation: the form the mask takes

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_length(self) -> int:
        return self.input_ids.shape[1]

    def target_counts(self) -> torch.Tensor:
        """Predicted tokens per block: every real token but the first of each document."""
        if self.positions is None:
            return (self.lengths - 1).clamp(min=0)
        valid = torch.arange(self.max_length)[None, :] < self.lengths[:, None]
        return ((self.positions != 0) & valid).sum(1)

    def batch(self, index: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
        """Rows `index` as model inputs; index -1 is a filler row that has no targets."""
        real = index >= 0
        rows = self.input_ids[index.clamp(min=0)].long()
        lengths = torch.where(real, self.lengths[index.clamp(min=0)], 0)
        pos = torch.arange(self.max_length)
        valid = pos[None, :] < lengths[:, None]
        rows = torch.where(valid, rows, self.pad_id)
        labels = torch.where(valid, rows, IGNORE_INDEX)
        if self.positions is not None:
            # Filler rows are one segment from position 0. A document's first token is no target.
            positions = torch.where(real[:, None], self.positions[index.clamp(min=0)].long(), pos[None, :])
            labels = torch.where(positions == 0, IGNORE_INDEX, labels)
            out = {"input_ids": rows.to(device, non_blocking=True), "labels": labels.to(device, non_blocking=True)}
            if not bool((positions == pos).all()):  # else: one full document per row, plain causal is the same
                positions = positions.to(device, non_blocking=True)
                out["position_ids"] = positions
                out["attention_mask"] = document_mask(positions, self.attention)
            return out
        out = {
            "input_ids": rows.to(device, non_blocking=True),
            "labels": labels.to(device, non_blocking=True),
        }
        if not bool(valid.all()):
            # NOTE: filler rows attend normally (mask 1) so no softmax row is all -inf; their labels are
            # all ignored. Full blocks pass no mask at all, which keeps SDPA on its causal fast path.
            out["attention_mask"] = (valid | ~real[:, None]).long().to(device, non_blocking=True)
        return out


MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword arguments of the model's forward from `Blocks.batch`: everything but the labels."""
    return {k: batch[k] for k in MODEL_INPUTS if k in batch}


def pack(rows: Sequence[Sequence[int]], max_length: int, pad_id: int) -> Blocks:
    """Concatenate rows in order and cut into max_length blocks; the last block is padded, nothing is dropped."""
    flat = torch.tensor([t for row in rows for t in row], dtype=torch.int32)
    n = -(-flat.numel() // max_length)
    ids = torch.full((n * max_length,), pad_id, dtype=torch.int32)
    ids[: flat.numel()] = flat
    lengths = torch.full((n,), max_length, dtype=torch.int64)
    if n:
        lengths[-1] = flat.numel() - (n - 1) * max_length
    return Blocks(ids.view(n, max_length), lengths, pad_id)


def pad_rows(rows: Sequence[Sequence[int]], max_length: int, pad_id: int) -> Blocks:
    """One block per row, truncated to max_length and right-padded (the original recipe)."""
    ids = torch.full((len(rows), max_length), pad_id, dtype=torch.int32)
    lengths = torch.empty(len(rows), dtype=torch.int64)
    for i, row in enumerate(rows):
        row = row[:max_length]
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        lengths[i] = len(row)
    return Blocks(ids, lengths, pad_id)


def build_blocks(texts: Sequence[str], tokenizer, max_length: int, packing: str, attention: str = "sdpa") -> Blocks:
    """--packing docs: whole documents per block, each seeing only itself; concat: rows joined and cut every
    max_length tokens; pad: one row per block, truncated and padded (the original recipe)."""
    rows = tokenize(texts, tokenizer)
    pad_id = tokenizer.pad_token_id
    if packing == "docs":
        ids, lengths, positions = pack_documents(rows, max_length, pad_id)
        blocks = Blocks(ids, lengths, pad_id, positions, attention)
    elif packing == "concat":
        blocks = pack(rows, max_length, pad_id)
    elif packing == "pad":
        blocks = pad_rows(rows, max_length, pad_id)
    else:
        raise ValueError(f"packing {packing!r}: one of {', '.join(PACKING_MODES)}")
    if int(blocks.target_counts().sum()) == 0:
        raise DataError("--dataset: the slice has no tokens to train on")
    return blocks


@dataclass(frozen=True)
class StepBatch:
    """One optimizer step as this rank sees it."""

    epoch: int
    step_in_epoch: int
    micro_batches: list[torch.Tensor]  # this rank's sample indices per micro-batch (-1 = filler)
    samples: int  # samples in the whole step, all ranks
    target_tokens: int  # predicted tokens in the whole step, all ranks: the loss denominator
    end_offset: int  # samples of this epoch consumed once the step is done


class StepPlan:
    """The global batches of each epoch, and this rank's share of each."""

    def __init__(self, blocks: Blocks, *, batch_size: int, accum_steps: int, rank: int, world_size: int, seed: int):
        self.num_samples = len(blocks)
        self.batch_size = batch_size
        self.accum_steps = accum_steps
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.micro_global = batch_size * world_size
        self.global_batch = self.micro_global * accum_steps
        self._targets = blocks.target_counts()

    def steps_per_epoch(self, start_offset: int = 0) -> int:
        return -(-(self.num_samples - start_offset) // self.global_batch)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def steps(self, epoch: int, start_offset: int = 0) -> Iterator[StepBatch]:
        order = self.epoch_order(epoch)
        first_step = start_offset // self.global_batch
        for k, begin in enumerate(range(start_offset, self.num_samples, self.global_batch)):
            samples = order[begin : begin + self.global_batch]
            yield StepBatch(
                epoch=epoch,
                step_in_epoch=first_step + k,
                micro_batches=self._rank_share(samples),
                samples=samples.numel(),
                target_tokens=int(self._targets[samples].sum()),
                end_offset=begin + samples.numel(),
            )

    def _rank_share(self, samples: torch.Tensor) -> list[torch.Tensor]:
        # Micro-batch m of rank r takes positions [m*G + r*B, m*G + (r+1)*B) of the step; a short last
        # step is topped up with filler rows so every rank runs the same number of passes.
        n_micro = -(-samples.numel() // self.micro_global)
        padded = torch.full((n_micro * self.micro_global,), -1, dtype=torch.long)
        padded[: samples.numel()] = samples
        grid = padded.view(n_micro, self.world_size, self.batch_size)
        return [grid[m, self.rank] for m in range(n_micro)]
