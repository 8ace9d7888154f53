"""Preference pairs (--method dpo) as token sequences, and the order in which steps take them.

A pair is two sequences, prompt + chosen and prompt + rejected, tokenized as a prompt/completion row is
(data/tokens.py): their targets are the answer's tokens. A sequence longer than --max_length keeps its start and is
cut at the end; a pair with an answer left without a token is dropped and counted.

Both sequences of a pair sit in the same micro-batch, so the pair's loss sees both. Under --packing docs a
micro-batch is --batch_size blocks of --max_length tokens and each sequence is a document of its own in them (the
same mask and positions as any packed document); under --packing pad it is --batch_size pairs, a row per sequence.
An epoch's pairs are shuffled by the seed and the epoch, then laid into micro-batches in that order, as many pairs
as fit; a step is --accum_steps micro-batches on each rank, and its loss is the mean over its pairs. The position a
checkpoint keeps is the count of pairs of the epoch trained.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from fsdp_opt.base import DataError
from fsdp_opt.data.blocks import StepBatch, count_by_source, epoch_order
from fsdp_opt.data.formats import Rows, RowSpec
from fsdp_opt.data.packing import MaskPattern
from fsdp_opt.data.sequences import fits, pack
from fsdp_opt.data.tokens import encode_rows


@dataclass(frozen=True)
class PairFit:
    """What fitting the pairs into --max_length cost."""

    pairs: int
    cut: int = 0  # sequences cut at their end
    dropped: int = 0  # pairs with an answer left without a token
    identical: int = 0  # pairs whose chosen answer is the rejected one (dropped before tokenizing)

    def describe(self) -> str:
        return (
            f"{self.cut} of {2 * self.pairs} sequences longer than --max_length were cut at their end; "
            f"{self.dropped} pair(s) left with an answer of no token and {self.identical} whose chosen answer "
            "is the rejected one were dropped"
        )


class Pairs:
    """The pairs of a slice: sequence 2k is pair k's chosen answer, 2k+1 its rejected one (a unit of two sequences,
    keyed by its dataset row: engine/logprobs.py)."""

    per_unit = 2
    noun = "pair"

    def __init__(
        self,
        ids: list[list[int]],
        targets: list[list[bool]],
        index: list[int],
        pad_id: int,
        max_length: int,
        packing: str,
        attention: str = "sdpa",
        pattern: MaskPattern | None = None,
        fit: PairFit | None = None,
        sources: list[int] | None = None,
        source_names: list[str] | None = None,
    ) -> None:
        self.ids, self.targets, self.pad_id, self.max_length = ids, targets, pad_id, max_length
        # a mixture's pairs: each one's source
        self.sources = torch.tensor(sources, dtype=torch.long) if sources is not None else None
        self.source_names = source_names
        self.index = torch.tensor(index, dtype=torch.long)  # each pair's row in the dataset
        self.packing, self.attention, self.pattern, self.fit = packing, attention, pattern, fit
        self.lengths = torch.tensor([len(s) for s in ids], dtype=torch.long)
        # the answer's tokens a sequence's loss reads: targets past the first token
        self.answer_tokens = torch.tensor([sum(t[1:]) for t in targets], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.ids) // 2

    @property
    def keys(self) -> torch.Tensor:
        return self.index

    @property
    def sequences(self) -> int:
        return len(self.ids)

    def digest(self) -> str:
        """A fingerprint of the pairs' tokens and targets (the data pin's)."""
        digest = hashlib.sha256()
        for ids, targets in zip(self.ids, self.targets):
            digest.update(torch.tensor(ids, dtype=torch.int32).numpy().tobytes())
            digest.update(torch.tensor(targets, dtype=torch.bool).numpy().tobytes() + b"|")
        return digest.hexdigest()[:32]

    def source_totals(self, pairs: Sequence[int] | None = None) -> dict[str, list[int]] | None:
        """A mixture's pairs (all, or these): the pairs each source gave, and their answers' tokens."""
        if self.sources is None:
            return None
        index = torch.arange(len(self)) if pairs is None else torch.tensor(pairs, dtype=torch.long)
        tokens = self.answer_tokens[2 * index] + self.answer_tokens[2 * index + 1]
        return count_by_source(self.sources[index], len(self.source_names), tokens)

    def fits(self, pairs: Sequence[int], batch_size: int) -> bool:
        """Whether these pairs' sequences fit one micro-batch."""
        if self.packing == "pad":
            return len(pairs) <= batch_size
        return fits(self._sizes(pairs), self.max_length, self.packing, batch_size)

    def _sizes(self, pairs: Sequence[int]) -> list[int]:
        return [int(self.lengths[2 * p + k]) for p in pairs for k in (0, 1)]

    def micro(self, pairs: Sequence[int], device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """A micro-batch of these pairs: the model's inputs with labels (Blocks.batch), and for each position the
        micro-batch's sequence (2j chosen and 2j+1 rejected of its j-th pair) its token belongs to, -1 elsewhere."""
        seqs = [2 * p + k for p in pairs for k in (0, 1)]
        return pack(
            [self.ids[s] for s in seqs],
            [self.targets[s] for s in seqs],
            self.pad_id,
            self.max_length,
            self.packing,
            device,
            self.attention,
            self.pattern,
        )


def pairs_from_rows(
    rows: Rows,
    spec: RowSpec,
    tokenizer,
    *,
    max_length: int,
    packing: str,
    attention: str = "sdpa",
    pattern: MaskPattern | None = None,
) -> Pairs:
    """The checked preference rows of a slice as Pairs: each pair's two sequences tokenized as prompt/completion rows
    are (the prompt's tokens first, the answer's carry the loss), cut at max_length."""
    flat = [{"prompt": r["prompt"], "completion": r[k]} for r in rows.rows for k in ("chosen", "rejected")]
    as_rows = RowSpec("prompt_completion", prompt_column=spec.prompt_column, completion_column=spec.chosen_column)
    encoded = encode_rows(
        flat,
        as_rows,
        tokenizer,
        train_on="completion",
        indices=[i for i in rows.indices for _ in (0, 1)],
        conversational=rows.conversational,
    )
    ids, targets, index, kept, cut, dropped = [], [], [], [], 0, 0
    for k, row_index in enumerate(rows.indices):
        pair = []
        for s in (2 * k, 2 * k + 1):
            seq, mask = encoded.ids[s], encoded.targets[s]
            if len(seq) > max_length:
                cut += 1
                seq, mask = seq[:max_length], mask[:max_length]
            pair.append((seq, mask))
        if not all(any(mask[1:]) for _, mask in pair):
            dropped += 1
            continue
        for seq, mask in pair:
            ids.append(seq)
            targets.append(mask)
        index.append(row_index)
        kept.append(k)
    if not index:
        raise DataError(f"--max_length {max_length}: no pair keeps a token of both answers once cut to this length")
    fit = PairFit(len(rows.rows) + rows.identical, cut, dropped, rows.identical)
    sources = [rows.sources[k] for k in kept] if rows.sources is not None else None
    return Pairs(
        ids,
        targets,
        index,
        tokenizer.pad_token_id,
        max_length,
        packing,
        attention,
        pattern,
        fit,
        sources,
        rows.source_names,
    )


class PairPlan:
    """The steps of each epoch over pairs (or over KTO's unpaired items, data/unpaired.py: a unit of one sequence):
    StepPlan's interface (data/blocks.py), with units for samples."""

    def __init__(self, pairs: Pairs, *, batch_size: int, accum_steps: int, rank: int, world_size: int, seed: int):
        self.pairs = pairs
        self.num_samples = len(pairs)
        self.batch_size, self.accum_steps = batch_size, accum_steps
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.micro_global = batch_size * world_size
        self.global_batch = self.micro_global * accum_steps  # blocks (pad: pairs) per step, as --batch_size counts
        self._epochs: dict[int, list[list[int]]] = {}
        for p in range(len(pairs)):
            if not pairs.fits([p], batch_size):
                raise DataError(
                    f"--batch_size {batch_size}: the {pairs.noun} of row {int(pairs.index[p])} does not fit a "
                    f"micro-batch of {batch_size} block(s) of --max_length {pairs.max_length}; use "
                    "--batch_size 2 or more"
                )

    def epoch_order(self, epoch: int) -> torch.Tensor:
        return epoch_order(self.seed, epoch, self.num_samples)

    def micro_batches(self, epoch: int) -> list[list[int]]:
        """The epoch's pairs, in its order, laid into micro-batches: as many as fit each."""
        if epoch not in self._epochs:
            out: list[list[int]] = [[]]
            for p in self.epoch_order(epoch).tolist():
                if out[-1] and not self.pairs.fits(out[-1] + [p], self.batch_size):
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
            pairs = [p for m in step for p in m]
            done += len(pairs)
            if done <= start_offset:
                continue
            grid = step + [[] for _ in range(self.world_size * self.accum_steps - len(step))]
            mine = [grid[m * self.world_size + self.rank] for m in range(self.accum_steps)]
            per = self.pairs.per_unit
            seqs = torch.tensor([per * p + j for p in pairs for j in range(per)], dtype=torch.long)
            yield StepBatch(
                epoch=epoch,
                step_in_epoch=k,
                micro_batches=mine,
                samples=len(pairs),
                target_tokens=int(self.pairs.answer_tokens[seqs].sum()),
                seen_tokens=int(self.pairs.lengths[seqs].sum()),
                end_offset=done,
                units=len(pairs),
                by_source=self.pairs.source_totals(pairs),
            )
