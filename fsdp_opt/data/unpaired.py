"""Unpaired rows (--method kto) as token sequences, the mismatched sequences of its KL estimate, and what the
reference scores.

An item is a prompt, a completion and a label (desirable or not): a row of --data_format unpaired, or one answer of a
preference row, its chosen answer desirable and its rejected one not (TRL's unpairing: every pair gives both). Its
sequence is tokenized as a prompt/completion row is (data/tokens.py): the prompt's tokens, then the completion's,
which carry the loss; a sequence longer than --max_length keeps its start and is cut at the end, and an item left
without a completion token is dropped and counted. Items are keyed by (dataset row, answer): 0 for an unpaired row and
a chosen answer, 1 for a rejected one.

The KL estimate reads, for each item of a micro-batch, its own prompt followed by the completion of the item before it
in that micro-batch (the first takes the last one's): TRL's rotation of the completions within a batch, so that the
mismatched completions are the same set as the matched ones. Those sequences are made when the micro-batch is
(`kl_micro`). What the reference scores before training (`Scored`) is each item's own sequence and each mismatched one
the session's micro-batches will read, keyed by the two items.

A step's micro-batches are laid as preference pairs' are (data/pairs.py PairPlan), an item for a pair: in the epoch's
order, as many as fit each (--packing pad: --batch_size items).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fsdp_opt.base import DataError
from fsdp_opt.data.blocks import count_by_source
from fsdp_opt.data.formats import Rows, RowSpec, row_format
from fsdp_opt.data.packing import MaskPattern
from fsdp_opt.data.sequences import fits, pack
from fsdp_opt.data.tokens import encode_rows


@dataclass(frozen=True)
class ItemFit:
    """What fitting the items into --max_length cost."""

    items: int
    cut: int = 0  # sequences cut at their end
    dropped: int = 0  # items left with no completion token
    identical: int = 0  # preference rows whose chosen answer is the rejected one (dropped before tokenizing)

    def describe(self) -> str:
        out = (
            f"{self.cut} of {self.items} sequences longer than --max_length were cut at their end; {self.dropped} "
            "left with a completion of no token were dropped"
        )
        return out + (
            f"; {self.identical} preference rows whose answers are the same were dropped" if self.identical else ""
        )


class Unpaired:
    """The items of a slice, one sequence each, in row order (a preference row's chosen answer, then its rejected)."""

    per_unit = 1
    noun = "item"

    def __init__(
        self,
        ids: list[list[int]],
        targets: list[list[bool]],
        labels: list[bool],
        index: list[int],
        parts: list[int],
        pad_id: int,
        max_length: int,
        packing: str,
        attention: str = "sdpa",
        pattern: MaskPattern | None = None,
        fit: ItemFit | None = None,
        sources: list[int] | None = None,
        source_names: list[str] | None = None,
    ) -> None:
        self.ids, self.targets, self.pad_id, self.max_length = ids, targets, pad_id, max_length
        self.starts = [t.index(True) for t in targets]  # each item's first completion token
        self.labels = torch.tensor(labels, dtype=torch.bool)
        self.index = torch.tensor(index, dtype=torch.long)  # each item's row in the dataset
        self.parts = torch.tensor(parts, dtype=torch.long)  # 0: the row's completion (or chosen answer); 1: rejected
        self.packing, self.attention, self.pattern, self.fit = packing, attention, pattern, fit
        self.sources = torch.tensor(sources, dtype=torch.long) if sources is not None else None
        self.source_names = source_names
        self.lengths = torch.tensor([len(s) for s in ids], dtype=torch.long)
        self.answer_tokens = torch.tensor([sum(t[1:]) for t in targets], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def sequences(self) -> int:
        return len(self.ids)

    @property
    def keys(self) -> torch.Tensor:
        """[items, 2]: (dataset row, answer) of each item."""
        return torch.stack([self.index, self.parts], 1)

    def digest(self) -> str:
        """A fingerprint of the items' tokens, targets and labels (the data pin's)."""
        digest = hashlib.sha256()
        for ids, targets, label in zip(self.ids, self.targets, self.labels.tolist()):
            digest.update(torch.tensor(ids, dtype=torch.int32).numpy().tobytes())
            digest.update(torch.tensor(targets, dtype=torch.bool).numpy().tobytes() + (b"+" if label else b"-"))
        return digest.hexdigest()[:32]

    def source_totals(self, items: Sequence[int] | None = None) -> dict[str, list[int]] | None:
        """A mixture's items (all, or these): the items each source gave, and their completions' tokens."""
        if self.sources is None:
            return None
        index = torch.arange(len(self)) if items is None else torch.tensor(items, dtype=torch.long)
        return count_by_source(self.sources[index], len(self.source_names), self.answer_tokens[index])

    def fits(self, items: Sequence[int], batch_size: int) -> bool:
        """Whether these items' sequences fit one micro-batch."""
        if self.packing == "pad":
            return len(items) <= batch_size
        return fits([int(self.lengths[i]) for i in items], self.max_length, self.packing, batch_size)

    def micro(self, items: Sequence[int], device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """A micro-batch of these items' own sequences, and each position's item (its place in `items`), -1 none."""
        return self._pack([(i, i) for i in items], device)

    @staticmethod
    def partners(items: Sequence[int]) -> list[tuple[int, int]]:
        """The KL estimate's (prompt, completion) items of a micro-batch: each item's prompt with the completion of the
        item before it (the first: the last one's)."""
        return [(a, b) for a, b in zip(items, [*items[-1:], *items[:-1]])]

    def kl_micro(self, items: Sequence[int], device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The mismatched sequences of a micro-batch (partners), packed as its own are (docs: as many blocks as
        they need)."""
        return self._pack(self.partners(items), device)

    def sequence(self, a: int, b: int) -> tuple[list[int], list[bool]]:
        """Item a's prompt followed by item b's completion, cut at --max_length (a == b: item a's own sequence)."""
        if a == b:
            return self.ids[a], self.targets[a]
        sa, sb = self.starts[a], self.starts[b]
        ids = self.ids[a][:sa] + self.ids[b][sb:]
        mask = [False] * sa + self.targets[b][sb:]
        return ids[: self.max_length], mask[: self.max_length]

    def _pack(self, pairs: list[tuple[int, int]], device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        made = [self.sequence(a, b) for a, b in pairs]
        return pack(
            [ids for ids, _ in made],
            [mask for _, mask in made],
            self.pad_id,
            self.max_length,
            self.packing,
            device,
            self.attention,
            self.pattern,
        )


class Scored:
    """Sequences of a slice's items for the reference to score: each (a, b) is item a's prompt with item b's
    completion (a == b: an item's own). A unit of one sequence, keyed (row, answer) of a then of b."""

    per_unit = 1

    def __init__(self, items: Unpaired, pairs: Sequence[tuple[int, int]]) -> None:
        self.items = items
        self.pairs = list(dict.fromkeys(pairs))  # each once, in the order first asked
        keys = items.keys
        self.keys = torch.cat([keys[[a for a, _ in self.pairs]], keys[[b for _, b in self.pairs]]], 1)
        self.lengths = [len(items.sequence(a, b)[0]) for a, b in self.pairs]

    def __len__(self) -> int:
        return len(self.pairs)

    def fits(self, units: Sequence[int], batch_size: int) -> bool:
        if self.items.packing == "pad":
            return len(units) <= batch_size
        return fits([self.lengths[u] for u in units], self.items.max_length, self.items.packing, batch_size)

    def micro(self, units: Sequence[int], device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return self.items._pack([self.pairs[u] for u in units], device)


def scored_pairs(items: Unpaired, micro_batches: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Every item's own sequence, and the mismatched ones these micro-batches read."""
    own = [(i, i) for i in range(len(items))]
    return own + [p for m in micro_batches for p in Unpaired.partners(list(m)) if p[0] != p[1]]


def held_out_micro_batches(items: Unpaired, batch_size: int) -> list[list[int]]:
    """The held-out items in row order, laid into micro-batches as many as fit each: the evaluation's micro-batches,
    whose KL estimate is TRL's."""
    micro: list[list[int]] = [[]]
    for i in range(len(items)):
        if micro[-1] and not items.fits(micro[-1] + [i], batch_size):
            micro.append([])
        micro[-1].append(i)
    return micro


def items_from_rows(
    rows: Rows,
    spec: RowSpec,
    tokenizer,
    *,
    max_length: int,
    packing: str,
    attention: str = "sdpa",
    pattern: MaskPattern | None = None,
) -> Unpaired:
    """The checked rows of a slice as items: an unpaired row is one, a preference row two (chosen: desirable;
    rejected: not), each tokenized as a prompt/completion row is, cut at max_length."""
    flat, labels, index, parts, owners = [], [], [], [], []
    for k, (row, row_index) in enumerate(zip(rows.rows, rows.indices)):
        if row_format(row) == "preference":
            answers = [(row["chosen"], True, 0), (row["rejected"], False, 1)]
        else:
            answers = [(row["completion"], row["label"], 0)]
        for completion, label, part in answers:
            flat.append({"prompt": row["prompt"], "completion": completion})
            labels.append(label)
            index.append(row_index)
            parts.append(part)
            owners.append(k)
    as_rows = RowSpec("prompt_completion", prompt_column=spec.prompt_column, completion_column=spec.completion_column)
    encoded = encode_rows(
        flat, as_rows, tokenizer, train_on="completion", indices=index, conversational=rows.conversational
    )
    keep, ids, targets, cut, dropped = [], [], [], 0, 0
    for n, (seq, mask) in enumerate(zip(encoded.ids, encoded.targets)):
        if len(seq) > max_length:
            cut += 1
            seq, mask = seq[:max_length], mask[:max_length]
        if not any(mask[1:]):
            dropped += 1
            continue
        keep.append(n)
        ids.append(seq)
        targets.append(mask)
    if not keep:
        raise DataError(f"--max_length {max_length}: no row keeps a token of its completion once cut to this length")
    sources = [rows.sources[owners[n]] for n in keep] if rows.sources is not None else None
    return Unpaired(
        ids,
        targets,
        [labels[n] for n in keep],
        [index[n] for n in keep],
        [parts[n] for n in keep],
        tokenizer.pad_token_id,
        max_length,
        packing,
        attention,
        pattern,
        ItemFit(len(flat), cut, dropped, rows.identical),
        sources,
        rows.source_names,
    )
