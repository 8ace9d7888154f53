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

A step's micro-batches are laid as preference pairs' are (data/pairs.py UnitPlan), an item for a pair: in the epoch's
order, as many as fit each (--packing pad: --batch_size items).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fsdp_opt.base import DataError
from fsdp_opt.data.formats import Rows, RowSpec, row_format
from fsdp_opt.data.sequences import Fit, Packing, Sequences
from fsdp_opt.data.tokens import encode_rows


class Unpaired(Sequences):
    """The items of a slice, one sequence each, in row order (a preference row's chosen answer, then its rejected)."""

    noun = "item"

    def __init__(self, *args, labels: list[bool], parts: list[int], **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.starts = [t.index(True) for t in self.targets]  # each item's first completion token
        self.labels = torch.tensor(labels, dtype=torch.bool)
        self.parts = torch.tensor(parts, dtype=torch.long)  # 0: the row's completion (or chosen answer); 1: rejected

    @property
    def keys(self) -> torch.Tensor:
        """[items, 2]: (dataset row, answer) of each item."""
        return torch.stack([self.index, self.parts], 1)

    def marker(self, sequence: int) -> bytes:
        return b"+" if self.labels[sequence] else b"-"

    def describe(self, packing_words: str) -> str:
        good = int(self.labels.sum())
        return (
            f"{len(self)} items ({good} desirable, {len(self) - good} undesirable; {packing_words} of "
            f"{self.max_length} tokens)"
        )

    @staticmethod
    def partners(items: Sequence[int]) -> list[tuple[int, int]]:
        """The KL estimate's (prompt, completion) items of a micro-batch: each item's prompt with the completion of the
        item before it (the first: the last one's)."""
        return [(a, b) for a, b in zip(items, [*items[-1:], *items[:-1]])]

    def kl_micro(self, items: Sequence[int], device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The mismatched sequences of a micro-batch (partners), packed as its own are (docs: as many blocks as
        they need)."""
        return self.pack_pairs(self.partners(items), device)

    def sequence(self, a: int, b: int) -> tuple[list[int], list[bool]]:
        """Item a's prompt followed by item b's completion, cut at --max_length (a == b: item a's own sequence)."""
        if a == b:
            return self.ids[a], self.targets[a]
        sa, sb = self.starts[a], self.starts[b]
        ids = self.ids[a][:sa] + self.ids[b][sb:]
        mask = [False] * sa + self.targets[b][sb:]
        return ids[: self.max_length], mask[: self.max_length]

    def pack_pairs(
        self, pairs: list[tuple[int, int]], device: torch.device
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        made = [self.sequence(a, b) for a, b in pairs]
        return self.layout.pack([ids for ids, _ in made], [mask for _, mask in made], device)

    def reference_units(self, micro_batches: Sequence[Sequence[int]]) -> Scored:
        """What a reference scores for these micro-batches: every item's own sequence and their mismatched ones."""
        return Scored(self, scored_pairs(self, micro_batches))


class Scored:
    """Sequences of a slice's items for the reference to score: each (a, b) is item a's prompt with item b's
    completion (a == b: an item's own). A unit of one sequence, keyed (row, answer) of a then of b."""

    per_unit = 1
    noun = "item"

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
        return self.items.layout.fits([self.lengths[u] for u in units], batch_size)

    def micro(self, units: Sequence[int], device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return self.items.pack_pairs([self.pairs[u] for u in units], device)


def scored_pairs(items: Unpaired, micro_batches: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Every item's own sequence, and the mismatched ones these micro-batches read."""
    own = [(i, i) for i in range(len(items))]
    return own + [p for m in micro_batches for p in Unpaired.partners(list(m)) if p[0] != p[1]]


def items_from_rows(rows: Rows, spec: RowSpec, tokenizer, packing: Packing) -> Unpaired:
    """The checked rows of a slice as items: an unpaired row is one, a preference row two (chosen: desirable;
    rejected: not), each tokenized as a prompt/completion row is, cut at --max_length."""
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
    max_length = packing.max_length
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
        [index[n] for n in keep],
        packing,
        Fit(len(flat), "item", cut, dropped, rows.identical, "left with a completion of no token"),
        sources,
        rows.source_names,
        labels=[labels[n] for n in keep],
        parts=[parts[n] for n in keep],
    )
