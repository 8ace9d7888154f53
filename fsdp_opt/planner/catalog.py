"""The table of what fits: every model of the built-in catalogue (model/catalog.py), for full fine-tuning, LoRA and
LoRA on a 4-bit base, each at the fastest configuration the search finds for the GPUs given. `python -m fsdp_opt.plan
--catalog` prints it; docs/models.md's table is that output (a test holds them equal)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fsdp_opt.base import gib
from fsdp_opt.model.catalog import SHAPES
from fsdp_opt.model.shapes import Shape, model_config
from fsdp_opt.planner.inputs import Inputs
from fsdp_opt.planner.search import SUGGESTED_RANK, Limits, Space, recommend
from fsdp_opt.planner.steptime import Rates

MODES = (
    ("full fine-tuning", {}),
    (f"LoRA r{SUGGESTED_RANK}", {"lora_rank": SUGGESTED_RANK}),
    (f"LoRA r{SUGGESTED_RANK}, 4-bit base", {"lora_rank": SUGGESTED_RANK, "base_bits": 4}),
)


def catalog_rows(
    inputs: Inputs, samples: int, rates: Rates, space: Space, host_memory: int | None
) -> list[dict[str, Any]]:
    """Per model and mode: the recommended configuration (None: nothing fits), its peak and step time, tokens/h."""
    rows = []
    for name in SHAPES:
        shape = Shape.of(model_config(name))
        row: dict[str, Any] = {"model": name, "params": shape.params, "modes": {}}
        for mode, change in MODES:
            best = recommend(shape, replace(inputs, **change), samples, Limits(rates, space, host_memory))
            row["modes"][mode] = (
                None
                if best is None
                else {
                    "peak_bytes": best["peak_bytes"],
                    "step_s": best["predicted_step_time_s"],
                    "tokens_per_hour": samples * inputs.max_length * 3600 / best["predicted_step_time_s"],
                    "batch_size": best["batch_size"],
                    "accum_steps": best["accum_steps"],
                    "strategy": best["sharding_strategy"],
                }
            )
        rows.append(row)
    return rows


def render_catalog(rows: list[dict[str, Any]], inputs: Inputs, samples: int) -> str:
    head = (
        f"Predicted by `python -m fsdp_opt.plan --catalog` for {inputs.gpus} GPU(s) of {gib(inputs.gpu_memory)}, "
        f"{inputs.precision}, {samples} sequences of {inputs.max_length} tokens per step (the fastest configuration "
        "the search finds; tokens/h are the tokens the step runs, prompts included). Predictions, not measurements."
    )
    lines = [
        head,
        "",
        "| model | parameters | " + " | ".join(m for m, _ in MODES) + " |",
        "| --- | --- |" + " --- |" * len(MODES),
    ]
    for row in rows:
        cells = []
        for mode, _ in MODES:
            r = row["modes"][mode]
            cells.append(
                "does not fit"
                if r is None
                else f"{gib(r['peak_bytes'])}, {r['step_s']:.1f} s/step, {r['tokens_per_hour'] / 1e6:.2f} M tok/h"
            )
        lines.append(f"| {row['model']} | {row['params'] / 1e9:.2f} B | " + " | ".join(cells) + " |")
    return "\n".join(lines)
