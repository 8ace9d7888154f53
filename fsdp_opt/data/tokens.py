"""Rows into token ids and the tokens that carry loss, as the ecosystem makes them.

- text: the tokenizer's own special tokens (a BOS where it adds one), then EOS; every token after the first is a
  target.
- prompt + completion (strings): ids = tokenizer(prompt + completion) with its special tokens, then EOS; the
  targets are the tokens at positions >= len(tokenizer(prompt)).
- messages: ids = the chat template applied to the whole conversation (the template writes its own BOS and
  end-of-turn markers; nothing is added). For each assistant message i the targets are the tokens of
  render(messages[:i+1]) past render(messages[:i], add_generation_prompt=True): the answer and its end-of-turn
  marker. Those renderings must be prefixes of the whole, in tokens, or the row is refused.
- prompt + completion (messages): ids = template(prompt + completion); the targets are past
  template(prompt, add_generation_prompt=True).

`--train_on all` keeps the ids and makes every token after the first a target. A rendered conversation is
tokenized with add_special_tokens=False, as `apply_chat_template(tokenize=True)` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import GenerationConfig

from fsdp_opt.base import DataError, first_line
from fsdp_opt.data.formats import RowSpec, row_format

# ChatML, with generation markers around each assistant turn (what `return_assistant_tokens_mask` and TRL's
# assistant_only_loss read). The marked part is the part that carries loss here: the answer, <|im_end|> and the
# newline after it.
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TEMPLATES = {"chatml": CHATML}


@dataclass
class Encoded:
    """Token ids per row, and per row which tokens carry loss (None: every token after the first)."""

    ids: list[list[int]]
    targets: list[list[bool]] | None
    whole_rows: bool  # rows are kept whole (truncated, never split): a piece must not hold answers without question


def read_template(spec: str | None, tokenizer) -> str | None:
    """--chat_template: a built-in name or a Jinja file; None: the tokenizer's own (which may be None)."""
    if spec is None:
        return getattr(tokenizer, "chat_template", None) or None
    if spec in TEMPLATES:
        return TEMPLATES[spec]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DataError(f"--chat_template {spec}: no such file, and not a built-in template ({', '.join(TEMPLATES)})")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"--chat_template {spec}: cannot read it ({first_line(exc)})") from None
    if not text.strip():
        raise DataError(f"--chat_template {spec}: the file is empty")
    return text


def _appends_eos(tokenizer) -> bool:
    """Whether the tokenizer's own special tokens already end a text with EOS."""
    with_specials = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return bool(with_specials) and with_specials[-1] == tokenizer.eos_token_id and plain[-1:] != with_specials[-1:]


def _ids(tokenizer, texts: list[str], specials: bool, batch: int = 1000) -> list[list[int]]:
    out: list[list[int]] = []
    for i in range(0, len(texts), batch):
        out.extend(tokenizer(texts[i : i + batch], add_special_tokens=specials, verbose=False)["input_ids"])
    return out


def _render(tokenizer, messages: list[dict[str, str]], generation_prompt: bool, where: str) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # noqa: BLE001 - a template that fails on a row is that row's error, in one line
        raise DataError(f"{where}: the chat template failed on it ({first_line(exc)})") from None
    return text


def render_prompt(tokenizer, messages: list[dict[str, str]]) -> str:
    """A conversation up to where the model answers: the template's generation prompt appended."""
    return _render(tokenizer, messages, True, "prompt")


def end_of_turn(tokenizer) -> str | None:
    """The text the template writes after an assistant's answer (e.g. <|im_end|>), stripped; None without one."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    probe = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "ANSWER"}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # noqa: BLE001
        return None
    tail = text[text.rfind("ANSWER") + len("ANSWER") :].strip()
    return tail or None


def end_rules(tokenizer, model_config, conversational: bool) -> tuple[list[int], str | None]:  # noqa: ANN001
    """Where a completion ends, the same in training and in `python -m fsdp_opt.evaluate`: the tokenizer's end of text,
    the model's generation config's (as the model built from its config has it), and the chat template's end of turn
    (an end-of-text token where it is one token; else a stop text)."""
    eos = {i for i in [tokenizer.eos_token_id] if i is not None}
    config_eos = GenerationConfig.from_model_config(model_config).eos_token_id if model_config is not None else None
    eos |= set(config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else [])
    stop = end_of_turn(tokenizer) if conversational else None
    if stop:
        ids = tokenizer(stop, add_special_tokens=False)["input_ids"]
        if len(ids) == 1:  # one token: an end-of-text token like the others
            eos.add(ids[0])
            stop = None
    return sorted(eos), stop


def encode_rows(
    rows: Sequence[dict[str, Any]],
    spec: RowSpec,
    tokenizer,
    *,
    train_on: str,
    indices: Sequence[int] | None = None,
    conversational: bool = False,
) -> Encoded:
    """Rows of one format (data.formats) as token ids and targets. `indices` numbers the rows in errors."""
    index = list(indices) if indices is not None else list(range(len(rows)))
    if spec.format == "mixed":
        return _encode_mixed(rows, spec, tokenizer, train_on, index)
    all_tokens = train_on == "all" or not spec.has_answers
    if spec.format == "text":
        ids = _ids(tokenizer, [r["text"] for r in rows], True)
        if not _appends_eos(tokenizer):
            ids = [row + [tokenizer.eos_token_id] for row in ids]
        return Encoded(ids, None, whole_rows=False)
    if spec.format == "prompt_completion" and not conversational:
        full = _ids(tokenizer, [r["prompt"] + r["completion"] for r in rows], True)
        if not _appends_eos(tokenizer):
            full = [row + [tokenizer.eos_token_id] for row in full]
        starts = [len(p) for p in _ids(tokenizer, [r["prompt"] for r in rows], True)]
        spans = [[(s, len(f))] for s, f in zip(starts, full)]
        return _with_targets(full, spans, all_tokens)
    if not getattr(tokenizer, "chat_template", None):
        column = spec.messages_column if spec.format == "messages" else spec.prompt_column
        raise DataError(
            f"row {index[0]}, column {column}: the tokenizer has no chat template to render messages; "
            "give --chat_template chatml or a Jinja file"
        )
    full_texts, prefix_texts, owners = [], [], []  # prefixes: (generation prompt, the turn's end) per answer
    for k, row in enumerate(rows):
        where = f"row {index[k]}, column {spec.messages_column if spec.format == 'messages' else spec.prompt_column}"
        if spec.format == "messages":
            messages = row["messages"]
            turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            cuts = [(messages[:i], messages[: i + 1]) for i in turns]
        else:
            messages = row["prompt"] + row["completion"]
            cuts = [(row["prompt"], messages)]
        full = _render(tokenizer, messages, False, where)
        full_texts.append(full)
        for before, through in cuts:
            a, b = _render(tokenizer, before, True, where), _render(tokenizer, through, False, where)
            if not (full.startswith(a) and full.startswith(b) and len(a) <= len(b)):
                raise DataError(
                    f"{where}: the chat template's renderings of this conversation are not prefixes of "
                    "each other, so its answers cannot be told apart from the rest"
                )
            prefix_texts += [a, b]
            owners.append((k, where))
    full_ids = _ids(tokenizer, full_texts, False)
    prefix_ids = _ids(tokenizer, prefix_texts, False)
    spans: list[list[tuple[int, int]]] = [[] for _ in rows]
    for j, (k, where) in enumerate(owners):
        a, b = prefix_ids[2 * j], prefix_ids[2 * j + 1]
        whole = full_ids[k]
        if whole[: len(a)] != a or whole[: len(b)] != b:
            raise DataError(
                f"{where}: the chat template's renderings of this conversation are not prefixes of each "
                "other in tokens, so its answers cannot be told apart from the rest"
            )
        spans[k].append((len(a), len(b)))
    return _with_targets(full_ids, spans, all_tokens)


def _encode_mixed(rows: Sequence[dict[str, Any]], spec: RowSpec, tokenizer, train_on: str, index: list[int]) -> Encoded:
    """Rows of several formats (a mixture's sources): each format's rows encoded as they would be alone, back in their
    order. Text rows train on every token. Every row is then kept whole (cut at --max_length, not split) when any
    format's rows are: a text row's tail beyond --max_length is cut with it, unless --packing concat."""
    groups: dict[tuple[str, bool], list[int]] = {}
    for k, row in enumerate(rows):
        fmt = row_format(row)
        groups.setdefault((fmt, fmt == "prompt_completion" and not isinstance(row["prompt"], str)), []).append(k)
    ids: list[list[int]] = [[] for _ in rows]
    targets: list[list[bool] | None] = [None for _ in rows]
    whole = False
    for (fmt, conversational), members in groups.items():
        got = encode_rows(
            [rows[k] for k in members],
            spec.part(fmt),
            tokenizer,
            train_on=train_on,
            indices=[index[k] for k in members],
            conversational=conversational,
        )
        whole |= got.whole_rows
        for n, k in enumerate(members):
            ids[k] = got.ids[n]
            targets[k] = got.targets[n] if got.targets is not None else None
    if all(t is None for t in targets):
        return Encoded(ids, None, whole)
    filled = [t if t is not None else [False] + [True] * (len(i) - 1) for i, t in zip(ids, targets)]
    return Encoded(ids, filled, whole)


def _with_targets(ids: list[list[int]], spans: list[list[tuple[int, int]]], all_tokens: bool) -> Encoded:
    if all_tokens:
        return Encoded(ids, None, whole_rows=True)
    targets = []
    for row, row_spans in zip(ids, spans):
        mask = [False] * len(row)
        for a, b in row_spans:
            for t in range(max(1, a), min(b, len(row))):
                mask[t] = True
        targets.append(mask)
    return Encoded(ids, targets, whole_rows=True)


def encode_whole(texts: Sequence[str | list[dict[str, str]]], tokenizer, indices: Sequence[int]) -> list[list[int]]:
    """Whole texts as a reward model reads them (TRL's RewardTrainer): a string with EOS appended as text where it
    does not end with it, tokenized with the tokenizer's special tokens; a conversation through the chat template
    (its own special tokens, no generation prompt)."""
    if not texts:
        return []
    if isinstance(texts[0], str):
        eos = tokenizer.eos_token
        return _ids(tokenizer, [t if t.endswith(eos) else t + eos for t in texts], True)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"row {indices[0]}: the tokenizer has no chat template to render messages; give --chat_template chatml "
            "or a Jinja file"
        )
    return _ids(tokenizer, [_render(tokenizer, m, False, f"row {i}") for m, i in zip(texts, indices)], False)


def encode_prompts(prompts: Sequence[str | list[dict[str, str]]], tokenizer, indices: Sequence[int]) -> list[list[int]]:
    """Prompt rows' token ids, made as a prompt/completion row's prompt is here: a string with the tokenizer's own
    special tokens (a BOS where it adds one; an EOS it would append is left off: the completion follows), a list of
    messages through the chat template with its generation prompt (the template writes its own special tokens).
    (TRL tokenizes a string prompt without special tokens.)"""
    if not prompts:
        return []
    if isinstance(prompts[0], str):
        ids = _ids(tokenizer, list(prompts), True)
        if _appends_eos(tokenizer):
            ids = [row[:-1] for row in ids]
        return ids
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"row {indices[0]}, column prompt: the tokenizer has no chat template to render messages; give "
            "--chat_template chatml or a Jinja file"
        )
    texts = [_render(tokenizer, p, True, f"row {i}, column prompt") for p, i in zip(prompts, indices)]
    return _ids(tokenizer, texts, False)


def generation_prompt(row: dict[str, Any], spec: RowSpec, tokenizer, words: int = 12) -> tuple[str, bool, str]:
    """What a held-out row asks, for generation: (prompt, rendered by the chat template, the row's own answer).

    text: the row's opening words. prompt_completion (and preference, whose own answer is the chosen one): the prompt
    (through the template when it is messages). messages: the conversation up to its first assistant turn, through
    the template. A mixture's row: as its own format says."""
    if spec.parts:
        spec = spec.part(row_format(row))
    if spec.format == "text":
        return " ".join(row["text"].split()[:words]), False, ""
    if spec.format == "prompt":  # the row's own answer: a solution column, where it has one
        answer = str(row.get("solution", "")) if row.get("solution") is not None else ""
        if isinstance(row["prompt"], str):
            return row["prompt"], False, answer
        return render_prompt(tokenizer, row["prompt"]), True, answer
    if spec.format in ("prompt_completion", "preference"):
        completion = row["completion"] if spec.format == "prompt_completion" else row["chosen"]
        if isinstance(row["prompt"], str):
            return row["prompt"], False, completion
        answer = next(m["content"] for m in completion if m["role"] == "assistant")
        return render_prompt(tokenizer, row["prompt"]), True, answer
    messages = row["messages"]
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return render_prompt(tokenizer, messages[:first]), True, messages[first]["content"]
