"""lm-eval's scores as the run keeps them (`{task: {"acc,none": v, "acc_stderr,none": v}}`: lm-eval's result keys,
under "benchmarks" in eval.jsonl and in each checkpoint's index entry) and as tables show them: a column a task
metric, with its stderr. Plain data, no lm-eval import: the model card and the notebook read it anywhere."""

from __future__ import annotations

from typing import Any

BENCHMARKS_KEY = "benchmarks"  # of an index entry and an eval.jsonl line: the scores, as lm-eval keys them

Table = dict[str, dict[str, float]]


def stderr_key(key: str) -> str:
    """The stderr's key of a metric's: "acc,none" -> "acc_stderr,none"."""
    metric, _, kind = key.partition(",")
    return f"{metric}_stderr,{kind}"


def columns(tables: list[Table]) -> list[tuple[str, str]]:
    """(task, metric key) of every metric in the tables (not the stderrs), in the order first seen."""
    seen: dict[tuple[str, str], None] = {}
    for table in tables:
        for task, values in table.items():
            for key in values:
                if not key.partition(",")[0].endswith("_stderr"):
                    seen[(task, key)] = None
    return list(seen)


def heading(task: str, key: str) -> str:
    """A column's name: the task and the metric, lm-eval's filter named unless it is none."""
    return f"{task} {key.replace(',none', '')}"


def cell(values: dict[str, float], key: str) -> str:
    """A metric with its stderr, as lm-eval's own table shows them ("-": not scored)."""
    if key not in values:
        return "-"
    spread = values.get(stderr_key(key))
    return f"{values[key]:.4f}" + (f" ± {spread:.4f}" if spread is not None else "")


def markdown_rows(named: list[tuple[str, Table]], first: str = "model") -> list[str]:
    """A Markdown table: one row a (name, scores), a column a task metric with its stderr."""
    heads = columns([table for _, table in named])
    lines = [f"| {first} | " + " | ".join(heading(t, k) for t, k in heads) + " |", "| --- |" + " --- |" * len(heads)]
    for name, table in named:
        lines.append(f"| {name} | " + " | ".join(cell(table.get(t, {}), k) for t, k in heads) + " |")
    return lines


def row_line(table: Table) -> str:
    """Scores in one line."""
    return ", ".join(f"{heading(t, k)} {table[t][k]:.4f}" for t, k in columns([table])) or "no metric"


def series(records: list[dict[str, Any]]) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """eval.jsonl's scored lines as (task, metric) -> [(the range's end row, value)], in training order."""
    out: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for record in records:
        table = record.get(BENCHMARKS_KEY)
        if not table:
            continue
        for task, key in columns([table]):
            out.setdefault((task, key), []).append((int(record.get("end_idx", record["step"])), table[task][key]))
    return out
