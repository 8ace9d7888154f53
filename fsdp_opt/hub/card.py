"""The model card (README.md) of a `--hf_repo` repo, rendered from the repo's checkpoint index.

The index (fsdp_opt_index.json) is the record: every pushed checkpoint with its slice, epoch, global step, loss
and date, plus the run's settings. The card is a view of it, rewritten after every push.
"""

from __future__ import annotations

import math
from typing import Any

from fsdp_opt.base import VERSION
from fsdp_opt.checkpoint.chain import CHAIN_KEY, ChainStatus
from fsdp_opt.checkpoint.drift import CHANGES_KEY
from fsdp_opt.tracking.scoretable import BENCHMARKS_KEY, markdown_rows

# Flags that describe this machine or this session, not the training recipe.
LOCAL_FLAGS = {
    "output_dir",
    "resume_file",
    "export_hf",
    "hf_repo",
    "hub_public",
    "hub_retries",
    "hub_wait",
    "wandb_project",
    "wandb_mode",
    "wandb_new_run",
    "time_limit",
    "keep_last",
    "device",
    "hub_keep_full",
    "disk_budget",
    "session_ranges",
}


def run_info(
    flat_config: dict[str, Any],
    *,
    world_size: int,
    global_batch: int,
    n_params: int,
    rows: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> dict[str, Any]:
    """What the card says about the run: base model, data (the rows' format, the chat template) and hyperparameters
    (never tokens: flags only)."""
    hyper = {k: v for k, v in flat_config.items() if k not in LOCAL_FLAGS and v is not None}
    hyper.update(world_size=world_size, global_batch=global_batch)
    return {
        "base_model": flat_config.get("model"),
        "dataset": flat_config.get("dataset"),
        "text_column": flat_config.get("text_column"),
        "rows": rows or {},
        "chat_template": chat_template if (rows or {}).get("data_format", "text") != "text" else None,
        "parameters": n_params,
        "hyperparameters": hyper,
        "fsdp_opt_version": VERSION,
    }


def _eval_cell(row: dict[str, Any]) -> str:
    if row.get("eval_loss") is None and row.get("eval_reward") is not None:
        return f"reward {row['eval_reward']:.4f}"
    return _fmt_loss(row.get("eval_loss"))


def slices(index: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per trained range, in training order: epochs, global steps, the last loss and date."""
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    entries = sorted(index.get("checkpoints", {}).items(), key=lambda kv: (kv[1].get("global_step", -1), kv[0]))
    for name, e in entries:
        key = (int(e.get("start_idx", -1)), int(e.get("end_idx", -1)))
        row = rows.setdefault(key, {"start": key[0], "end": key[1], "epochs": 0, "first_step": None})
        row["epochs"] = max(row["epochs"], int(e.get("epochs_done", 0)))
        row["last_step"] = e.get("global_step")
        row["loss"] = e.get("loss")
        if e.get("eval_loss") is not None or "eval_loss" not in row:
            row["eval_loss"] = e.get("eval_loss")
        if e.get("eval_reward") is not None:  # --method grpo: its held-out reward in the eval column
            row["eval_reward"] = e.get("eval_reward")
        if e.get(BENCHMARKS_KEY):  # --eval_tasks: the range's newest scores
            row[BENCHMARKS_KEY] = e[BENCHMARKS_KEY]
        row["date"] = e.get("date", "")
        row["latest"] = name
        # Where it is now: its full state, or (retired by --hub_keep_full) only its weights file.
        row["where"] = e.get("path", name) if e.get("full", True) else e.get("weights") or "removed"
    ordered = sorted(rows.values(), key=lambda r: r["last_step"] if r["last_step"] is not None else -1)
    previous = 0
    for row in ordered:
        row["first_step"] = previous + 1
        previous = row["last_step"] or previous
    return ordered


def range_cells(row: dict[str, Any]) -> str:
    """A table row's first cells for a range of `slices`: rows, epochs, global steps, the last loss, held-out."""
    steps = f"{row['first_step']}–{row['last_step']}" if row["last_step"] is not None else "-"
    return (
        f"| [{row['start']}, {row['end']}) | {row['epochs']} | {steps} | {_fmt_loss(row['loss'])} | {_eval_cell(row)} |"
    )


def _fmt_loss(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) and math.isfinite(x) else "-"


def _data_line(run: dict[str, Any]) -> str:
    rows = run.get("rows") or {}
    fmt = rows.get("data_format", "text")
    if fmt == "text":
        return f"text column `{run.get('text_column', 'text')}`"
    columns = ", ".join(f"`{c}`" for c in rows.get("columns", []))
    loss = "the answers only" if rows.get("train_on") == "completion" else "every token"
    return f"{fmt} rows from {columns}, loss on {loss}"


def template_section(run: dict[str, Any]) -> list[str]:
    """The chat template the run rendered its conversations with: the exported tokenizer carries it."""
    if not run.get("chat_template"):
        return []
    return [
        "",
        "## Chat template",
        "",
        "Conversations were rendered with this template, which the exported tokenizer carries: "
        "`tokenizer.apply_chat_template(messages, add_generation_prompt=True)` gives the training format.",
        "",
        "```jinja",
        run["chat_template"],
        "```",
    ]


def benchmarks_section(rows: list[dict[str, Any]]) -> list[str]:
    """--eval_tasks: lm-eval's scores of each range's newest checkpoint, a row a range, each metric with its stderr."""
    scored = [(f"[{r['start']}, {r['end']})", r[BENCHMARKS_KEY]) for r in rows if r.get(BENCHMARKS_KEY)]
    if not scored:
        return []
    return ["", "## Benchmarks (lm-evaluation-harness)", "", *markdown_rows(scored, "rows")]


def render_card(repo_id: str, index: dict[str, Any]) -> str:
    run = index.get("run", {})
    base, dataset = run.get("base_model") or "unknown", run.get("dataset") or "unknown"
    rows = slices(index)
    latest = max(index.get("checkpoints", {}).items(), key=lambda kv: kv[1].get("global_step", -1), default=(None, {}))
    exported = index.get("export")
    hyper = run.get("hyperparameters", {})
    lora_rank = int(hyper.get("lora_rank") or 0)
    adapter = bool(exported and exported.get("adapter"))
    library = "peft" if adapter else "transformers"
    meta = ["---", f"library_name: {library}", "pipeline_tag: text-generation", "tags:", "- fsdp-opt", "- causal-lm"]
    if lora_rank:
        meta.append("- lora")
    if "/" in base:
        meta.append(f"base_model: {base}")
    if "/" in dataset:
        meta += ["datasets:", f"- {dataset}"]
    meta.append("---")
    out = meta + [
        "",
        f"# {repo_id.split('/')[-1]}",
        "",
        f"Fine-tuned from **{base}** on **{dataset}** ({_data_line(run)}) with "
        f"fsdp-opt {run.get('fsdp_opt_version', '')}".rstrip()
        + ", one session per row range. The sessions resume each other exactly, so together they are "
        "one training run."
        + (
            f" LoRA adapters of rank {lora_rank} were trained on the frozen base; the checkpoints hold the adapters "
            "only, never the base."
            if lora_rank
            else ""
        ),
        "",
        "## Slices trained",
        "",
        "| rows | epochs | global steps | final loss | eval loss | date (UTC) | latest checkpoint |",
        "|---|---|---|---|---|---|---|",
    ]
    out += [f"{range_cells(r)} {r['date']} | `{r['where']}` |" for r in rows]
    if not rows:
        out.append("| - | - | - | - | - | - | - |")
    out += benchmarks_section(rows)
    storage = index.get("storage")
    if storage:
        out += [
            "",
            f"Repo storage: {storage['bytes'] / 1e9:,.2f} GB ({storage['full_checkpoints']} full resumable "
            f"checkpoint(s) under `checkpoints/`, {storage['weights_files']} fp16 weights file(s) under `weights/`, "
            f"measured {storage.get('date', '')}). The newest full checkpoints stay resumable; older ranges keep "
            "their weights file (`--hub_keep_full`).",
        ]
    out += template_section(run)
    out += ["", "## Hyperparameters (latest session)", "", "| setting | value |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in sorted(hyper.items())]
    if run.get("parameters"):
        out += ["", f"Parameters: {run['parameters']:,}."]
    out += ["", "## Load the model", ""]
    if adapter:
        out += [
            f"The LoRA adapter of the latest session is at the root of this repo ({exported.get('dtype', 'fp16')}, "
            f"global step {exported.get('global_step', '?')}). It needs its base model, **{base}**:",
            "",
            "```python",
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f'base = AutoModelForCausalLM.from_pretrained("{base}")',
            f'model = PeftModel.from_pretrained(base, "{repo_id}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{base}")',
            "```",
        ]
    elif exported:
        out += [
            "The final model of the latest session is at the root of this repo (safetensors, "
            f"{exported.get('dtype', 'fp16')}, exported at global step {exported.get('global_step', '?')}):",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
            "```",
        ]
    else:
        out += ["No exported model yet (train with `--export_hf DIR --hf_repo ...` to push one). Export a checkpoint:"]
    if latest[0]:
        out += [
            "",
            "```bash",
            f"hf download {repo_id} {latest[1].get('path', latest[0])} --local-dir .",
            f"python -m fsdp_opt.export {latest[1].get('path', latest[0])} exported --dtype fp16",
            "```",
        ]
    weights = sorted({r["where"] for r in rows if r["where"].startswith("weights/")})
    if weights:
        out += [
            "",
            "A range whose full state was retired keeps its weights (fp16 safetensors); evaluate, export or resume from it:",
            "",
            "```bash",
            f"hf download {repo_id} {weights[-1]} --local-dir .",
            f"python -m fsdp_opt.export {weights[-1]} exported --dtype fp16",
            "```",
        ]
    chain = ChainStatus.from_dict(latest[1].get(CHAIN_KEY)) if latest[0] else None
    if chain is not None:
        out += [
            "",
            "## Where the chain stands",
            "",
            f"As of `{latest[0]}` (global step {latest[1].get('global_step', '?')}, {latest[1].get('date', '')}):",
            "",
        ]
        out += [f"- **{what}**: {where}" for what, where in chain.items()]
    changes = latest[1].get(CHANGES_KEY) if latest[0] else None
    if changes:
        out += [
            "",
            "## Settings changed along the chain",
            "",
            "| from global step | flag | was | now | exactness |",
            "|---|---|---|---|---|",
        ]
        out += [
            f"| {c.get('step', '?')} | `--{c['flag']}` | {c['from']} | {c['to']} | "
            f"{'broken (--allow_changes): ' + c['breaks'] if c.get('breaks') else 'kept (a choice)'} |"
            for c in changes
        ]
    lora = f" --lora_rank {lora_rank}" if lora_rank else ""
    out += ["", "## Resume training", ""]
    if chain is not None and chain.range_size and chain.passes:
        out += [
            "Every session runs the same command, even on an empty machine: it finds the newest checkpoint here "
            "(`checkpoints/`, listed in `fsdp_opt_index.json`) and trains the range after it, or finishes the range it "
            "stopped in.",
            "",
            "```bash",
            f"torchrun --standalone --nproc_per_node=gpu fsdp_finetune.py --model {base} --dataset {dataset} \\",
            f"  --start_idx auto --range_size {chain.range_size} --num_epochs {chain.passes} --hf_repo {repo_id}{lora}",
            "```",
        ]
    else:
        last_end = rows[-1]["end"] if rows else 0
        span = (rows[-1]["end"] - rows[-1]["start"]) if rows else 5000
        out += [
            "Checkpoints are under `checkpoints/` and `fsdp_opt_index.json` lists them. A new session, even on an "
            "empty machine, continues the global step from the newest one:",
            "",
            "```bash",
            f"torchrun --standalone --nproc_per_node=gpu fsdp_finetune.py --model {base} --dataset {dataset} \\",
            f"  --start_idx {last_end} --end_idx {last_end + span} --resume_file latest --hf_repo {repo_id}{lora}",
            "```",
        ]
    out += [
        "",
        "Keep the other flags of the earlier sessions (batch size, accumulation, learning rate) so the run stays one run.",
        "",
    ]
    return "\n".join(out)
