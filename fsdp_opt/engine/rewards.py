"""Reward functions (--method grpo --reward): the built-ins, and functions named by file or module, all called the
way TRL's GRPOTrainer calls them, so a TRL reward function runs here unchanged:

    f(prompts=[...], completions=[...], completion_ids=[...], **columns) -> [float | None, ...]

one entry per completion: `prompts` the row's prompt for each completion (a string, or its list of messages),
`completions` the text (or, for message prompts, `[{"role": "assistant", "content": text}]`), `completion_ids` the
completion's tokens, and every other column of the prompt rows as a list. None means "no reward here" (the completion
is left out of its group's statistics).

Built-ins:
- `accuracy`: the completion's answer checked against the row's `solution` column with math-verify: 1.0 when
  `verify(parse(solution), parse(completion))` (the answer read from LaTeX, a \\boxed{} first), 0.0 when not, None
  when the solution itself cannot be parsed (TRL's accuracy_reward; math-verify is an optional install).
- `format`: 1.0 when the completion is a reasoning in `<think>...</think>` followed by its answer (one opening
  `<think>`, at the very start), else 0.0 (TRL's think_format_reward).
- `length`: 1.0 when the completion ended (an end-of-text token or the end of turn) with at most `max_words` words
  of text (the row's `max_words` column, else 50), else 0.0: brevity, and an answer that stops.
- `choice`: 1.0 when the completion ended and its text, stripped, is one of the row's `choices` (a list column),
  else 0.0: an answer from a fixed set (a multiple choice, a label).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import math
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp_opt.base import ConfigError, RewardError, first_line

MATH_VERIFY_INSTALL = 'pip install "math-verify>=0.8"'
DEFAULT_MAX_WORDS = 50
THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def _texts(completions: Sequence[Any]) -> list[str]:
    return [c if isinstance(c, str) else c[0]["content"] for c in completions]


def accuracy(completions: Sequence[Any], solution: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """math-verify's verdict on each completion against its row's solution."""
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        raise ConfigError(f"--reward accuracy: math-verify is not installed ({MATH_VERIFY_INSTALL})") from None
    out: list[float | None] = []
    for text, gold in zip(_texts(completions), solution):
        expected = parse(str(gold))
        if not expected:
            out.append(None)
            continue
        config = LatexExtractionConfig(
            normalization_config=NormalizationConfig(units=True),
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
        answer = parse(text, extraction_config=[config], extraction_mode="first_match")
        out.append(float(verify(expected, answer)))
    return out


def format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    return [1.0 if THINK.match(t) else 0.0 for t in _texts(completions)]


def length(
    completions: Sequence[Any],
    completion_ended: Sequence[bool] | None = None,
    max_words: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float]:
    texts = _texts(completions)
    ended = completion_ended if completion_ended is not None else [True] * len(texts)
    limits = max_words if max_words is not None else [DEFAULT_MAX_WORDS] * len(texts)
    return [1.0 if e and len(t.split()) <= int(m) else 0.0 for t, e, m in zip(texts, ended, limits)]


def choice(
    completions: Sequence[Any],
    choices: Sequence[Sequence[str]],
    completion_ended: Sequence[bool] | None = None,
    **kwargs: Any,
) -> list[float]:
    texts = _texts(completions)
    ended = completion_ended if completion_ended is not None else [True] * len(texts)
    return [1.0 if e and t.strip() in set(c) else 0.0 for t, e, c in zip(texts, ended, choices)]


BUILTINS: dict[str, Callable[..., list]] = {
    "accuracy": accuracy,
    "format": format_reward,
    "length": length,
    "choice": choice,
}
# config/choices.py BUILTIN_REWARDS names them for the flag's help and errors (tests/engine/test_rewards.py holds the
# two alike, and grpo.md's table)
# the built-ins that read whether a completion ended (a keyword TRL's functions do not get)
READS_ENDED = (length, choice)


@dataclass
class Reward:
    """One reward function: its name as given, the function, and a fingerprint of its source (the chain pins it:
    a changed rule is drift). `label` names it in the metrics: a built-in's name, else the function's own (as TRL
    names a reward function), made unique among the run's."""

    name: str
    fn: Callable[..., list]
    source: str  # sha256 of its source: its file's or module's (a built-in's: this package's code of the function)
    label: str = ""
    collective: bool = False  # every rank calls it, before the others, as many times (a sharded reward model)

    def __post_init__(self) -> None:
        self.label = self.label or (self.name if self.name in BUILTINS else self.name.rsplit(":", 1)[-1])

    def pin(self) -> dict[str, str]:
        return {"name": self.name, "source": self.source}

    def same_rule(self, pinned: str) -> bool:
        """Whether a checkpoint's pin of this function names the rule it has now: its syntax tree's fingerprint, or
        (a pin of a version before it) its source text's."""
        if pinned == self.source:
            return True
        return not pinned.startswith("ast:") and pinned == _text_digest(
            self.fn if self.name in BUILTINS else inspect.getmodule(self.fn)
        )


def _digest(obj: Any) -> str:
    """A function's or a module's rule, fingerprinted: sha256 of its parsed source (Python's syntax tree, which
    comments, blank lines, layout and trailing commas do not change: a formatter's pass is no new rule), "ast:" first;
    its text's where it does not parse alone."""
    try:
        tree = _canonical(ast.parse(textwrap.dedent(inspect.getsource(obj))))
    except (OSError, TypeError, SyntaxError):
        return _text_digest(obj)
    return "ast:" + hashlib.sha256(tree.encode()).hexdigest()[:16]


def _canonical(node: Any) -> str:
    """A syntax tree as text, its empty fields left out (a newer Python adds fields, empty for the code of an older
    one: the same rule reads the same on either)."""
    if isinstance(node, ast.AST):
        fields = [f"{k}={_canonical(v)}" for k, v in ast.iter_fields(node) if v is not None and v != []]
        return f"({type(node).__name__} {' '.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(x) for x in node) + "]"
    return repr(node)


def _text_digest(obj: Any) -> str:
    """sha256 of a function's or a module's source text (its repr where the source cannot be read)."""
    try:
        text = inspect.getsource(obj)
    except (OSError, TypeError):
        text = repr(obj)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load(name: str) -> Reward:
    """A built-in, `path/to/file.py:function` or `module:function`; one line naming it when it cannot be had."""
    if name in BUILTINS:
        if name == "accuracy" and importlib.util.find_spec("math_verify") is None:
            raise ConfigError(f"--reward accuracy: math-verify is not installed ({MATH_VERIFY_INSTALL})")
        return Reward(name, BUILTINS[name], _digest(BUILTINS[name]))
    if ":" not in name:
        raise ConfigError(
            f"--reward {name}: not a built-in ({', '.join(BUILTINS)}) nor path/to/file.py:function or module:function"
        )
    where, attr = name.rsplit(":", 1)
    if where.endswith(".py"):
        path = Path(where).expanduser()
        if not path.is_file():
            raise ConfigError(f"--reward {name}: no such file {where}")
        spec = importlib.util.spec_from_file_location(f"fsdp_opt_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - the user's file: its error in one line
            raise ConfigError(f"--reward {name}: {where} fails to load ({first_line(exc)})") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"--reward {name}: cannot import {where} ({first_line(exc)})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"--reward {name}: {where} has no function {attr}")
    # the whole file or module: a helper the function calls is part of its rule
    return Reward(name, fn, _digest(module))


def load_all(names: Sequence[str], weights: str | None, models: int = 0) -> tuple[list[Reward], list[float]]:
    """--reward and --reward_weights, checked (`models`: the reward models scored after the functions, whose weights
    follow theirs)."""
    rewards = [load(n) for n in names]
    seen: dict[str, int] = {}
    for r in rewards:  # two functions of one name (from two files): the second is label_2
        seen[r.label] = seen.get(r.label, 0) + 1
        if seen[r.label] > 1:
            r.label = f"{r.label}_{seen[r.label]}"
    if weights is None:
        return rewards, [1.0] * (len(rewards) + models)
    try:
        values = [float(w) for w in weights.split(",")]
    except ValueError:
        raise ConfigError(f"--reward_weights {weights}: numbers, comma-separated") from None
    if len(values) != len(rewards) + models:
        raise ConfigError(
            f"--reward_weights {weights}: {len(values)} weight(s) for {len(rewards)} reward function(s)"
            + (f" and {models} reward model(s)" if models else "")
        )
    return rewards, values


def score(
    rewards: Sequence[Reward],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: dict[str, list],
    rows: Sequence[int],
    ended: Sequence[bool],
    places: Sequence[int] | None = None,
) -> list[list[float]]:
    """[completion][function]: each function's reward of each completion (NaN for None). A function that raises,
    returns the wrong count or a non-number stops the run in one line naming it, the row and the completion's place
    in its group (`places`: each completion's; None: one completion per row, as the held-out prompts have)."""
    out = [[math.nan] * len(rewards) for _ in completions]
    # a reward model first, on every rank (its forward is collective: no rank may have left for an error before it)
    for j in sorted(range(len(rewards)), key=lambda j: not rewards[j].collective):
        reward = rewards[j]
        if not completions and not reward.collective:
            continue
        kwargs = dict(columns)
        if reward.fn in READS_ENDED:
            kwargs["completion_ended"] = list(ended)
        try:
            got = reward.fn(
                prompts=list(prompts), completions=list(completions), completion_ids=list(completion_ids), **kwargs
            )
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's function: which, and on which row
            where = _failing(reward, prompts, completions, completion_ids, kwargs, rows, places)
            raise RewardError(
                f"--reward {reward.name}: it raised on {where} ({type(exc).__name__}: {first_line(exc)})"
            ) from None
        got = list(got) if got is not None else []
        if len(got) != len(completions):
            raise RewardError(
                f"--reward {reward.name}: it returned {len(got)} reward(s) for {len(completions)} "
                "completions (one float or None per completion)"
            )
        for i, value in enumerate(got):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(float(value)):
                raise RewardError(
                    f"--reward {reward.name}: it returned {value!r} for {_which(rows, places, i)} (a "
                    "float or None per completion)"
                )
            out[i][j] = float(value)
    return out


def _which(rows: Sequence[int], places: Sequence[int] | None, i: int) -> str:
    """Completion i in words: its row, and its place in the row's group when there is a group (from 0, as
    completions.jsonl's `place` numbers it)."""
    return f"row {rows[i]}" + (f", place {places[i]} of its group" if places is not None else "")


def _failing(reward: Reward, prompts, completions, completion_ids, kwargs: dict, rows, places) -> str:  # noqa: ANN001
    """The first completion that makes the function raise when it is called on that completion alone; where none
    does, the batch's rows (the function raises on the batch as a whole)."""
    for i in range(len(completions)):
        one = {k: [v[i]] if isinstance(v, list) and len(v) == len(completions) else v for k, v in kwargs.items()}
        try:
            reward.fn(prompts=[prompts[i]], completions=[completions[i]], completion_ids=[completion_ids[i]], **one)
        except Exception:  # noqa: BLE001
            return _which(rows, places, i)
    return (
        f"the batch of rows {min(rows)} to {max(rows)} ({len(completions)} completions; no one of them alone "
        "makes it raise)"
    )


def model_reward(name: str, model: Any, tokenizer: Any, env: Any, batch_size: int) -> Reward:  # noqa: ANN401
    """A reward model as a reward function (--reward_model, as TRL takes a reward model among its reward functions):
    each completion's prompt and text as one string (a conversation through the reward model's own chat template),
    tokenized by its own tokenizer without special tokens, right-padded, and its score at the last token that is not
    the pad token. The model is sharded: every rank scores as many micro-batches of `batch_size`."""

    def scores(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        if prompts and not isinstance(prompts[0], str):
            texts = [tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        mine = -(-len(texts) // batch_size)
        count = torch.tensor([mine], device=env.device)
        if env.world_size > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        out: list[float] = []
        with torch.no_grad():
            for k in range(int(count)):
                part = texts[k * batch_size : (k + 1) * batch_size] or [tokenizer.pad_token]  # a filler row
                given = tokenizer(
                    text=part, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
                )
                logits = model(
                    **{key: v.to(env.device) for key, v in given.items() if key in ("input_ids", "attention_mask")}
                ).logits
                out += logits[:, 0].float().tolist()[: len(texts[k * batch_size : (k + 1) * batch_size])]
        return out

    label = name.rstrip("/").rsplit("/", 1)[-1]
    return Reward(name, scores, "model", label=label, collective=True)
