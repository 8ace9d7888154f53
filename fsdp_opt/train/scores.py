"""`fsdp-opt evaluate --tasks ...`: the base model and each checkpoint scored on lm-eval's tasks, one in memory at a
time, each loaded into the same sharded model as train/compare.py loads it (a LoRA checkpoint's adapters on its base,
an exported folder), and scored on every rank (engine/benchmarks.py). The report has one row a model and a column a
task metric with its stderr; --output_path gets lm-eval's own results JSON (and samples) for each model."""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

import torch

from fsdp_opt.base import ConfigError
from fsdp_opt.checkpoint.atomic import atomic_save_text
from fsdp_opt.config.methods import CAUSAL_LM, DEFAULT_METHOD, spec
from fsdp_opt.config.training import ModelConfig
from fsdp_opt.engine.benchmarks import (
    Scoring,
    Tasks,
    TaskSettings,
    load_tasks,
    metric_table,
    new_manager,
    new_tracker,
    score,
    write_output,
)
from fsdp_opt.engine.decoding import Decoder
from fsdp_opt.model.parallelize import resolve_precision
from fsdp_opt.model.sources import load_model_config, load_tokenizer, resolve_model
from fsdp_opt.planner.benchmarks import gathered_scoring_fits
from fsdp_opt.runtime.distributed import DistEnv, all_ranks_ok, broadcast_object, print0, rank0_first
from fsdp_opt.tracking.scoretable import markdown_rows, row_line
from fsdp_opt.train.compare import find_models, load_candidate


def task_settings(args: argparse.Namespace, prefix: str = "") -> TaskSettings:
    """lm-eval's flags of a command (`prefix` "eval_": the trainer's) as TaskSettings."""
    named = lambda name: getattr(args, prefix + name, None)  # noqa: E731
    return TaskSettings(
        tasks=[t.strip() for t in (named("tasks") or "").split(",") if t.strip()],
        include_path=named("include_path"),
        num_fewshot=named("num_fewshot"),
        limit=named("limit"),
        apply_chat_template=named("apply_chat_template") or False,
        fewshot_as_multiturn=bool(named("fewshot_as_multiturn")),
        gen_kwargs=named("gen_kwargs"),
        confirm_run_unsafe_code=bool(named("confirm_run_unsafe_code")),
        log_samples=bool(named("log_samples")),
        flag=f"--{prefix}tasks",
    )


def read_tasks(settings: TaskSettings) -> Tasks:
    """Every rank: the tasks read, rank 0 first (its download fills the cache the others read), one line on a user
    error, agreed by all."""
    manager = all_ranks_ok(lambda: new_manager(settings))  # its index, on every rank at once
    return rank0_first(lambda: load_tasks(settings, manager))


def benchmark(args: argparse.Namespace, env: DistEnv) -> dict[str, Any]:
    """Every rank: the tasks read first, then the base and each checkpoint scored in turn. The report on rank 0."""
    settings = task_settings(args)
    tasks = read_tasks(settings)
    found = all_ranks_ok(lambda: find_models(args) if env.is_main else None) if args.checkpoints else ([], {}, {})
    entries, trained, _ = broadcast_object(found)
    if spec(trained.get("method") or DEFAULT_METHOD).head != CAUSAL_LM:
        raise ConfigError(
            f"--tasks: {entries[0]['name']} is a {trained['method']} model, which scores sequences; lm-eval's tasks "
            "score a causal language model"
        )
    folder = next((e["path"] for e in entries if e["kind"] == "hf"), None)  # an exported model names its own
    model_name = args.model or trained.get("model") or folder or ModelConfig.model
    source = all_ranks_ok(lambda: resolve_model(model_name))
    precision = all_ranks_ok(lambda: resolve_precision(args.precision, env.device))
    model_config, tokenizer = rank0_first(lambda: (load_model_config(source), load_tokenizer(source)))
    template = trained.get("chat_template_text")
    if template and args.apply_chat_template:
        tokenizer.chat_template = template  # the template the run trained with
    seed = args.seed if args.seed is not None else int(trained.get("seed", 42))
    gather = args.gather_model == "true" or (
        args.gather_model == "auto"
        and all_ranks_ok(
            lambda: gathered_scoring_fits(model_config, env, precision, args.batch_size, args.sharding_strategy)
        )
    )
    candidates = ([] if args.no_base else [{"name": f"base ({model_name})", "kind": "base"}]) + entries
    print0(
        f"scoring {len(candidates)} model(s) on {tasks.describe()} (lm-eval), {env.world_size} rank(s), {precision}, "
        f"on {'the model gathered once' if gather else 'the shards'}"
        + (f", --limit {settings.limit:g}" if settings.limit else "")
    )
    decoder = Decoder(graphs=args.decoding == "graphs" and env.device.type == "cuda")
    how = Scoring(args.batch_size, gather, decoder, seed)
    rows = []
    for entry in candidates:
        model = load_candidate(entry, source, model_config, CAUSAL_LM, precision, args.sharding_strategy, seed, env)
        tracker = new_tracker(args.output_path) if env.is_main else None
        label = entry["name"].split(" (")[0]
        results = score(model, tokenizer, env, tasks, how, label, tracker)
        if env.is_main:
            table = metric_table(results)
            rows.append({"name": entry["name"], "kind": entry["kind"], "path": entry.get("path"), "benchmarks": table})
            print0(f"  {entry['name']}: {row_line(table)}")
            if tracker is not None:
                write_output(tracker, results, settings.log_samples)
        model = None
        gc.collect()
        if env.device.type == "cuda":
            torch.cuda.empty_cache()
    report = {
        "tasks": tasks.names,
        "limit": settings.limit,
        "num_fewshot": settings.num_fewshot,
        "world_size": env.world_size,
        "precision": precision,
        "models": rows,
    }
    if env.is_main:
        print(benchmarks_markdown(report))
        if args.output_path:
            print(f"lm-eval's results (and samples) of each model under {args.output_path}")
        if args.json:
            atomic_save_text(json.dumps(report, indent=1), Path(args.json))
            print(f"wrote {args.json}")
    return report


def benchmarks_markdown(report: dict[str, Any]) -> str:
    """One row a model (base, then each checkpoint), a column a task metric with its stderr."""
    title = (
        f"lm-eval scores ({', '.join(report['tasks'])}"
        + (f", --limit {report['limit']:g}" if report.get("limit") else "")
        + (f", {report['num_fewshot']}-shot" if report.get("num_fewshot") is not None else "")
        + "):"
    )
    return "\n".join([title, "", *markdown_rows([(m["name"], m["benchmarks"]) for m in report["models"]])])
