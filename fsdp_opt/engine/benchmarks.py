"""Benchmark scores through lm-evaluation-harness: its tasks (names, groups, tags, or task YAML files), read before
anything is built, and a model scored on them on every rank (engine/lmeval.py ModelLM), with lm-eval's own flags,
results, samples and W&B names.

- `load_tasks`: each task resolved and its data read now (the datasets' cache then holds it); an unknown task, data
  that cannot be read, or a task that runs generated code without `--confirm_run_unsafe_code` is one line naming the
  task and the reason.
- `score`: lm-eval's `simple_evaluate` on the tasks read, the model gathered once for all of it (or on its shards),
  every rank its share of the documents; the results on rank 0 (None elsewhere).
- `metric_table` / `wandb_values`: the results as lm-eval keys them (`{task: {"acc,none": .., "acc_stderr,none": ..}}`)
  and as its W&B logger names them (`task/acc`, `task/acc_stderr`: ",none" dropped).
- `write_output`: lm-eval's results JSON and, with log_samples, its samples files, as its command writes them under
  --output_path (a folder a model).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from fsdp_opt.base import ConfigError, DataError
from fsdp_opt.engine.decoding import Decoder
from fsdp_opt.engine.generation import gathered
from fsdp_opt.runtime.distributed import DistEnv

# lm-eval's own defaults (its command's): the seeds of its few-shot sampling and of the stderr bootstrap
SEEDS = {"random_seed": 0, "numpy_random_seed": 1234, "torch_random_seed": 1234, "fewshot_random_seed": 1234}
BOOTSTRAP_ITERS = 100_000
# TaskSettings' fields that are simple_evaluate's arguments of the same name
SIMPLE_EVALUATE = (
    "num_fewshot",
    "limit",
    "apply_chat_template",
    "fewshot_as_multiturn",
    "gen_kwargs",
    "log_samples",
    "bootstrap_iters",
    "confirm_run_unsafe_code",
)
# result keys that are not metrics
NOT_METRICS = {"alias", "name", "sample_len", "samples", " "}


@dataclass
class TaskSettings:
    """lm-eval's flags, with lm-eval's meanings; `flag` is how the command names --tasks (the trainer: --eval_tasks)."""

    tasks: list[str]
    include_path: str | None = None
    num_fewshot: int | None = None
    limit: float | None = None
    apply_chat_template: bool | str = False
    fewshot_as_multiturn: bool = False
    gen_kwargs: str | None = None
    confirm_run_unsafe_code: bool = False
    log_samples: bool = False
    bootstrap_iters: int = BOOTSTRAP_ITERS
    flag: str = "--tasks"

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ConfigError(f"{self.flag}: name at least one lm-eval task (or a task YAML file)")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ConfigError(f"{self.prefix}num_fewshot {self.num_fewshot}: must be 0 or more")
        if self.limit is not None and not self.limit > 0:
            raise ConfigError(
                f"{self.prefix}limit {self.limit}: must be more than 0 (below 1: a fraction of each task)"
            )
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            raise ConfigError(f"{self.prefix}fewshot_as_multiturn: needs {self.prefix}apply_chat_template")

    @property
    def prefix(self) -> str:
        """The flags' prefix: `--` (evaluate) or `--eval_` (the trainer)."""
        return self.flag[: -len("tasks")]


@dataclass
class Tasks:
    """The tasks read: lm-eval's task manager and the tasks and groups each name built (their data in memory)."""

    settings: TaskSettings
    manager: Any  # lm_eval.tasks.TaskManager
    built: list[Any] = field(default_factory=list)  # lm-eval Task and Group objects, as named
    names: list[str] = field(default_factory=list)  # every leaf task

    def describe(self) -> str:
        return ", ".join(self.names)


def quiet_lm_eval() -> None:
    """lm-eval's INFO lines (a line per task and request type) off: its warnings stay."""
    logging.getLogger("lm_eval").setLevel(logging.WARNING)


def new_manager(settings: TaskSettings, defaults: bool | None = None) -> Any:
    """lm-eval's TaskManager over its own tasks and --include_path. Indexing lm-eval's some 15,000 task files takes
    about 10 s of a core: when every task named is a YAML file (`defaults` None), it indexes only those."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError(
            f"{settings.flag}: lm-evaluation-harness is not installed (pip install 'fsdp-opt[eval]')"
        ) from None

    quiet_lm_eval()
    if defaults is None:
        defaults = not all(spec.endswith((".yaml", ".yml")) and Path(spec).is_file() for spec in settings.tasks)
    try:
        return TaskManager(include_path=settings.include_path, include_defaults=defaults)
    except Exception as exc:  # noqa: BLE001 - a folder of task YAMLs lm-eval cannot index
        raise ConfigError(f"{settings.prefix}include_path {settings.include_path}: {_first_line(exc)}") from None


def load_tasks(settings: TaskSettings, manager: Any = None) -> Tasks:
    """Every task of --tasks resolved and its data read (a download fills the datasets' cache). One line naming the
    task and the reason when one does not exist, its data cannot be read, or it runs generated code unconfirmed."""
    flag = settings.flag
    manager = manager or new_manager(settings)
    tasks = Tasks(settings, manager)
    for name in settings.tasks:
        try:
            loaded = manager.load([name])
        except KeyError:
            raise ConfigError(
                f"{flag} {name}: no such lm-eval task, group or tag, nor a task YAML file"
                + ("" if settings.include_path else f" (a folder of your own: {settings.prefix}include_path)")
            ) from None
        except Exception as exc:  # noqa: BLE001 - the dataset's loader: no network, no such file or config, ...
            raise DataError(f"{flag} {name}: its data could not be read ({_first_line(exc)})") from None
        for task_name, task in loaded["tasks"].items():
            if getattr(task, "UNSAFE_CODE", False) and not settings.confirm_run_unsafe_code:
                raise ConfigError(
                    f"{flag} {name}: task {task_name} runs the code the model generates; give "
                    f"{settings.prefix}confirm_run_unsafe_code to run it"
                )
        children = {child for kids in loaded["group_map"].values() for child in kids}
        tops = [g for n, g in loaded["groups"].items() if n not in children]
        tasks.built += tops or [t for n, t in loaded["tasks"].items() if n not in children]
        tasks.names += [n for n in loaded["tasks"] if n not in tasks.names]
    return tasks


def _first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass
class Scoring:
    """How a model is scored: requests a forward per rank, on the model gathered once (else on its shards), the
    decoder of its generate_until requests, the seed of sampled ones."""

    batch_size: int
    gather: bool = True
    decoder: Decoder | None = None
    seed: int = 0


def score(model: nn.Module, tokenizer, env: DistEnv, tasks: Tasks, how: Scoring, name: str, tracker: Any = None):  # noqa: ANN001, ANN201
    """Every rank: the model scored on the tasks (lm-eval's simple_evaluate), gathered once for all of it where
    `how.gather` (LoRA merged as for generation), else on its shards. lm-eval's results on rank 0, None elsewhere;
    `name` is the model's in lm-eval's results (and their folder under --output_path, through `tracker`)."""
    from lm_eval import simple_evaluate

    # NOTE: imported here, as lm-eval itself is: a run that scores nothing imports neither (the [eval] extra is
    # optional, and its import costs every training process time and host memory the plan counts).
    from fsdp_opt.engine.lmeval import ModelLM

    quiet_lm_eval()
    with gathered(model, how.gather), random_state_kept():
        lm = ModelLM(
            model, tokenizer, env, batch_size=how.batch_size, gather=how.gather, decoder=how.decoder, seed=how.seed
        )
        arguments = {key: getattr(tasks.settings, key) for key in SIMPLE_EVALUATE}
        results = simple_evaluate(
            model=lm,
            model_args=f"pretrained={name}",
            tasks=list(tasks.built),
            task_manager=tasks.manager,
            evaluation_tracker=tracker,
            **arguments,
            **SEEDS,
        )
    return results if env.is_main else None


@contextmanager
def random_state_kept() -> Iterator[None]:
    """Python's, numpy's and torch's random states as they were before lm-eval seeds them (its few-shot sampling): a
    run's dropout stream, seeded per rank, goes on after a scoring as it would have without one."""
    import random

    import numpy as np
    import torch

    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def metric_table(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each task's metrics and their stderrs as lm-eval keys them ("acc,none", "acc_stderr,none"), numbers only."""
    out: dict[str, dict[str, float]] = {}
    for task, values in (results.get("results") or {}).items():
        kept = {k: float(v) for k, v in values.items() if k not in NOT_METRICS and _number(v)}
        if kept:
            out[task] = kept
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))


def wandb_values(table: dict[str, dict[str, float]]) -> dict[str, float]:
    """The W&B keys lm-eval's WandbLogger logs the results under: `task/metric` with ",none" dropped."""
    from lm_eval.loggers.utils import remove_none_pattern

    return {
        f"{task}/{remove_none_pattern(key)[0]}": value
        for task, values in table.items()
        for key, value in values.items()
    }


def new_tracker(output_path: str | None) -> Any:
    """lm-eval's EvaluationTracker for --output_path (None: nothing written)."""
    if not output_path:
        return None
    from lm_eval.loggers import EvaluationTracker

    return EvaluationTracker(output_path=output_path)


def write_output(tracker: Any, results: dict[str, Any], log_samples: bool) -> list[str]:
    """Rank 0: lm-eval's results JSON (and each task's samples) under --output_path, as its command writes them.
    Returns what was written."""
    results = dict(results)
    samples = results.pop("samples", None)
    tracker.save_results_aggregated(results=results, samples=samples if log_samples else None)
    if log_samples and samples:
        for task_name in results.get("configs", {}):
            if task_name in samples:
                tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    folder = tracker.output_path
    return [str(folder)] if folder else []


def request_counts(tasks: Tasks, tokenizer, max_length: int) -> dict[str, Any]:  # noqa: ANN001
    """What one scoring asks of the model (all ranks), for the plan: requests, the tokens of the loglikelihood ones,
    the generate_until ones and their max_gen_toks, the longest request's tokens (at most `max_length`, the model's
    context). Counted from the requests lm-eval builds (few-shot examples included), before the model exists; without
    a tokenizer (the plan of a Hub model, offline), a token is counted as 4 characters."""
    from lm_eval.evaluator_utils import get_sample_size

    settings = tasks.settings
    counts = {"requests": 0, "tokens": 0, "generations": 0, "max_gen_toks": 0, "longest": 1}
    for task in tasks.manager.load(list(tasks.built))["tasks"].values():
        if settings.num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=settings.num_fewshot)
        task.build_all_requests(limit=get_sample_size(task, settings.limit), rank=0, world_size=1)
        for instance in task.instances:
            counts["requests"] += 1
            text = "".join(a for a in instance.args if isinstance(a, str))
            tokens = len(tokenizer(text)["input_ids"]) if tokenizer is not None else len(text) // 4 + 1
            length = min(max_length, tokens)
            counts["longest"] = max(counts["longest"], length)
            if instance.request_type == "generate_until":
                wanted = instance.args[1] or {}
                counts["generations"] += 1
                counts["max_gen_toks"] = max(counts["max_gen_toks"], int(wanted.get("max_gen_toks", 256)))
            else:
                counts["tokens"] += length
    return counts
