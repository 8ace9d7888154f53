"""Writes the lm-eval tasks docs/tasks/ ships (their data from the held-out split of the built-in python-docs: the
paragraphs of 120 to 199 characters no training row holds):

- pydocs_choice: a paragraph's opening words, and which of four continuations is its own (multiple_choice);
- pydocs_complete: a paragraph's opening words, and its next words generated (generate_until);
- pydocs_perplexity: each paragraph's perplexity (loglikelihood_rolling).

    python scripts/build_tasks.py      # rewrites docs/tasks/*.jsonl
"""

from __future__ import annotations

import json
from pathlib import Path

from fsdp_opt.data.builtins import BUILTIN_SPLITS, python_docs_texts

OUT = Path(__file__).resolve().parents[1] / "docs" / "tasks"
ITEMS = 60  # documents of each task
OPENING = 8  # words of a paragraph the model is given
CONTINUATION = 4  # words of each choice


def main() -> None:
    texts = python_docs_texts(*BUILTIN_SPLITS["test"])[:ITEMS]
    words = [t.split(" ") for t in texts]
    choice, complete, perplexity = [], [], []
    for i, w in enumerate(words):
        context = " ".join(w[:OPENING])
        own = " " + " ".join(w[OPENING : OPENING + CONTINUATION])
        others = [" " + " ".join(words[(i + k) % len(words)][OPENING : OPENING + CONTINUATION]) for k in (7, 13, 19)]
        label = i % 4
        choices = others[:label] + [own] + others[label:]
        choice.append({"context": context, "choices": choices, "label": label})
        complete.append({"context": context, "target": " ".join(w[OPENING : OPENING + 2])})
        perplexity.append({"text": texts[i]})
    for name, rows in (("pydocs_choice", choice), ("pydocs_complete", complete), ("pydocs_perplexity", perplexity)):
        (OUT / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
