"""Document-aware packing (`--packing docs`): whole documents share a block, and none of them sees another.

Placement. A document longer than a block is cut into block-sized pieces first; every piece after the first is
a document of its own from then on (its positions start at 0 again, and its first token has no target, as no
earlier token of it is in its block). Then the pieces go into blocks by best fit, longest first: each piece takes
the fullest block it still fits in, so a document shorter than a block is never cut and the blocks are nearly
full. The placement depends only on the token counts, so every rank builds the same blocks.

Attention. Inside a block a token attends to the earlier tokens of its own document only
(block-diagonal causal), and positions restart at 0 with each document (`position_ids`, which OPT's learned
positions, GPT-2's and Llama's rotary ones all take). The padding after the last document is a segment of its
own, so no row of the mask is empty. The mask goes to the model as a 4-D tensor, which transformers hands to the
attention kernel as it is: boolean for SDPA (True = may attend), additive (0 / -inf) for eager attention.
A micro-batch in which every row is one document starting at position 0 and filling the row gets no mask and
no positions: plain causal attention is then the same thing, and SDPA keeps its causal fast path.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def split_long(rows: Sequence[Sequence[int]], max_length: int) -> list[tuple[int, int, int]]:
    """(row, begin, end) pieces: each row cut into max_length-sized pieces, the last one shorter."""
    return [(r, b, min(b + max_length, len(row))) for r, row in enumerate(rows) for b in range(0, len(row), max_length)]


def place(sizes: Sequence[int], max_length: int) -> list[list[int]]:
    """Best-fit decreasing: the indices of `sizes` (each at most max_length) grouped into blocks.

    Pieces go in order of decreasing size (ties by index); each takes the block with the least room that still
    holds it, or opens a new block. Deterministic for given sizes.
    """
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    blocks: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, block index) of the blocks that are not full, sorted
    for i in order:
        n = sizes[i]
        at = bisect_left(room, (n, -1))
        if at < len(room):
            free, b = room.pop(at)
        else:
            free, b = max_length, len(blocks)
            blocks.append([])
        blocks[b].append(i)
        if free - n > 0:
            insort(room, (free - n, b))
    return blocks


def pack_documents(
    rows: Sequence[Sequence[int]], max_length: int, pad_id: int, targets: Sequence[Sequence[bool]] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Token ids [n, max_length], real-token counts [n], positions [n, max_length] of whole-document blocks, and
    (with `targets`, per row which tokens carry loss) the same mask laid out like the ids.

    Each document's positions run from 0; the padding after the last document counts from 0 as well (a segment
    of its own, never attended to by a real token, whose labels are ignored).
    """
    pieces = split_long(rows, max_length)
    groups = place([e - b for _, b, e in pieces], max_length)
    ids = torch.full((len(groups), max_length), pad_id, dtype=torch.int32)
    positions = torch.empty((len(groups), max_length), dtype=torch.int32)
    lengths = torch.empty(len(groups), dtype=torch.int64)
    mask = torch.zeros((len(groups), max_length), dtype=torch.bool) if targets is not None else None
    for k, members in enumerate(groups):
        tokens: list[int] = []
        starts: list[int] = []
        flags: list[bool] = []
        for p in members:
            r, b, e = pieces[p]
            starts.append(len(tokens))
            tokens.extend(rows[r][b:e])
            if targets is not None:
                flags.extend(targets[r][b:e])
        used = len(tokens)
        ids[k, :used] = torch.tensor(tokens, dtype=torch.int32)
        if mask is not None:
            mask[k, :used] = torch.tensor(flags, dtype=torch.bool)
        lengths[k] = used
        positions[k] = segment_positions(starts + ([used] if used < max_length else []), max_length)
    return ids, lengths, positions, mask


def segment_positions(starts: Sequence[int], length: int) -> torch.Tensor:
    """Positions that restart at 0 at each start offset (starts[0] must be 0)."""
    index = torch.arange(length)
    begin = torch.zeros(length, dtype=torch.long)
    begin[torch.tensor(list(starts), dtype=torch.long)] = torch.tensor(list(starts), dtype=torch.long)
    return (index - begin.cummax(0).values).to(torch.int32)


@dataclass(frozen=True)
class MaskPattern:
    """What the model's own attention masks hold beyond causality, which a document mask must hold too.

    window: a sliding window of this many tokens (a query sees itself and window - 1 earlier tokens).
    by_layer_type: the model takes one mask per layer type ({"full_attention": ..., "sliding_attention": ...}) and
    only its sliding layers have the window (Gemma 2 and 3, Qwen2/3 with sliding layers); else every layer has it.
    """

    window: int | None = None
    by_layer_type: bool = False


def document_mask(positions: torch.Tensor, attention: str, window: int | None = None) -> torch.Tensor:
    """[batch, 1, L, L] block-diagonal causal mask from positions that restart at 0 with each document; with
    `window`, a query sees only the window - 1 tokens before it (as the model's sliding-window layers do)."""
    segment = (positions == 0).cumsum(1)
    length = positions.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    if window is not None:
        causal &= ~torch.ones(length, length, dtype=torch.bool, device=positions.device).tril(-window)
    allowed = (segment[:, :, None] == segment[:, None, :]) & causal
    allowed = allowed[:, None]
    if attention == "eager":  # added to the scores before the softmax
        return torch.zeros(allowed.shape, dtype=torch.float32, device=positions.device).masked_fill_(
            ~allowed, float("-inf")
        )
    return allowed


def model_masks(
    positions: torch.Tensor, attention: str, pattern: MaskPattern | None
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention_mask a model with this pattern takes for document-packed rows."""
    if pattern is None or pattern.window is None:
        return document_mask(positions, attention)
    windowed = document_mask(positions, attention, pattern.window)
    if not pattern.by_layer_type:
        return windowed
    return {"full_attention": document_mask(positions, attention), "sliding_attention": windowed}
