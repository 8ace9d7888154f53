"""An evaluation report (`python -m fsdp_opt.evaluate --json`, train/compare.py) as Markdown: the table of the models
scored, in the method's own form, and the answers they gave side by side (what notebooks/02_evaluate shows)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def report_markdown(results: dict[str, Any] | str | Path) -> str:
    """An evaluation report (`--json`) as Markdown: the table of models, then the samples side by side."""
    if not isinstance(results, dict):
        results = json.loads(Path(results).read_text())
    lines = list(results["table"])  # the method's table of the models, made when they were scored
    cell = lambda text: text.strip().replace("|", "\\|").replace(chr(10), " / ")  # noqa: E731
    for sample in results.get("samples", []):
        lines += ["", f"**Prompt:** {cell(sample['prompt'])}", "", "| model | continuation |", "| --- | --- |"]
        if sample.get("answer"):
            lines.append(f"| the row's own answer | {cell(sample['answer'])} |")
        for name, text in sample["outputs"].items():
            lines.append(f"| {name} | {cell(text)} |")
    return "\n".join(lines)


def answers_markdown(results: dict[str, Any] | str | Path) -> str:
    """The generated answers as one table: a row per held-out prompt, the row's own answer, then a column per model."""
    if not isinstance(results, dict):
        results = json.loads(Path(results).read_text())
    samples = results.get("samples", [])
    if not samples:
        return "No prompts were asked."
    cell = lambda text: text.strip().replace("|", "\\|").replace(chr(10), " / ")  # noqa: E731
    names = list(samples[0]["outputs"])
    lines = ["| prompt | the row's own answer | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for sample in samples:
        asked = sample["prompt"]
        if results.get("end_of_turn"):  # a rendered conversation: its last user turn is the question
            asked = asked.rsplit("user", 1)[-1]
        outputs = [cell(sample["outputs"][n]) for n in names]
        lines.append(f"| {cell(asked)[-200:]} | {cell(sample.get('answer', ''))} | " + " | ".join(outputs) + " |")
    return "\n".join(lines)
