"""The built-in datasets, made from the Python documentation's paragraphs that ship with the package (no download):
`python-docs` (text), `python-docs-chat` (conversations), `python-docs-prefs` (preference pairs) and
`python-docs-prompts` (prompts with a one-word solution), each with a train and a test split."""

from __future__ import annotations

import re
from typing import Any

from fsdp_opt.base import DataError
from fsdp_opt.config.choices import BUILTIN_DATASETS
from fsdp_opt.data.resolve import DEFAULT_SPLIT
from fsdp_opt.data.table import RowsTable

BUILTIN_DATASET, BUILTIN_CHAT_DATASET, BUILTIN_PREFERENCE_DATASET, BUILTIN_PROMPT_DATASET = BUILTIN_DATASETS


# The built-ins' splits: train, paragraphs of at least 200 characters; test, the shorter ones of 120 to 199
# characters, which no training row holds (held-out rows for --eval_split test).
BUILTIN_SPLITS = {"train": (200, None), "test": (120, 200)}


def _python_docs_paragraphs(min_chars: int, max_chars: int | None = None) -> list[tuple[str, str]]:
    """(the topic's title, a paragraph) of Python's own documentation topics (pydoc_data), in a fixed order."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        title = topics[key].strip().splitlines()[0].strip()
        for para in re.split(r"\n\s*\n", topics[key]):
            text = " ".join(para.split())
            if len(text) >= min_chars and (max_chars is None or len(text) < max_chars):
                out.append((title, text))
    return out


def python_docs_texts(min_chars: int = 200, max_chars: int | None = None) -> list[str]:
    """Paragraphs of Python's own documentation topics (pydoc_data): text with no download."""
    return [text for _, text in _python_docs_paragraphs(min_chars, max_chars)]


CHAT_SYSTEM = "You answer questions about the Python documentation."
CHAT_OPENING_WORDS = 8


def python_docs_chat_rows(min_chars: int = 200, max_chars: int | None = None) -> list[list[dict[str, str]]]:
    """Conversations made from the same paragraphs, offline. The user quotes a paragraph's opening words and asks
    where they come from (the answer: the topic's title). Every other conversation has a system message and a second
    turn, which asks how the paragraph goes on (the answer: its next sentence, at most 40 words)."""
    rows = []
    for k, (title, text) in enumerate(_python_docs_paragraphs(min_chars, max_chars)):
        words = text.split(" ")
        opening, rest = " ".join(words[:CHAT_OPENING_WORDS]), " ".join(words[CHAT_OPENING_WORDS:])
        sentence = re.match(r"(.+?[.:;?!])(\s|$)", rest)
        sentence = " ".join((sentence.group(1) if sentence else rest).split(" ")[:40])
        ask = {
            "role": "user",
            "content": f'Which part of the Python documentation begins a paragraph with "{opening}"?',
        }
        if k % 2:
            rows.append([ask, {"role": "assistant", "content": title}])
            continue
        rows.append(
            [
                {"role": "system", "content": CHAT_SYSTEM},
                ask,
                {"role": "assistant", "content": title},
                {"role": "user", "content": "How does that paragraph go on?"},
                {"role": "assistant", "content": sentence},
            ]
        )
    return rows


def python_docs_preference_rows(min_chars: int = 200, max_chars: int | None = None) -> list[dict[str, list]]:
    """Preference pairs made from python-docs-chat's first question: the prompt is the question (with the system
    message where the conversation has one), the chosen answer the right title, the rejected one a wrong title: that
    of a documentation topic with no paragraph long enough to be a training row (paragraphs of 200 characters or
    more), so the preference is one a small model can learn in a minute (which titles are never the answer) and hold
    on the held-out rows. A held-out row whose right title is itself one of those is left out: its pair would set one
    never-answer title against another, a preference nothing in training teaches."""
    trained = {t for t, _ in _python_docs_paragraphs(BUILTIN_SPLITS["train"][0])}
    titles = sorted({t for t, _ in _python_docs_paragraphs(1)})
    wrong = [t for t in titles if t not in trained]
    rows = []
    for k, conversation in enumerate(python_docs_chat_rows(min_chars, max_chars)):
        first = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
        title = conversation[first]["content"]
        if title in wrong:
            continue
        rejected = next(w for j in range(len(wrong)) if (w := wrong[(k + j) % len(wrong)]) != title)
        rows.append(
            {
                "prompt": conversation[:first],
                "chosen": [{"role": "assistant", "content": title}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    return rows


ONE_WORD = "Answer in one word."


def python_docs_prompt_rows(min_chars: int = 200, max_chars: int | None = None) -> list[dict[str, Any]]:
    """Prompt rows (--method grpo) made from python-docs-chat's first question, asked to be answered in one word:
    {"prompt": [the user's message], "solution": the topic's title, "choices": the documentation's one-word titles,
    "max_words": 1}. The built-in `length` reward checks the form (an answer that ends, in one word), `choice` that
    it is one of the one-word titles; the title is there for a reward of your own."""
    titles = sorted({t for t, _ in _python_docs_paragraphs(1) if len(t.split()) == 1})
    rows = []
    for conversation in python_docs_chat_rows(min_chars, max_chars):
        ask = next(m for m in conversation if m["role"] == "user")
        title = next(m for m in conversation if m["role"] == "assistant")["content"]
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"{ask['content']} {ONE_WORD}"}],
                "solution": title,
                "choices": titles,
                "max_words": 1,
            }
        )
    return rows


def builtin_split(name: str, split: str) -> RowsTable:
    """A built-in dataset's split (python-docs: text; python-docs-chat: conversations; python-docs-prefs: preference
    pairs; python-docs-prompts: prompts), built here from Python's own documentation."""
    if split not in BUILTIN_SPLITS:
        raise DataError(f"--dataset_split {split}: {name} has no such split (its splits: {', '.join(BUILTIN_SPLITS)})")
    low, high = BUILTIN_SPLITS[split]
    if name == BUILTIN_DATASET:
        rows = [{"text": t} for t in python_docs_texts(low, high)]
    elif name == BUILTIN_PREFERENCE_DATASET:
        rows = python_docs_preference_rows(low, high)
    elif name == BUILTIN_PROMPT_DATASET:
        rows = python_docs_prompt_rows(low, high)
    else:
        rows = [{"messages": m} for m in python_docs_chat_rows(low, high)]
    return RowsTable(rows, {"kind": "builtin", "name": name, **({"split": split} if split != DEFAULT_SPLIT else {})})
