"""Rows -> tokens -> fixed-length blocks -> a rank-independent sequence of global batches.

Every rank builds the same blocks and the same order. The order of an epoch depends only on the seed
and the epoch; an optimizer step takes the next `global_batch` samples of that order. Which rank
computes which sample changes with the rank count; the samples of each step, and the step's loss,
do not. That is what lets a run continue on another number of GPUs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from fsdp_opt.base import DataError
from fsdp_opt.config.choices import PACKING_MODES
from fsdp_opt.data.formats import Rows, RowSpec
from fsdp_opt.data.packing import MaskPattern, model_masks, pack_documents
from fsdp_opt.data.tokens import Encoded, encode_rows

IGNORE_INDEX = -100


def tokenize(texts: Sequence[str], tokenizer) -> list[list[int]]:
    """Token ids of text rows: the tokenizer's own special tokens (a BOS where it adds one), then EOS."""
    return encode_rows([{"text": t} for t in texts], RowSpec("text"), tokenizer, train_on="all").ids


@dataclass(frozen=True)
class Fit:
    """What fitting whole rows into --max_length cost: rows cut at the end, the answer tokens lost with them, and rows
    left with no answer token (dropped)."""

    rows: int
    cut: int = 0
    dropped: int = 0
    targets: int = 0  # answer tokens of the rows before the cut
    targets_lost: int = 0

    def describe(self) -> str:
        share = self.targets_lost / self.targets if self.targets else 0.0
        return (
            f"{self.cut} of {self.rows} rows longer than --max_length were cut at its end ({share:.1%} of the answer "
            f"tokens lost); {self.dropped} left with no answer token were dropped"
        )


def fit_rows(encoded: Encoded, max_length: int) -> tuple[Encoded, Fit]:
    """Whole rows cut to max_length tokens (never split: a second piece would hold answers without their question);
    a row left without a target is dropped."""
    ids, targets, cut, dropped, total, lost = [], [], 0, 0, 0, 0
    for k, row in enumerate(encoded.ids):
        mask = encoded.targets[k] if encoded.targets is not None else [False] + [True] * (len(row) - 1)
        n = sum(mask)
        total += n
        if len(row) > max_length:
            cut += 1
            kept = sum(mask[:max_length])
            lost += n - kept
            row, mask = row[:max_length], mask[:max_length]
        if not any(mask):
            dropped += 1
            continue
        ids.append(row)
        targets.append(mask)
    fit = Fit(len(encoded.ids), cut, dropped, total, lost)
    return Encoded(ids, targets if encoded.targets is not None else None, encoded.whole_rows), fit


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
    targets: torch.Tensor | None = None  # [n, max_length] bool: the tokens that carry loss (None: every real one)
    fit: Fit | None = None  # whole rows (prompt_completion, messages): what fitting them into max_length cost
    pattern: MaskPattern | None = None  # the model's sliding windows, which the document mask applies too
    by_source: torch.Tensor | None = None  # a mixture's blocks: [n, sources, 2], the rows begun and tokens trained

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_length(self) -> int:
        return self.input_ids.shape[1]

    def digest(self) -> str:
        """A fingerprint of the token ids, lengths and targets (the data pin's)."""
        digest = hashlib.sha256()
        digest.update(self.input_ids.numpy().tobytes())
        digest.update(self.lengths.numpy().tobytes())
        if self.targets is not None:
            digest.update(self.targets.numpy().tobytes())
        return digest.hexdigest()[:32]

    def target_counts(self) -> torch.Tensor:
        """Predicted tokens per block: real tokens that carry loss, except a block's and each document's first."""
        return self.predicted().sum(1)

    def source_totals(self) -> dict[str, list[int]] | None:
        """A mixture's blocks: the rows and trained tokens each source gave them."""
        return None if self.by_source is None else source_counts(self.by_source.sum(0))

    def predicted(self) -> torch.Tensor:
        """[n, max_length]: the tokens that are predicted (target_counts counts them)."""
        pos = torch.arange(self.max_length)[None, :]
        ok = (pos < self.lengths[:, None]) & (pos > 0)
        if self.positions is not None:
            ok &= self.positions != 0
        if self.targets is not None:
            ok &= self.targets
        return ok

    def describe(self, packing_words: str) -> str:
        """What the slice became, for the summary's data line."""
        return f"{len(self)} {packing_words} of {self.max_length} tokens"

    def micro(self, index: torch.Tensor, device: torch.device) -> tuple[dict[str, torch.Tensor], None]:
        """A micro-batch of these blocks (as `Sequences.micro` gives one: with no sequence map, a block being one)."""
        return self.batch(torch.as_tensor(index, dtype=torch.long), device), None

    def batch(self, index: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
        """Rows `index` as model inputs; index -1 is a filler row that has no targets."""
        real = index >= 0
        rows = self.input_ids[index.clamp(min=0)].long()
        lengths = torch.where(real, self.lengths[index.clamp(min=0)], 0)
        pos = torch.arange(self.max_length)
        valid = pos[None, :] < lengths[:, None]
        rows = torch.where(valid, rows, self.pad_id)
        labels = torch.where(valid, rows, IGNORE_INDEX)
        if self.targets is not None:
            labels = torch.where(self.targets[index.clamp(min=0)], labels, IGNORE_INDEX)  # filler rows: none valid
        if self.positions is not None:
            # Filler rows are one segment from position 0. A document's first token is no target.
            positions = torch.where(real[:, None], self.positions[index.clamp(min=0)].long(), pos[None, :])
            labels = torch.where(positions == 0, IGNORE_INDEX, labels)
            out = {"input_ids": rows.to(device, non_blocking=True), "labels": labels.to(device, non_blocking=True)}
            if not bool((positions == pos).all()):  # else: one full document per row, plain causal is the same
                positions = positions.to(device, non_blocking=True)
                out["position_ids"] = positions
                out["attention_mask"] = model_masks(positions, self.attention, self.pattern)
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


def _mask(targets: Sequence[Sequence[bool]] | None, n: int, max_length: int) -> torch.Tensor | None:
    return None if targets is None else torch.zeros((n, max_length), dtype=torch.bool)


def pack(
    rows: Sequence[Sequence[int]], max_length: int, pad_id: int, targets: Sequence[Sequence[bool]] | None = None
) -> Blocks:
    """Concatenate rows in order and cut into max_length blocks; the last block is padded, nothing is dropped."""
    flat = torch.tensor([t for row in rows for t in row], dtype=torch.int32)
    n = -(-flat.numel() // max_length)
    ids = torch.full((n * max_length,), pad_id, dtype=torch.int32)
    ids[: flat.numel()] = flat
    lengths = torch.full((n,), max_length, dtype=torch.int64)
    if n:
        lengths[-1] = flat.numel() - (n - 1) * max_length
    mask = _mask(targets, n, max_length)
    if mask is not None:
        mask.view(-1)[: flat.numel()] = torch.tensor([f for row in targets for f in row], dtype=torch.bool)
    return Blocks(ids.view(n, max_length), lengths, pad_id, targets=mask)


def pad_rows(
    rows: Sequence[Sequence[int]], max_length: int, pad_id: int, targets: Sequence[Sequence[bool]] | None = None
) -> Blocks:
    """One block per row, truncated to max_length and right-padded (the original recipe)."""
    ids = torch.full((len(rows), max_length), pad_id, dtype=torch.int32)
    lengths = torch.empty(len(rows), dtype=torch.int64)
    mask = _mask(targets, len(rows), max_length)
    for i, row in enumerate(rows):
        row = row[:max_length]
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        lengths[i] = len(row)
        if mask is not None:
            mask[i, : len(row)] = torch.tensor(targets[i][:max_length], dtype=torch.bool)
    return Blocks(ids, lengths, pad_id, targets=mask)


def build_blocks(
    texts: Sequence[str],
    tokenizer,
    max_length: int,
    packing: str,
    attention: str = "sdpa",
    pattern: MaskPattern | None = None,
) -> Blocks:
    """Text rows into blocks (see blocks_from)."""
    encoded = encode_rows([{"text": t} for t in texts], RowSpec("text"), tokenizer, train_on="all")
    return blocks_from(encoded, max_length, tokenizer.pad_token_id, packing, attention, pattern)


def rows_to_blocks(
    rows: Rows,
    spec: RowSpec,
    tokenizer,
    *,
    train_on: str,
    max_length: int,
    packing: str,
    attention: str = "sdpa",
    pattern: MaskPattern | None = None,
) -> Blocks:
    """The checked rows of a slice (data.formats) tokenized (data.tokens) and laid into blocks."""
    encoded = encode_rows(
        rows.rows, spec, tokenizer, train_on=train_on, indices=rows.indices, conversational=rows.conversational
    )
    blocks = blocks_from(encoded, max_length, tokenizer.pad_token_id, packing, attention, pattern)
    if rows.sources is not None:
        blocks.by_source = source_tallies(encoded, rows.sources, len(rows.source_names), blocks, packing)
    return blocks


def source_tallies(encoded: Encoded, sources: Sequence[int], n: int, blocks: Blocks, packing: str) -> torch.Tensor:
    """[blocks, n sources, 2]: how many rows each source begins in each block, and how many of its tokens are trained
    there. The rows are laid out once more with each token's id replaced by its source (the layout depends only on
    the rows' lengths and targets), so the tallies follow every cut, split and placement the packing made."""
    marks = [[n + j + 1] + [j + 1] * (len(ids) - 1) for ids, j in zip(encoded.ids, sources)]
    shadow = blocks_from(Encoded(marks, encoded.targets, encoded.whole_rows), blocks.max_length, 0, packing)
    ids, ok = shadow.input_ids.long(), blocks.predicted()
    begun = torch.stack([(ids == n + j + 1).sum(1) for j in range(n)], 1)
    trained = torch.stack([(ok & ((ids == j + 1) | (ids == n + j + 1))).sum(1) for j in range(n)], 1)
    return torch.stack([begun, trained], 2)


def blocks_from(
    encoded: Encoded,
    max_length: int,
    pad_id: int,
    packing: str,
    attention: str = "sdpa",
    pattern: MaskPattern | None = None,
) -> Blocks:
    """--packing docs: whole documents per block, each seeing only itself; concat: rows joined and cut every
    max_length tokens; pad: one row per block, truncated and padded (the original recipe).

    Whole rows (prompt_completion, messages) are cut at max_length, never split, under docs and pad; under concat
    every row is joined and cut like text. The targets travel with the tokens in each mode."""
    fit = None
    if encoded.whole_rows and packing != "concat":
        encoded, fit = fit_rows(encoded, max_length)
        if not encoded.ids:
            raise DataError(f"--max_length {max_length}: no row keeps an answer token once cut to this length")
    rows, targets = encoded.ids, encoded.targets
    if packing == "docs":
        ids, lengths, positions, mask = pack_documents(rows, max_length, pad_id, targets)
        blocks = Blocks(ids, lengths, pad_id, positions, attention, mask, pattern=pattern)
    elif packing == "concat":
        blocks = pack(rows, max_length, pad_id, targets)
    elif packing == "pad":
        blocks = pad_rows(rows, max_length, pad_id, targets)
    else:
        raise ValueError(f"packing {packing!r}: one of {', '.join(PACKING_MODES)}")
    blocks.fit = fit
    if int(blocks.target_counts().sum()) == 0:
        raise DataError("--dataset: the slice has no tokens to train on")
    return blocks


@dataclass(frozen=True)
class GenerationSlot:
    """Where a step stands in the generation it trains on (--method grpo): a generation's prompts are sampled at
    once, then trained a step's worth (a slice) at a time, each slice --num_iterations times, passes in order."""

    begin: int  # the epoch's position where the generation's prompts start
    index: int  # this step's place among the generation's steps (0: the step that samples it)
    count: int  # the generation's steps: its slices x --num_iterations
    slice: int  # the step's worth of its prompts this step trains
    iteration: int  # the pass over the generation (0-based)
    prompts: tuple[torch.Tensor, ...]  # this rank's prompts of each slice, in order


@dataclass(frozen=True)
class StepBatch:
    """One optimizer step as this rank sees it."""

    epoch: int
    step_in_epoch: int
    micro_batches: list[torch.Tensor]  # this rank's sample indices per micro-batch (-1 = filler)
    samples: int  # samples in the whole step, all ranks
    target_tokens: int  # predicted tokens in the whole step, all ranks: the loss denominator
    seen_tokens: int  # real (non-pad) tokens the step runs through the model, all ranks
    end_offset: int  # samples of this epoch consumed once the step is done
    units: int | None = None  # what the step's loss is a mean over, when not its target tokens (--method dpo: pairs)
    by_source: dict[str, list[int]] | None = None  # a mixture's step: the rows and tokens each source gave it
    generation: GenerationSlot | None = None  # a step that trains on sampled completions: its generation

    @property
    def loss_units(self) -> int:
        return self.target_tokens if self.units is None else self.units

    @property
    def within_after(self) -> int:
        """The generation's steps done once this step is (0: the generation is done, or there is none)."""
        g = self.generation
        return 0 if g is None or g.index + 1 == g.count else g.index + 1


def source_counts(tally: torch.Tensor) -> dict[str, list[int]]:
    """A step's [sources, 2] tally (rows, tokens) as its metrics record it."""
    return {"rows": tally[:, 0].tolist(), "tokens": tally[:, 1].tolist()}


def count_by_source(sources: torch.Tensor, n: int, tokens: torch.Tensor | None = None) -> dict[str, list[int]]:
    """Samples of one row each (pairs, prompts), from their sources: the rows each of n sources gave, and their
    tokens where they are known, as the metrics record them."""
    out = {"rows": torch.bincount(sources, minlength=n).tolist()}
    if tokens is not None:
        out["tokens"] = torch.bincount(sources, weights=tokens.double(), minlength=n).long().tolist()
    return out


def epoch_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    """The order of an epoch's n samples (blocks, pairs, prompts): from the seed and the epoch alone, never the rank
    count or the time."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


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
        self._lengths = blocks.lengths
        self._by_source = blocks.by_source

    def steps_per_epoch(self, start_offset: int = 0, within: int = 0) -> int:
        return -(-(self.num_samples - start_offset) // self.global_batch)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        return epoch_order(self.seed, epoch, self.num_samples)

    def steps(self, epoch: int, start_offset: int = 0, within: int = 0) -> Iterator[StepBatch]:
        """The epoch's steps from `start_offset` (`within`: the steps done of a generation, for plans that have
        generations; here always 0)."""
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
                seen_tokens=int(self._lengths[samples].sum()),
                end_offset=begin + samples.numel(),
                by_source=source_counts(self._by_source[samples].sum(0)) if self._by_source is not None else None,
            )

    def _rank_share(self, samples: torch.Tensor) -> list[torch.Tensor]:
        # Micro-batch m of rank r takes positions [m*G + r*B, m*G + (r+1)*B) of the step; a short last
        # step is topped up with filler rows so every rank runs the same number of passes.
        n_micro = -(-samples.numel() // self.micro_global)
        padded = torch.full((n_micro * self.micro_global,), -1, dtype=torch.long)
        padded[: samples.numel()] = samples
        grid = padded.view(n_micro, self.world_size, self.batch_size)
        return [grid[m, self.rank] for m in range(n_micro)]
