"""Whole sequences, each with the tokens that carry its loss, laid into one micro-batch: under --packing docs as
documents of their own in blocks of --max_length (the same mask and positions as any packed document), under
--packing pad a row each. A method whose loss reads each sequence apart (a preference pair's two answers, a
completion of a prompt) packs its micro-batches with this, and reads back which sequence each position belongs to.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fsdp_opt.data.blocks import Blocks, pad_rows
from fsdp_opt.data.packing import MaskPattern, place, segment_positions


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
