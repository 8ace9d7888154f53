"""What a row is, found from the dataset's columns, and the rows of a slice checked one by one.

The formats are the ones the ecosystem's trainers read:
- text: one string column;
- prompt_completion: a prompt and a completion, both strings (standard) or both lists of messages (conversational);
- messages: a list of {"role", "content"} messages (system, user, assistant);
- preference: a prompt, a chosen answer and a rejected one (TRL's formats): strings; or conversational, the prompt a
  list of messages and each answer a list of assistant messages; or implicit, no prompt column and two whole
  conversations that share their first turns (the shared turns are the prompt);
- prompt: a prompt alone, a string or a list of messages (TRL's prompt-only rows, for --method grpo); every other
  column of the row (a solution, test cases, ...) goes along with it, to the reward functions;
- unpaired: a prompt, a completion and a `label` column, true where the completion is desirable and false where it is
  not (TRL's unpaired preference rows, for --method kto); prompt and completion as in prompt_completion.

A row is handed on as a plain dict: {"text"}, {"prompt", "completion"}, {"messages"}, {"prompt", "chosen",
"rejected"}, {"prompt", **the other columns} or {"prompt", "completion", "label"}. Every error names the row's
index in the dataset and its column, so a bad row is found without reading the whole file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from fsdp_opt.base import DataError
from fsdp_opt.config.choices import DATA_FORMATS
from fsdp_opt.data.mixture import MixtureTable
from fsdp_opt.data.table import as_table

ROLES = ("system", "user", "assistant")
LABEL_COLUMN = "label"  # unpaired rows: whether the completion is desirable (TRL's column name)
MARGIN_COLUMN = "margin"  # a preference row's margin, where the rows have one (TRL's RewardTrainer reads it)


@dataclass(frozen=True)
class RowSpec:
    """The format of the rows and the columns that hold them."""

    format: str  # text | prompt_completion | messages | preference | prompt | unpaired | mixed (a mixture's sources)
    text_column: str = "text"
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    messages_column: str = "messages"
    chosen_column: str = "chosen"
    rejected_column: str = "rejected"
    implicit: bool = False  # preference rows without a prompt column: the answers' shared first turns are the prompt
    extra: tuple[str, ...] = ()  # prompt rows: the other columns, which go to the reward functions
    margin: bool = False  # preference rows with a margin column (TRL's: a reward model's loss reads it)
    parts: tuple[RowSpec, ...] = ()  # a mixture whose sources differ in format or columns: each source's own

    @property
    def columns(self) -> tuple[str, ...]:
        if self.parts:
            return tuple(dict.fromkeys(c for p in self.parts for c in p.columns))
        if self.format == "text":
            return (self.text_column,)
        if self.format == "prompt":
            return (self.prompt_column, *self.extra)
        if self.format == "prompt_completion":
            return (self.prompt_column, self.completion_column)
        if self.format == "unpaired":
            return (self.prompt_column, self.completion_column, LABEL_COLUMN)
        if self.format == "preference":
            pair = (self.chosen_column, self.rejected_column, *((MARGIN_COLUMN,) if self.margin else ()))
            return pair if self.implicit else (self.prompt_column, *pair)
        return (self.messages_column,)

    def key(self, train_on: str) -> dict[str, Any]:
        """What the rows are, for a checkpoint: the format, its columns and which tokens carry loss."""
        out = {"data_format": self.format, "columns": list(self.columns), "train_on": train_on}
        return out | ({"sources": [p.key(train_on) for p in self.parts]} if self.parts else {})

    @property
    def has_answers(self) -> bool:
        """Rows with a part that answers (a completion, assistant turns, the completions sampled for a prompt): they
        can train on the answers alone (in a mixture: some rows have)."""
        return any(p.has_answers for p in self.parts) if self.parts else self.format != "text"

    def part(self, fmt: str) -> RowSpec:
        """The spec rows of format `fmt` were read with (a mixture's first source of that format)."""
        return next((p for p in self.parts if p.format == fmt), RowSpec(fmt))


def mixed(parts: Sequence[RowSpec]) -> RowSpec:
    """One spec for a mixture's sources: theirs when they are alike, else one that keeps each source's own."""
    if all(p == parts[0] for p in parts):
        return parts[0]
    formats = {p.format for p in parts}
    return RowSpec(formats.pop() if len(formats) == 1 else "mixed", parts=tuple(parts))


def row_format(row: dict[str, Any]) -> str:
    """A checked row's format, from its keys (check_row's output)."""
    if "text" in row:
        return "text"
    if "messages" in row:
        return "messages"
    if "label" in row:
        return "unpaired"
    return "prompt_completion" if "completion" in row else ("preference" if "chosen" in row else "prompt")


@dataclass
class Rows:
    """The usable rows of a slice and what was left out."""

    rows: list[dict[str, Any]]
    end_idx: int  # the slice's end, resolved
    indices: list[int]  # each row's index in the dataset (for errors)
    empty: int = 0  # rows dropped: empty text, an empty completion, or only empty assistant turns
    conversational: bool = False  # prompt_completion (or preference) rows of messages
    identical: int = 0  # preference pairs dropped because the chosen answer is the rejected one
    sources: list[int] | None = None  # a mixture's rows: each row's source
    source_names: list[str] | None = None


def resolve_spec(
    column_names: Sequence[str],
    data_format: str,
    *,
    text_column: str = "text",
    prompt_column: str = "prompt",
    completion_column: str = "completion",
    messages_column: str = "messages",
    chosen_column: str = "chosen",
    rejected_column: str = "rejected",
    prefer: Sequence[str] = (),
) -> RowSpec:
    """--data_format, or (auto) the one format whose columns the dataset has: the one of `prefer` (the formats the
    run's method trains on) when exactly one of those fits, else the one of all that fits. Prompt rows carry their
    other columns along."""
    have = set(column_names)
    kw = {
        "text_column": text_column,
        "prompt_column": prompt_column,
        "completion_column": completion_column,
        "messages_column": messages_column,
        "chosen_column": chosen_column,
        "rejected_column": rejected_column,
        "implicit": prompt_column not in have,
        "extra": tuple(c for c in column_names if c != prompt_column),
        "margin": MARGIN_COLUMN in have,
    }
    listed = ", ".join(column_names)
    preferred = [f for f in prefer if f in DATA_FORMATS and all(c in have for c in RowSpec(f, **kw).columns)]
    pairs = all(c in have for c in RowSpec("preference", **kw).columns)  # preference rows are never taken as another
    if data_format == "auto" and len(preferred) == 1 and (not pairs or preferred[0] == "preference"):
        return RowSpec(preferred[0], **kw)
    if data_format != "auto":
        spec = RowSpec(data_format, **kw)
        missing = [c for c in spec.columns if c not in have]
        if missing == [LABEL_COLUMN]:
            raise DataError(
                f"--data_format {data_format}: no column {LABEL_COLUMN} (true: the completion is desirable; false: "
                f"it is not) in the dataset (it has: {listed})"
            )
        if missing:
            flag = {
                text_column: "--text_column",
                prompt_column: "--prompt_column",
                completion_column: "--completion_column",
                messages_column: "--messages_column",
                chosen_column: "--chosen_column",
                rejected_column: "--rejected_column",
            }[missing[0]]
            raise DataError(
                f"{flag} {missing[0]}: no such column for --data_format {data_format} (the dataset has: {listed})"
            )
        return spec
    formats = ("preference", "unpaired", "messages", "prompt_completion", "text")
    fits = [f for f in formats if all(c in have for c in RowSpec(f, **kw).columns)]
    if not fits:
        raise DataError(
            f"--text_column {text_column}: no such column, and no {prompt_column}/{completion_column} or "
            f"{messages_column} column either (the dataset has: {listed}); name the columns with "
            "--text_column, --prompt_column/--completion_column or --messages_column"
        )
    if len(fits) > 1:
        raise DataError(
            f"--data_format: the columns fit more than one format ({', '.join(fits)}; the dataset has: "
            f"{listed}); name one with --data_format"
        )
    return RowSpec(fits[0], **kw)


def _messages(value: Any, index: int, column: str, what: str = "a list of messages") -> list[dict[str, str]]:
    if not isinstance(value, (list, tuple)):
        raise DataError(f"row {index}, column {column}: expected {what}, got {type(value).__name__}")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"row {index}, column {column}: message {k} is not a {{'role', 'content'}} object")
        if m["role"] not in ROLES:
            raise DataError(
                f"row {index}, column {column}: message {k} has the unknown role {m['role']!r} (use {', '.join(ROLES)})"
            )
        if not isinstance(m["content"], str):
            raise DataError(
                f"row {index}, column {column}: message {k}'s content is {type(m['content']).__name__}, not a string"
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _preference(spec: RowSpec, raw: dict[str, Any], index: int) -> dict[str, Any] | None:
    """A preference row as {"prompt", "chosen", "rejected"} (strings, or lists of messages); None when an answer is
    empty. The implicit form's prompt is the two conversations' shared first turns."""
    chosen, rejected = raw[spec.chosen_column], raw[spec.rejected_column]
    if spec.implicit:
        where = f"columns {spec.chosen_column}, {spec.rejected_column}"
        if isinstance(chosen, str) or isinstance(rejected, str):
            raise DataError(
                f"row {index}, {where}: strings with no prompt column; name the prompt's column with "
                "--prompt_column (the form without a prompt is for conversations)"
            )
        chosen = _messages(chosen, index, spec.chosen_column)
        rejected = _messages(rejected, index, spec.rejected_column)
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == len(chosen) == len(rejected):
            return {"prompt": chosen, "chosen": [], "rejected": []}
        if shared == 0:
            raise DataError(f"row {index}, {where}: the two conversations share no first turn to be the prompt")
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    else:
        prompt = raw[spec.prompt_column]
        if isinstance(prompt, str) or prompt is None:
            for column, value in (
                (spec.prompt_column, prompt),
                (spec.chosen_column, chosen),
                (spec.rejected_column, rejected),
            ):
                if not isinstance(value, str):
                    raise DataError(
                        f"row {index}, column {column}: expected a string like the prompt, got {type(value).__name__}"
                    )
            return {"prompt": prompt, "chosen": chosen, "rejected": rejected} if chosen and rejected else None
        prompt = _messages(prompt, index, spec.prompt_column, "a string or a list of messages")
        chosen = _messages(chosen, index, spec.chosen_column, "a list of messages, like the prompt")
        rejected = _messages(rejected, index, spec.rejected_column, "a list of messages, like the prompt")
    for column, answer in ((spec.chosen_column, chosen), (spec.rejected_column, rejected)):
        if answer and not any(m["role"] == "assistant" for m in answer):
            raise DataError(f"row {index}, column {column}: the answer has no assistant turn")
    has = lambda answer: any(m["content"] for m in answer if m["role"] == "assistant")  # noqa: E731
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected} if has(chosen) and has(rejected) else None


def check_row(spec: RowSpec, raw: dict[str, Any], index: int) -> dict[str, Any] | None:
    """One row as the trainer takes it; None for a row with nothing to train on (dropped and counted)."""
    if spec.format == "preference":
        pair = _preference(spec, raw, index)
        if pair is not None and raw.get(MARGIN_COLUMN) is not None:
            pair["margin"] = float(raw[MARGIN_COLUMN])
        return pair
    if spec.format == "unpaired":
        label = raw[LABEL_COLUMN]
        if not isinstance(label, bool):  # a 0/1 or a "yes" is not taken for one: the loss's sign depends on it
            raise DataError(
                f"row {index}, column {LABEL_COLUMN}: expected true or false (is the completion desirable?), got "
                f"{label!r} ({type(label).__name__})"
            )
        row = check_row(replace(spec, format="prompt_completion"), raw, index)
        return None if row is None else {**row, "label": label}
    if spec.format == "text":
        text = raw[spec.text_column]
        if text is not None and not isinstance(text, str):
            raise DataError(f"row {index}, column {spec.text_column}: expected a string, got {type(text).__name__}")
        return {"text": text} if text and text.strip() else None
    if spec.format == "prompt":
        prompt = raw[spec.prompt_column]
        if not isinstance(prompt, str):
            prompt = _messages(prompt, index, spec.prompt_column, "a string or a list of messages")
        if not prompt or (isinstance(prompt, list) and not any(m["content"] for m in prompt)):
            return None
        return {"prompt": prompt, **{c: raw[c] for c in spec.extra}}
    if spec.format == "messages":
        messages = _messages(raw[spec.messages_column], index, spec.messages_column)
        answers = [m for m in messages if m["role"] == "assistant"]
        if not answers:
            raise DataError(f"row {index}, column {spec.messages_column}: the conversation has no assistant turn")
        return {"messages": messages} if any(m["content"] for m in answers) else None
    prompt, completion = raw[spec.prompt_column], raw[spec.completion_column]
    if isinstance(prompt, str) or prompt is None:
        for column, value in ((spec.prompt_column, prompt), (spec.completion_column, completion)):
            if not isinstance(value, str):
                raise DataError(
                    f"row {index}, column {column}: expected a string like the prompt, got {type(value).__name__}"
                )
        return {"prompt": prompt, "completion": completion} if completion else None
    prompt_m = _messages(prompt, index, spec.prompt_column, "a string or a list of messages")
    completion_m = _messages(completion, index, spec.completion_column, "a list of messages, like the prompt")
    if not any(m["role"] == "assistant" for m in completion_m):
        raise DataError(f"row {index}, column {spec.completion_column}: the completion has no assistant turn")
    if not any(m["content"] for m in completion_m if m["role"] == "assistant"):
        return None
    return {"prompt": prompt_m, "completion": completion_m}


def select_rows(data, spec: RowSpec, start_idx: int, end_idx: int | None) -> Rows:
    """Rows [start_idx, end_idx) of the raw data (a Table, or a `datasets.Dataset`), each checked; rows with nothing
    to train on dropped and counted. Only those rows are read."""
    table = as_table(data)
    total = len(table)
    if total == 0:
        raise DataError("--dataset: the dataset has no rows")
    end = total if end_idx is None else end_idx
    if start_idx >= total:
        raise DataError(f"--start_idx {start_idx}: past the end of the dataset ({total} rows)")
    if end > total:
        raise DataError(f"--end_idx {end}: past the end of the dataset ({total} rows)")
    origins = table.origins(start_idx, end) if isinstance(table, MixtureTable) else None
    if spec.parts:
        part = table.rows(start_idx, end, spec.columns, [p.columns for p in spec.parts])
    else:
        part = table.rows(start_idx, end, spec.columns)
    rows, indices, sources, empty, identical = [], [], [], 0, 0
    for offset, raw in enumerate(part):
        own = spec.parts[origins[offset]] if spec.parts else spec
        row = check_row(own, raw, start_idx + offset)
        if row is None:
            empty += 1
        elif spec.format == "preference" and row["chosen"] == row["rejected"]:
            identical += 1  # nothing to compare
        else:
            rows.append(row)
            indices.append(start_idx + offset)
            if origins is not None:
                sources.append(origins[offset])
    if not rows:
        what = "empty" if not identical else "empty, or a pair whose chosen answer is the rejected one"
        raise DataError(f"--start_idx {start_idx} --end_idx {end}: every row of this slice is {what}")
    paired = [k for k, r in enumerate(rows) if "prompt" in r]  # rows whose prompt is a string or messages
    conversational = bool(paired) and not isinstance(rows[paired[0]]["prompt"], str)
    if any(isinstance(rows[k]["prompt"], str) == conversational for k in paired):
        index = next(indices[k] for k in paired if isinstance(rows[k]["prompt"], str) == conversational)
        raise DataError(
            f"row {index}, column {spec.prompt_column}: mixes string prompts and lists of messages in one slice"
        )
    names = table.names if isinstance(table, MixtureTable) else None
    return Rows(rows, end, indices, empty, conversational, identical, sources if origins is not None else None, names)


def held_out_rows(data, spec: RowSpec, end_idx: int, rows: int) -> Rows:
    """--eval_rows: the rows right after the slice, [end_idx, end_idx + rows), cut at the end of the dataset."""
    total = len(data)
    if end_idx >= total:
        raise DataError(
            f"--eval_rows {rows}: no rows after --end_idx {end_idx} to evaluate on (the dataset has "
            f"{total}; --eval_split names a held-out split)"
        )
    return select_rows(data, spec, end_idx, min(total, end_idx + rows))


def held_out_split(data, spec: RowSpec, rows: int, split: str) -> Rows:
    """--eval_rows with --eval_split: the split's first rows."""
    if len(data) == 0:
        raise DataError(f"--eval_split {split}: the split has no rows")
    return select_rows(data, spec, 0, min(len(data), rows))


def select_texts(ds, text_column: str, start_idx: int, end_idx: int | None) -> tuple[list[str], int]:
    """The text rows [start_idx, end_idx), empty ones dropped, and the resolved end."""
    if text_column not in ds.column_names:
        raise DataError(f"--text_column {text_column}: no such column (the dataset has: {', '.join(ds.column_names)})")
    got = select_rows(ds, RowSpec("text", text_column=text_column), start_idx, end_idx)
    return [r["text"] for r in got.rows], got.end_idx


def held_out_texts(ds, text_column: str, end_idx: int, rows: int) -> tuple[list[str], int]:
    """--eval_rows of text rows: [end_idx, end_idx + rows), and where they end."""
    got = held_out_rows(ds, RowSpec("text", text_column=text_column), end_idx, rows)
    return [r["text"] for r in got.rows], got.end_idx
