"""Flags of lm-evaluation-harness's scoring: the trainer's at each save (`--eval_tasks`, lm-eval's flags under the
trainer's `eval_` prefix) and `fsdp-opt evaluate --tasks` (lm-eval's own names), each with lm-eval's meaning."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from fsdp_opt.base import ConfigError
from fsdp_opt.config.flags import flag

# lm-eval's flags as its command has them: name -> (argparse keywords, help)
LM_EVAL_FLAGS: dict[str, tuple[dict, str]] = {
    "tasks": (
        {"default": None},
        "lm-eval tasks, groups or tags (arc_easy,hellaswag), or task YAML files, comma-separated: lm-eval's --tasks",
    ),
    "include_path": ({"default": None}, "a folder of task YAMLs of your own, as lm-eval's --include_path"),
    "num_fewshot": ({"type": int, "default": None}, "examples in each prompt (default: each task's own)"),
    "limit": (
        {"type": float, "default": None},
        "at most this many documents of each task (below 1: a fraction of each), as lm-eval's --limit",
    ),
    "apply_chat_template": (
        {"nargs": "?", "const": True, "default": False},
        "render the prompts through the tokenizer's chat template (the one the run trained with), or the one named",
    ),
    "fewshot_as_multiturn": ({"action": "store_true"}, "few-shot examples as turns of the conversation"),
    "gen_kwargs": (
        {"default": None},
        "generation settings for generate_until tasks, k=v,k=v (do_sample, temperature, ...)",
    ),
    "log_samples": ({"action": "store_true"}, "keep each document's requests and answers (with --output_path)"),
    "output_path": ({"default": None}, "write lm-eval's results JSON (and samples) of each model under this folder"),
    "confirm_run_unsafe_code": ({"action": "store_true"}, "run tasks that execute the code the model writes"),
}


def check_lm_eval_flags(args: argparse.Namespace) -> None:
    """lm-eval's flags of `evaluate` mean nothing without --tasks: one line, not a silent no-op."""
    if args.tasks:
        return
    given = [name for name in LM_EVAL_FLAGS if getattr(args, name) not in (None, False)]
    if given:
        raise ConfigError(f"--{given[0]}: only with --tasks (lm-eval's tasks to score the models on)")


def add_lm_eval_flags(parser: argparse.ArgumentParser) -> None:
    """lm-eval's flags, with its names and meanings (`fsdp-opt evaluate`)."""
    group = parser.add_argument_group("lm-eval (with --tasks: benchmark scores instead of the held-out loss)")
    for name, (kwargs, help_text) in LM_EVAL_FLAGS.items():
        group.add_argument(f"--{name}", help=help_text, **kwargs)


@dataclass
class BenchmarkConfig:
    eval_tasks: str | None = flag(
        None,
        "lm-eval tasks to score the model on at every save (comma-separated task, group or tag names, or task YAML "
        "files; docs/evaluation.md): logged to W&B under lm-eval's names beside the held-out loss, to eval.jsonl and "
        "to the model card. Resolved and read before training: an unknown task stops the run in one line.",
    )
    eval_include_path: str | None = flag(None, "With --eval_tasks: a folder of task YAMLs (lm-eval's --include_path).")
    eval_limit: float | None = flag(
        None, "With --eval_tasks: at most this many documents of each task (below 1: a fraction; lm-eval's --limit)."
    )
    eval_num_fewshot: int | None = flag(
        None, "With --eval_tasks: examples in each prompt (default: each task's own; lm-eval's --num_fewshot)."
    )
    eval_confirm_run_unsafe_code: bool = flag(
        False,
        "With --eval_tasks: run tasks that execute the code the model writes (lm-eval's --confirm_run_unsafe_code).",
    )

    def __post_init__(self) -> None:
        if self.eval_tasks is not None and not self.eval_tasks.replace(",", " ").strip():
            raise ConfigError("--eval_tasks: must not be empty")
        for name in ("eval_include_path", "eval_limit", "eval_num_fewshot", "eval_confirm_run_unsafe_code"):
            if getattr(self, name) not in (None, False) and self.eval_tasks is None:
                raise ConfigError(f"--{name}: only with --eval_tasks")
