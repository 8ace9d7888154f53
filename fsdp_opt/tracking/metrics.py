"""metrics.jsonl, the run's step log and a contract: its fields are `METRICS_FIELDS`, one line per optimizer step,
appended across sessions (a resumed run logs again from where it stopped), one record per step: the records of steps
a session trains again (after a kill past its last checkpoint, or with --overwrite) move aside first (set_aside)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"

EVAL_FILE = "eval.jsonl"  # one line per --eval_rows evaluation: step, epoch, rows, loss, perplexity, tokens, seconds

# One JSON object per optimizer step, in this order. Tests and tools read this tuple.
METRICS_FIELDS = (
    "step",  # global optimizer step, after this update (1-based, continues across sessions)
    "epoch",  # epoch of the current slice, 0-based
    "loss",  # mean loss over every target token of the step, all micro-batches and ranks
    "lr",
    "grad_norm",  # global L2 norm of the unscaled gradients, before clipping
    "loss_scale",  # fp16 loss scale used for the step (1.0 without scaling)
    "tokens",  # tokens trained: the step's targets (answer tokens under --train_on completion), all ranks
    "tokens_seen",  # real (non-pad) tokens the step ran through the model, all ranks; `mfu` counts these
    "tokens_per_second",  # tokens trained per second
    "elapsed",  # seconds since this session's training started
    "skipped",  # true when the step was skipped for a non-finite gradient
    "skipped_steps",  # skipped steps so far in the run
    "slice",  # the rows this session trains, "start-end"
    "skipped_rate",  # share of the last 20 steps (fewer at the start) skipped for a non-finite gradient (fp16 overflow)
)
# A method's own fields follow these (its spec's `fields`: config/methods/).
COMPLETIONS_FILE = "completions.jsonl"  # --method grpo: one line per completion: step, row, prompt, completion, ...
# The logs keyed by global step, and where set_aside moves the records of steps trained again: metrics.replaced.jsonl
STEP_LOGS = (METRICS_FILE, EVAL_FILE, COMPLETIONS_FILE)
REPLACED = ".replaced.jsonl"


class MetricsWriter:
    """Appends to output_dir/metrics.jsonl (rank 0 only)."""

    def __init__(self, output_dir: str | os.PathLike, enabled: bool):
        self.path = Path(output_dir) / METRICS_FILE
        self.enabled = enabled

    def write(self, record: dict[str, Any], method_fields: tuple[str, ...] = ()) -> None:
        """`method_fields`: those the run's method adds (its spec's `fields`), which the record must hold too."""
        if not self.enabled:
            return
        missing = [f for f in (*METRICS_FIELDS, *method_fields) if f not in record]
        if missing:
            raise KeyError(f"metrics record lacks {missing}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of metrics.jsonl; `path` is the file or the output_dir holding it (none there yet: [])."""
    p = Path(path)
    p = p if p.suffix == ".jsonl" else p / METRICS_FILE
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def set_aside(output_dir: str | os.PathLike, step: int) -> dict[str, int]:
    """Before a session logs its first step: the records of steps after `step`, where it starts, are of an earlier
    run of the steps it trains now (one killed after its last checkpoint, or a range trained again with
    --overwrite). They move from each step log to its `.replaced.jsonl` beside it (appended: nothing is lost), so
    each log keeps one record per step of the chain. Returns {log file: records moved} (rank 0)."""
    moved = {}
    for name in STEP_LOGS:
        path = Path(output_dir) / name
        if not path.exists():
            continue
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        later = [line for line in lines if _step(line) > step]
        if not later:
            continue
        with path.with_name(path.name.removesuffix(".jsonl") + REPLACED).open("a") as f:
            f.write("".join(line + "\n" for line in later))
        kept = path.with_name(path.name + ".tmp")
        kept.write_text("".join(line + "\n" for line in lines if _step(line) <= step))
        os.replace(kept, path)
        moved[name] = len(later)
    return moved


def _step(line: str) -> int:
    """A record's global step; -1 for a line that is not a record (kept where it is)."""
    try:
        return int(json.loads(line).get("step", -1))
    except (ValueError, AttributeError, TypeError):
        return -1
