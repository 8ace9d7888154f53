"""Preference pairs (--method dpo, reward) as token sequences, and the order in which steps take whole units.

A pair is two sequences, prompt + chosen and prompt + rejected. For DPO each is tokenized as a prompt/completion row
is (data/tokens.py): its targets are the answer's tokens. For a reward model each is one whole text, as TRL's
RewardTrainer makes it (its score is read at its last token). A sequence longer than --max_length keeps its start
and is cut at the end; a pair with an answer left without a token is dropped and counted. A row's `margin` column,
where it has one, goes with its pair (the reward model's loss reads it).

Both sequences of a pair sit in the same micro-batch, so the pair's loss sees both. Under --packing docs a
micro-batch is --batch_size blocks of --max_length tokens and each sequence is a document of its own in them (the
same mask and positions as any packed document); under --packing pad it is --batch_size pairs, a row per sequence.

`UnitPlan` lays the units of any `Sequences` (pairs, KTO's items) into steps: an epoch's units shuffled by the seed
and the epoch, then laid into micro-batches in that order, as many units as fit; a step is --accum_steps micro-batches
on each rank, and its loss is the mean over its units. The position a checkpoint keeps is the count of units of the
epoch trained.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from fsdp_opt.base import DataError
from fsdp_opt.data.blocks import StepBatch, epoch_order
from fsdp_opt.data.formats import Rows, RowSpec
from fsdp_opt.data.sequences import Fit, Packing, Sequences
from fsdp_opt.data.tokens import encode_rows, encode_whole


class Pairs(Sequences):
    """The pairs of a slice: sequence 2k is pair k's chosen answer, 2k+1 its rejected one (a unit of two sequences,
    keyed by its dataset row: engine/logprobs.py); `margins`: each pair's margin column, where the rows have one."""

    per_unit = 2
    noun = "pair"
    margins: torch.Tensor | None = None

    def describe(self, packing_words: str) -> str:
        return f"{len(self)} preference pairs (2 sequences each, {packing_words} of {self.max_length} tokens)"


def pairs_from_rows(rows: Rows, spec: RowSpec, tokenizer, packing: Packing, *, whole: bool = False) -> Pairs:
    """The checked preference rows of a slice as Pairs: each pair's two sequences tokenized as prompt/completion rows
    are (the prompt's tokens first, the answer's carry the loss), or with `whole` as one text each (every token
    read), cut at --max_length."""
    flat = [{"prompt": r["prompt"], "completion": r[k]} for r in rows.rows for k in ("chosen", "rejected")]
    doubled = [i for i in rows.indices for _ in (0, 1)]
    if whole:
        ids = encode_whole([f["prompt"] + f["completion"] for f in flat], tokenizer, doubled)
        encoded_targets = [[True] * len(q) for q in ids]
    else:
        as_rows = RowSpec("prompt_completion", prompt_column=spec.prompt_column, completion_column=spec.chosen_column)
        encoded = encode_rows(
            flat, as_rows, tokenizer, train_on="completion", indices=doubled, conversational=rows.conversational
        )
        ids, encoded_targets = encoded.ids, encoded.targets
    max_length = packing.max_length
    kept_ids, targets, index, kept, cut, dropped = [], [], [], [], 0, 0
    for k, row_index in enumerate(rows.indices):
        pair = []
        for s in (2 * k, 2 * k + 1):
            seq, mask = ids[s], encoded_targets[s]
            if len(seq) > max_length:
                cut += 1
                seq, mask = seq[:max_length], mask[:max_length]
            pair.append((seq, mask))
        if not all(any(mask[1:]) for _, mask in pair):
            dropped += 1
            continue
        for seq, mask in pair:
            kept_ids.append(seq)
            targets.append(mask)
        index.append(row_index)
        kept.append(k)
    if not index:
        raise DataError(f"--max_length {max_length}: no pair keeps a token of both answers once cut to this length")
    fit = Fit(len(rows.rows) + rows.identical, "pair", cut, dropped, rows.identical)
    sources = [rows.sources[k] for k in kept] if rows.sources is not None else None
    pairs = Pairs(kept_ids, targets, index, packing, fit, sources, rows.source_names)
    if any("margin" in r for r in rows.rows):
        pairs.margins = torch.tensor([float(rows.rows[k].get("margin") or 0.0) for k in kept])
    return pairs


class UnitPlan:
    """The steps of each epoch over whole units (pairs, KTO's items, any `Sequences`): StepPlan's interface
    (data/blocks.py), with units for samples."""

    def __init__(
        self, units: Sequences, *, batch_size: int, accum_steps: int, rank: int, world_size: int, seed: int
    ) -> None:
        self.units = units
        self.num_samples = len(units)
        self.batch_size, self.accum_steps = batch_size, accum_steps
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.micro_global = batch_size * world_size
        self.global_batch = self.micro_global * accum_steps  # blocks (pad: units) per step, as --batch_size counts
        self._epochs: dict[int, list[list[int]]] = {}
        for p in range(len(units)):
            if not units.fits([p], batch_size):
                raise DataError(
                    f"--batch_size {batch_size}: the {units.noun} of row {int(units.index[p])} does not fit a "
                    f"micro-batch of {batch_size} block(s) of --max_length {units.max_length}; use "
                    "--batch_size 2 or more"
                )

    def epoch_order(self, epoch: int) -> torch.Tensor:
        return epoch_order(self.seed, epoch, self.num_samples)

    def micro_batches(self, epoch: int) -> list[list[int]]:
        """The epoch's units, in its order, laid into micro-batches: as many as fit each."""
        if epoch not in self._epochs:
            out: list[list[int]] = [[]]
            for p in self.epoch_order(epoch).tolist():
                if out[-1] and not self.units.fits(out[-1] + [p], self.batch_size):
                    out.append([])
                out[-1].append(p)
            self._epochs = {epoch: out}  # one epoch at a time
        return self._epochs[epoch]

    def _steps(self, epoch: int) -> list[list[list[int]]]:
        micro, per_step = self.micro_batches(epoch), self.world_size * self.accum_steps
        return [micro[i : i + per_step] for i in range(0, len(micro), per_step)]

    def steps_per_epoch(self, start_offset: int = 0, within: int = 0) -> int:
        done, count = 0, 0
        for step in self._steps(0 if not self._epochs else next(iter(self._epochs))):
            done += sum(len(m) for m in step)
            count += done > start_offset
        return count

    def steps(self, epoch: int, start_offset: int = 0, within: int = 0) -> Iterator[StepBatch]:
        done = 0
        for k, step in enumerate(self._steps(epoch)):
            units = [p for m in step for p in m]
            done += len(units)
            if done <= start_offset:
                continue
            grid = step + [[] for _ in range(self.world_size * self.accum_steps - len(step))]
            mine = [grid[m * self.world_size + self.rank] for m in range(self.accum_steps)]
            seqs = torch.tensor(self.units.sequences_of(units), dtype=torch.long)
            yield StepBatch(
                epoch=epoch,
                step_in_epoch=k,
                micro_batches=mine,
                samples=len(units),
                target_tokens=int(self.units.answer_tokens[seqs].sum()),
                seen_tokens=int(self.units.lengths[seqs].sum()),
                end_offset=done,
                units=len(units),
                by_source=self.units.source_totals(units),
            )
