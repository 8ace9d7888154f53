"""The model card of an exported model repo (`fsdp-opt export CHECKPOINT --push_to_hub user/name`): metadata the Hub
reads (base_model, datasets, library_name, tags) and a text that says what made the model: the method, each range
trained with its data pin, the held-out figures, the benchmark scores where the chain recorded them, the W&B run, and
the commands.

Its record is the chain's own: the checkpoint repo's index (fsdp_opt_index.json, as hub/card.py renders it) when the
checkpoint names its repo and the Hub answers, else the checkpoint itself (its chain status, data pin and flags).
Benchmark scores are an index entry's `benchmarks`: {task: {"<metric>,<filter>": value, "<metric>_stderr,<filter>":
value}}, lm-eval's own result keys.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from fsdp_opt.base import looks_like_path
from fsdp_opt.checkpoint.chain import CHAIN_KEY, ChainStatus
from fsdp_opt.config.parse import build_parser
from fsdp_opt.data.pin import PIN_KEY, described
from fsdp_opt.hub.card import LOCAL_FLAGS, range_cells, slices, template_section

BENCHMARKS_KEY = "benchmarks"  # of an index entry (lm-eval's results, issue 72)


def record_from_checkpoint(payload: dict[str, Any], name: str) -> dict[str, Any]:
    """An index of one entry, made from a checkpoint's own metadata (when its repo's index cannot be read)."""
    flags = payload.get("config") or {}
    start, end = (payload.get("slice") or {}).get("start_idx"), (payload.get("slice") or {}).get("end_idx")
    chain = payload.get(CHAIN_KEY) or {}
    entry = {
        "global_step": payload.get("GLOBAL_STEP"),
        "epochs_done": payload.get("EPOCHS_RUN", 0),
        "start_idx": start if start is not None else chain.get("start", flags.get("start_idx", 0)),
        "end_idx": end if end is not None else chain.get("end", flags.get("end_idx", 0)),
        "loss": payload.get("last_loss"),
        CHAIN_KEY: payload.get(CHAIN_KEY),
        PIN_KEY: payload.get(PIN_KEY),
    }
    return {"checkpoints": {name: entry}, "run": {"base_model": flags.get("model"), "dataset": flags.get("dataset")}}


def _hub_id(name: str) -> bool:
    """A Hub id (owner/name), which the metadata may name; not a local path."""
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", name)) and not looks_like_path(name) and not Path(name).exists()


def _pin_cell(pin: dict[str, Any] | None, start: int, end: int) -> str:
    for r in (pin or {}).get("ranges", []):
        if (r.get("start"), r.get("end")) == (start, end):
            return f"rows `{r.get('rows', '?')[:12]}`, tokens `{r.get('tokens', '?')[:12]}`"
    return "-"


def _score(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) and math.isfinite(value) else str(value)


def benchmark_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One table row per range, task and metric: lm-eval's `metric,filter` value with its stderr."""
    out = []
    for r in rows:
        for task, results in sorted((r.get(BENCHMARKS_KEY) or {}).items()):
            for key, value in sorted(results.items()):
                metric, _, filt = key.partition(",")
                if metric.endswith("_stderr") or not isinstance(value, (int, float)):
                    continue
                err = results.get(f"{metric}_stderr,{filt}")
                stderr = f" ± {_score(err)}" if isinstance(err, (int, float)) else ""
                out.append(
                    f"| [{r['start']}, {r['end']}) | {task} | {metric} ({filt or 'none'}) | {_score(value)}{stderr} |"
                )
    return out


def command_flags(flags: dict[str, Any]) -> str:
    """The run's training flags that differ from their defaults, as a command line's arguments."""
    defaults = vars(build_parser().parse_args([]))
    parts = []
    for key, value in sorted(flags.items()):
        if key in LOCAL_FLAGS or key not in defaults or value is None or str(value) == str(defaults[key]):
            continue
        parts.append(f"--{key} {value}")
    return " ".join(parts)


def render_model_card(
    repo_id: str,
    index: dict[str, Any],
    *,
    flags: dict[str, Any],
    method: str,
    export_command: str,
    wandb: str | None,
    adapter: bool,
    dtype: str,
    ggufs: list[str],
    chat_template: str | None,
) -> str:
    run = index.get("run") or {}
    base = run.get("base_model") or flags.get("model") or "unknown"
    dataset = run.get("dataset") or flags.get("dataset") or "unknown"
    rows = slices(index)
    entries = index.get("checkpoints", {})
    for r in rows:  # the newest entry of each range that has benchmark scores
        with_scores = [e for e in entries.values() if (e.get("start_idx"), e.get("end_idx")) == (r["start"], r["end"])]
        scored = [e for e in with_scores if e.get(BENCHMARKS_KEY)]
        if scored:
            r[BENCHMARKS_KEY] = max(scored, key=lambda e: e.get("global_step", -1))[BENCHMARKS_KEY]
    latest = max(entries.values(), key=lambda e: e.get("global_step", -1), default={})
    pin = latest.get(PIN_KEY)
    meta = ["---", f"library_name: {'peft' if adapter else 'transformers'}", "pipeline_tag: text-generation", "tags:"]
    meta += ["- fsdp-opt", "- causal-lm", f"- {method}"] + (["- lora"] if flags.get("lora_rank") else [])
    meta += ["- gguf"] if ggufs else []
    if _hub_id(base):
        meta.append(f"base_model: {base}")
    if _hub_id(dataset):
        meta += ["datasets:", f"- {dataset}"]
    meta.append("---")
    lora = f", LoRA rank {flags['lora_rank']} (merged into the base)" if flags.get("lora_rank") and not adapter else ""
    lora = f", LoRA rank {flags['lora_rank']} (the adapter: it needs its base)" if adapter else lora
    out = meta + [
        "",
        f"# {repo_id.split('/')[-1]}",
        "",
        f"**{base}** fine-tuned on **{dataset}** with fsdp-opt: method **{method}**{lora}, {dtype} safetensors. It was "
        "trained as a chain of sessions over row ranges of the data, each resuming the last exactly: one training run.",
        "",
        "## Ranges trained",
        "",
        f"Data: {described((pin or {}).get('source'))}. Each range's pin is the fingerprint of its rows and of their "
        "tokens, as the chain checked them.",
        "",
        "| rows | epochs | global steps | final loss | held-out | data pin | date (UTC) |",
        "|---|---|---|---|---|---|---|",
    ]
    out += [f"{range_cells(r)} {_pin_cell(pin, r['start'], r['end'])} | {r.get('date') or '-'} |" for r in rows]
    scores = benchmark_lines(rows)
    out += ["", "## Benchmarks", ""]
    if scores:
        out += [
            "lm-eval's scores, as the chain recorded them:",
            "",
            "| rows | task | metric | value |",
            "|---|---|---|---|",
        ]
        out += scores
    else:
        out.append("No benchmark scores were recorded for these ranges.")
    chain = ChainStatus.from_dict(latest.get(CHAIN_KEY))
    if chain is not None:
        out += ["", "## Where the chain stands", ""] + [f"- **{what}**: {where}" for what, where in chain.items()]
    out += ["", "## Tracking", "", f"W&B run: {wandb}." if wandb else "No W&B run was recorded."]
    out += template_section({"chat_template": chat_template})
    out += ["", "## Use it", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer"]
    if adapter:
        out += [
            "from peft import PeftModel",
            f'model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{base}"), "{repo_id}")',
        ]
    else:
        out.append(f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")')
    out += [f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")', "```"]
    for name in ggufs:
        out.append(f"\n`{name}`: llama.cpp (`llama-cli -m {name}`), LM Studio, or Ollama with its Modelfile.")
    train = command_flags(flags)
    out += [
        "",
        "## Commands",
        "",
        "```bash",
        f"fsdp-opt train {train}".rstrip() + (" --start_idx auto" if chain and chain.range_size else ""),
        export_command,
        "```",
        "",
    ]
    return "\n".join(out)
