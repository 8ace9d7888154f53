"""Whole sequences, each with the tokens that carry its loss, laid into one micro-batch: under --packing docs as
documents of their own in blocks of --max_length (the same mask and positions as any packed document), under
--packing pad a row each. A method whose loss reads each sequence apart (a preference pair's two answers, a
completion of a prompt) packs its micro-batches with this, and reads back which sequence each position belongs to.

`Sequences` is what the slice's rows become for every method that keeps its sequences whole (DPO's and a reward
model's pairs, KTO's items, GRPO's and distillation's prompts): `per_unit` sequences a unit (a pair: 2), each keyed by
its dataset row, with the fingerprint the data pin records, the rows and tokens each mixture source gave, and
micro-batches of as many units as fit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fsdp_opt.data.blocks import Blocks, count_by_source, pad_rows
from fsdp_opt.data.packing import MaskPattern, place, segment_positions


@dataclass(frozen=True)
class Packing:
    """How sequences are laid into a micro-batch: --max_length, --packing (docs, pad), the model's attention kernel
    and sliding windows (the document mask's form), the pad id."""

    pad_id: int
    max_length: int
    packing: str
    attention: str = "sdpa"
    pattern: MaskPattern | None = None

    def fits(self, lengths: Sequence[int], batch_size: int) -> bool:
        return fits(lengths, self.max_length, self.packing, batch_size)

    def pack(
        self, ids: Sequence[Sequence[int]], targets: Sequence[Sequence[bool]], device: torch.device
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return pack(ids, targets, self.pad_id, self.max_length, self.packing, device, self.attention, self.pattern)


def fits(lengths: Sequence[int], max_length: int, packing: str, batch_size: int) -> bool:
    """Whether sequences of these lengths fit one micro-batch of `batch_size` blocks (pad: rows)."""
    if packing == "pad":
        return len(lengths) <= batch_size
    return len(place(list(lengths), max_length)) <= batch_size


def pack(
    ids: Sequence[Sequence[int]],
    targets: Sequence[Sequence[bool]],
    pad_id: int,
    max_length: int,
    packing: str,
    device: torch.device,
    attention: str = "sdpa",
    pattern: MaskPattern | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A micro-batch of these sequences: the model's inputs with labels (Blocks.batch), and for each position the
    index (in `ids`) of the sequence its token belongs to, -1 elsewhere. No sequence: one filler row with no target,
    so every rank runs the same passes."""
    if not ids:
        blocks = Blocks(
            torch.full((1, max_length), pad_id, dtype=torch.int32), torch.zeros(1, dtype=torch.long), pad_id
        )
        batch = blocks.batch(torch.tensor([-1]), device)
        return batch, torch.full((1, max_length), -1, dtype=torch.long, device=device)
    if packing == "pad":
        blocks = pad_rows(list(ids), max_length, pad_id, list(targets))
        slot = torch.full((len(ids), max_length), -1, dtype=torch.long)
        for j, row in enumerate(ids):
            slot[j, : len(row)] = j
    else:
        groups = place([len(row) for row in ids], max_length)
        n = len(groups)
        tokens = torch.full((n, max_length), pad_id, dtype=torch.int32)
        positions = torch.empty((n, max_length), dtype=torch.int32)
        lengths = torch.empty(n, dtype=torch.long)
        mask = torch.zeros((n, max_length), dtype=torch.bool)
        slot = torch.full((n, max_length), -1, dtype=torch.long)
        for b, members in enumerate(groups):
            at, starts = 0, []
            for j in members:
                row = ids[j]
                starts.append(at)
                tokens[b, at : at + len(row)] = torch.tensor(row, dtype=torch.int32)
                mask[b, at : at + len(row)] = torch.tensor(targets[j], dtype=torch.bool)
                slot[b, at : at + len(row)] = j
                at += len(row)
            lengths[b] = at
            positions[b] = segment_positions(starts + ([at] if at < max_length else []), max_length)
        blocks = Blocks(tokens, lengths, pad_id, positions, attention, mask, pattern=pattern)
    batch = blocks.batch(torch.arange(len(blocks)), device)
    return batch, slot.to(device)


@dataclass(frozen=True)
class Fit:
    """What fitting a slice's rows into whole sequences cost: sequences cut at --max_length, units dropped (an answer
    left without a token, a prompt without room for its completion), rows whose answers are one (preference rows)."""

    units: int  # units made from the rows, before the drops
    what: str  # their noun ("pair", "item", "prompt")
    cut: int = 0
    dropped: int = 0
    identical: int = 0
    why_dropped: str = "left with an answer of no token"

    def describe(self) -> str:
        out = (
            f"{self.cut} sequence(s) longer than --max_length were cut at their end; {self.dropped} of {self.units} "
            f"{self.what}(s) {self.why_dropped} were dropped"
        )
        return out + (
            f"; {self.identical} row(s) whose two answers are the same were dropped" if self.identical else ""
        )


class Sequences:
    """The whole sequences of a slice: `per_unit` of them a unit (unit k's are sequences per_unit x k + j), each unit
    keyed by its dataset row, each sequence with its targets (the tokens that carry its loss)."""

    per_unit = 1
    noun = "sequence"

    def __init__(
        self,
        ids: list[list[int]],
        targets: list[list[bool]],
        index: list[int],
        packing: Packing,
        fit: Fit | None = None,
        sources: list[int] | None = None,
        source_names: list[str] | None = None,
    ) -> None:
        self.ids, self.targets, self.layout, self.fit = ids, targets, packing, fit
        self.index = torch.tensor(index, dtype=torch.long)  # each unit's row in the dataset
        # a mixture's units: each one's source
        self.sources = torch.tensor(sources, dtype=torch.long) if sources is not None else None
        self.source_names = source_names
        self.lengths = torch.tensor([len(s) for s in ids], dtype=torch.long)
        # the tokens a sequence's loss reads: targets past its first token
        self.answer_tokens = torch.tensor([sum(t[1:]) for t in targets], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.ids) // self.per_unit

    @property
    def max_length(self) -> int:
        return self.layout.max_length

    @property
    def packing(self) -> str:
        return self.layout.packing

    @property
    def pad_id(self) -> int:
        return self.layout.pad_id

    @property
    def keys(self) -> torch.Tensor:
        """Each unit's identity (its dataset row; a reference's log-probabilities are kept by it)."""
        return self.index

    def sequences_of(self, units: Sequence[int]) -> list[int]:
        """The sequences of these units, in order."""
        return [self.per_unit * u + k for u in units for k in range(self.per_unit)]

    def digest(self) -> str:
        """A fingerprint of the sequences' tokens and targets, and of what else a unit carries (the data pin's)."""
        digest = hashlib.sha256()
        for n, (ids, targets) in enumerate(zip(self.ids, self.targets)):
            digest.update(torch.tensor(ids, dtype=torch.int32).numpy().tobytes())
            digest.update(torch.tensor(targets, dtype=torch.bool).numpy().tobytes() + self.marker(n))
        return digest.hexdigest()[:32]

    def marker(self, sequence: int) -> bytes:
        """What ends a sequence in the fingerprint (a subclass adds what else it carries: a KTO item's label)."""
        return b"|"

    def source_totals(self, units: Sequence[int] | None = None) -> dict[str, list[int]] | None:
        """A mixture's units (all, or these): the units each source gave, and their answers' tokens."""
        if self.sources is None:
            return None
        index = torch.arange(len(self)) if units is None else torch.tensor(list(units), dtype=torch.long)
        tokens = self.answer_tokens.view(len(self), self.per_unit).sum(1)[index]
        return count_by_source(self.sources[index], len(self.source_names), tokens)

    def fits(self, units: Sequence[int], batch_size: int) -> bool:
        """Whether these units' sequences fit one micro-batch."""
        if self.packing == "pad":
            return len(units) <= batch_size
        return self.layout.fits([int(self.lengths[s]) for s in self.sequences_of(units)], batch_size)

    def micro(self, units: Sequence[int], device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """A micro-batch of these units' sequences: the model's inputs with labels (Blocks.batch), and for each
        position the micro-batch's sequence (per_unit x j + k of its j-th unit) its token belongs to, -1 elsewhere."""
        seqs = self.sequences_of([int(u) for u in units])
        return self.layout.pack([self.ids[s] for s in seqs], [self.targets[s] for s in seqs], device)

    def reference_units(self, micro_batches: Sequence[Sequence[int]]) -> Sequences:
        """What a reference model scores for these micro-batches (before training, or adapters off): the units' own
        sequences (KTO adds the mismatched ones its KL estimate reads)."""
        return self

    def describe(self, packing_words: str) -> str:
        """What the slice became, for the summary's data line."""
        return f"{len(self)} {self.noun}s ({packing_words} of {self.max_length} tokens)"


def held_out_micro_batches(items: Sequences, batch_size: int) -> list[list[int]]:
    """The units in row order, laid into micro-batches as many as fit each: an evaluation's micro-batches (KTO's:
    whose KL estimate is TRL's)."""
    micro: list[list[int]] = [[]]
    for i in range(len(items)):
        if micro[-1] and not items.fits(micro[-1] + [i], batch_size):
            micro.append([])
        micro[-1].append(i)
    return micro


def rank_rounds(micro: list[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """This rank's share of micro-batches laid out in order (micro-batch r x world_size + rank of each round), padded
    with empty ones so every rank runs as many."""
    rounds = -(-len(micro) // world_size)
    grid = micro + [[] for _ in range(rounds * world_size - len(micro))]
    return [grid[r * world_size + rank] for r in range(rounds)]
