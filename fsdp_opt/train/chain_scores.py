"""--eval_tasks: lm-eval's scores of the model at each save, along the chain.

- **Read first.** The tasks are resolved and their data read in `check_flags`, before the chain's lease and before
  anything is built (`read_run_tasks`): an unknown task, data that cannot be read or an unconfirmed unsafe task is
  one line, and nothing trains.
- **Planned.** At setup the tasks' requests are counted and the plan's line says what a scoring costs at each save
  (planner/benchmarks.py): its time, and its memory per GPU beside the training state; the time limit's estimate of a
  save counts the last scoring's seconds.
- **At each save** (every rank, before the checkpoint is gathered): the model scored on the model gathered once
  (engine/benchmarks.py); rank 0 logs the scores to W&B at the save's step under lm-eval's W&B names (beside
  eval/loss: one chart across the chain's sessions, which share the run), appends them to eval.jsonl, and puts them
  in the checkpoint and its Hub index entry under "benchmarks" (the model card's table: a row a range).
- **Once a checkpoint.** A checkpoint keeps the step it was scored at with its scores: a session that resumes it and
  saves at that same step again takes them from there, without scoring again.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

from fsdp_opt.base import ConfigError, picked
from fsdp_opt.config.benchmarks import BenchmarkConfig
from fsdp_opt.config.parse import Config
from fsdp_opt.engine.benchmarks import (
    Scoring,
    Tasks,
    TaskSettings,
    load_tasks,
    metric_table,
    request_counts,
    score,
    wandb_values,
)
from fsdp_opt.model.shapes import Shape, model_config
from fsdp_opt.model.sources import load_tokenizer, max_positions, resolve_model
from fsdp_opt.planner.benchmarks import gathered_scoring_fits, scoring_line, scoring_plan
from fsdp_opt.planner.inputs import Inputs
from fsdp_opt.planner.layout import Layout, run_inputs
from fsdp_opt.runtime.distributed import DistEnv, all_ranks_ok, broadcast_object, cap_gpu_memory, print0
from fsdp_opt.tracking.metrics import EVAL_FILE
from fsdp_opt.tracking.scoretable import BENCHMARKS_KEY, Table, row_line
from fsdp_opt.train.scores import read_tasks
from fsdp_opt.train.session import Session

MAX_CONTEXT = 2048  # lm-eval's default context for a model whose config names none


@dataclass
class ChainScores:
    """A session's scoring: the tasks read, the plan's figures, the steps already scored (from the resumed
    checkpoint, rank 0), and the last scoring's seconds."""

    tasks: Tasks
    plan: dict[str, Any]
    scored: dict[int, Table] = field(default_factory=dict)
    seconds: float = 0.0


def run_settings(config: Config) -> TaskSettings | None:
    """The trainer's --eval_* flags as lm-eval's settings (None without --eval_tasks)."""
    bc = config.benchmark
    if not bc.eval_tasks:
        return None
    return TaskSettings(
        tasks=[t.strip() for t in bc.eval_tasks.split(",") if t.strip()],
        include_path=bc.eval_include_path,
        num_fewshot=bc.eval_num_fewshot,
        limit=bc.eval_limit,
        confirm_run_unsafe_code=bc.eval_confirm_run_unsafe_code,
        flag="--eval_tasks",
    )


def read_run_tasks(config: Config, env: DistEnv) -> Tasks | None:
    """Every rank, with the flags' checks: --eval_tasks resolved and read (None without it)."""
    settings = all_ranks_ok(lambda: run_settings(config))
    return read_tasks(settings) if settings is not None else None


def start_scores(
    tasks: Tasks | None,
    payload: dict[str, Any] | None,
    model_config: Any,  # noqa: ANN401
    tokenizer: Any,  # noqa: ANN401
    env: DistEnv,
    precision: str,
    layout: Layout,
    config: Config,
) -> ChainScores | None:
    """Every rank, at setup: the scoring's plan (one line), and what the resumed checkpoint (`payload`, rank 0's) was
    scored at."""
    if tasks is None:
        return None
    context = max_positions(model_config) or MAX_CONTEXT
    counts = all_ranks_ok(lambda: request_counts(tasks, tokenizer, context))
    inputs = run_inputs(config, env, precision, cap_gpu_memory(config, env))
    gather = all_ranks_ok(
        lambda: gathered_scoring_fits(model_config, env, precision, layout.batch_size, layout.strategy)
    )
    plan = scoring_plan(Shape.of(model_config), layout.strategy, inputs, counts, layout.batch_size, gathered=gather)
    print0(scoring_line(plan) + f": {tasks.describe()}")
    saved = broadcast_object((payload or {}).get(BENCHMARKS_KEY) if env.is_main else None)
    scored = {int(saved["step"]): saved["scores"]} if saved else {}
    return ChainScores(tasks, plan, scored)


def score_at_save(s: Session) -> Table | None:
    """Every rank, at a save: the model's scores (rank 0's; None elsewhere, and without --eval_tasks). Rank 0 logs
    them to W&B at the step and appends them to eval.jsonl."""
    chain: ChainScores | None = s.benchmarks
    if chain is None:
        return None
    step = s.state.global_step
    if step in broadcast_object(list(chain.scored) if s.env.is_main else None):
        print0(f"lm-eval at step {step}: scored already (the checkpoint this session resumed holds its scores)")
        return chain.scored.get(step)
    started = time.perf_counter()
    how = Scoring(s.layout.batch_size, gather=chain.plan["gathered"], seed=s.config.train.seed)
    results = score(s.model, s.tokenizer, s.env, chain.tasks, how, f"step-{step}")
    chain.seconds = time.perf_counter() - started
    if not s.env.is_main:
        return None
    table = metric_table(results)
    chain.scored[step] = table
    record = {
        "step": step,
        "epoch": s.state.epoch,
        "start_idx": s.config.data.start_idx,
        "end_idx": s.end_idx,
        "tasks": chain.tasks.names,
        BENCHMARKS_KEY: table,
        "seconds": round(chain.seconds, 3),
    }
    with (s.out_dir / EVAL_FILE).open("a") as f:
        f.write(json.dumps(record) + "\n")
    s.wandb.log_values(step, wandb_values(table))
    print0(f"lm-eval at step {step}: {row_line(table)} ({chain.seconds:.1f} s)")
    return table


def kept(s: Session, table: Table | None) -> dict[str, Any] | None:
    """What a checkpoint keeps of its scoring: the step and the scores (None: not scored)."""
    return {"step": s.state.global_step, "scores": table} if table is not None else None


def scoring_seconds(s: Session) -> float:
    """The time limit's share of a save for its scoring: the last one measured, else the plan's."""
    chain: ChainScores | None = s.benchmarks
    if chain is None:
        return 0.0
    return 1.5 * (chain.seconds or chain.plan["time"]["seconds"])


def planned_scoring(flags: Any, inputs: Inputs, rates: Any) -> dict[str, Any]:
    """`fsdp-opt plan --eval_tasks ...`: the tasks read, their requests counted (with the model's tokenizer where it
    can be had offline), and the scoring's memory and time at each save (FULL_SHARD, gathered)."""
    bc = BenchmarkConfig(**picked(flags, *(f.name for f in dataclasses.fields(BenchmarkConfig))))
    tasks = load_tasks(run_settings(Config(benchmark=bc)))
    config = model_config(flags.model)  # the planner's: offline for the shapes it knows
    try:
        tokenizer = load_tokenizer(resolve_model(flags.model))
    except ConfigError:  # a Hub model's tokenizer, offline: counted by characters
        tokenizer = None
    counts = request_counts(tasks, tokenizer, max_positions(config) or MAX_CONTEXT)
    plan = scoring_plan(Shape.of(config), "FULL_SHARD", inputs, counts, inputs.batch_size, rates)
    return {**plan, "tasks": tasks.names}
