"""What a training method is to the layers below the run (`MethodSpec`), and the flag groups several methods share.

A method's spec is declared low, beside its own flags class (config/methods/<method>.py), so that drift, metrics,
the planner and the commands read it without asking the method's name: the rows it trains on, what it needs built
(a reference pass, a model kept beside, a generator, reward functions), its flags with what changing one mid-chain
breaks, its metrics fields, the phases the planner adds for it. The run's definition of the method (its builders:
train/methods/) is the only other place a method is named.

A flags class is a dataclass of the method's own flags, each field one flag with one meaning (TRL gives each trainer
its own config the same way): `--beta` is DPO's beta in DpoFlags and the KL weight in GrpoFlags, each with its own
default and help. The command line holds the union (config/method.py); a flag no field of the run's method has is
refused in one line naming the methods that take it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from fsdp_opt.base import ConfigError
from fsdp_opt.config.choices import BUILTIN_REWARDS
from fsdp_opt.config.flags import flag

LOSS = "another loss trains"  # a method flag's drift class: changed mid-chain, it breaks the chain's exactness
MACHINE = None  # a method flag of how this machine runs the method: not compared (checkpoint/drift.py)

# What a method needs built besides the trained model (setup builds them once, as values: train/components.py)
REFERENCE_PASS = "reference_pass"  # a reference model scores the slice's answers once, before training
REFERENCE_BESIDE = "reference_beside"  # a reference model kept beside the policy (when the settings use one)
TEACHER = "teacher"  # a teacher model kept beside the trained one, sharded and frozen
GENERATOR = "generator"  # each step first samples completions from the model
REWARDS = "rewards"  # reward functions (and reward models) score the sampled completions

# The phases the planner adds to a step for a method (planner/report.py, plan.py)
GENERATION = "generation"  # each step first samples completions from the policy (the model gathered once, decoding)
SECOND_FORWARD = "second_forward"  # each micro-batch has a forward without gradients beside its own (KTO's KL term)

# The model's head (model/loader.py): the next-token layer, or one score per sequence
CAUSAL_LM = "causal_lm"
SEQUENCE_SCORE = "sequence_classification"


def method_flag(default: Any, help: str, drift: str | None = LOSS, **argparse_kwargs: Any) -> Any:  # noqa: A002
    """A method's own flag: `flag`, with what changing it mid-chain breaks (`drift`: LOSS, or MACHINE when it only
    says how this machine runs the method)."""
    return flag(default, help, drift=drift, **argparse_kwargs)


def drift_of(f) -> str | None:  # noqa: ANN001
    return f.metadata.get("drift", LOSS)


@dataclass
class Flags:
    """A method's own flags (none: --method sft). Subclasses add fields and check them in `check`."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Each flag against its rules (one line naming the flag)."""

    @property
    def uses_reference(self) -> bool:
        """Whether the run scores against a reference model."""
        return False

    @property
    def completions_per_prompt(self) -> int:
        """A step's completions of one prompt (a method that samples)."""
        return 1

    def describe(self) -> str:
        """The settings in a few words, for the summary line."""
        return ""


def positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"--{name} {value}: must be greater than 0")


@dataclass
class ReferenceFlags(Flags):
    """A method that compares the model with a reference model."""

    ref_model: str | None = method_flag(
        None,
        "The reference model (a Hub id or local folder, as --model). Default: the model the chain started from, which "
        "the chain records (a resumed session never takes it from its checkpoint); a LoRA run without it uses its base "
        "with the adapters switched off.",
    )


@dataclass
class SamplingFlags(Flags):
    """A method whose steps sample completions from the model."""

    max_completion_length: int = method_flag(256, "The most tokens a completion has (its end of text included).")
    temperature: float = method_flag(
        1.0,
        "The sampling temperature; the log-probabilities (distill: both models' distributions) are of the logits "
        "divided by it, as the completions were drawn.",
    )
    top_p: float = method_flag(1.0, "Nucleus sampling's share of the probability (1.0: off).")
    top_k: int = method_flag(0, "Sample among the k likeliest tokens only (0: off; 1: greedy).")
    decoding: str = method_flag(
        "static",
        "How completions are decoded. static: all of a rank's completions as one batch with a KV cache sized once; "
        "graphs: the same, each decoding step captured once as a CUDA graph and replayed per token (CUDA only; off by "
        "default: no GPU has measured it yet, docs/grpo.md); generate: transformers' generate.",
        drift=MACHINE,  # the same completions, up to the last bits of a float
        choices=("static", "graphs", "generate"),
    )

    def check(self) -> None:
        super().check()
        if self.max_completion_length < 1:
            raise ConfigError(f"--max_completion_length {self.max_completion_length}: must be 1 or more")
        positive("temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top_p {self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"--top_k {self.top_k}: must be 0 (off) or more")


@dataclass
class GroupFlags(ReferenceFlags, SamplingFlags):
    """A method that samples a group of completions of each prompt, scores them with reward functions and pushes each
    up or down against the rest of its group, with a clipped probability ratio (GRPO, RLOO)."""

    beta: float = method_flag(0.0, "The weight of the KL term against the reference model (0: no reference model).")
    num_generations: int = method_flag(8, "Completions sampled per prompt (G, a group).")
    epsilon: float = method_flag(0.2, "The clip range below 1 of the probability ratio.")
    epsilon_high: float | None = method_flag(None, "The clip range above 1 (default: --epsilon).")
    mask_truncated_completions: bool = method_flag(False, "A completion that never ends carries no loss.")
    num_iterations: int = method_flag(
        1,
        "How many times each generation is trained on (TRL's num_iterations, mu). Above 1 the log-probabilities the "
        "completions were sampled with are kept, the probability ratio moves off 1 and --epsilon clips it.",
    )
    steps_per_generation: int | None = method_flag(
        None,
        "The micro-steps one generation feeds (TRL's); default --accum_steps, so that one generation feeds one "
        "optimizer step; twice that, two (the generation's prompts sampled at once, then trained a step's worth at a "
        "time). A multiple of --accum_steps.",
    )
    reward: str | None = method_flag(
        None,
        f"The reward functions, comma-separated (or the flag repeated): a built-in ({', '.join(BUILTIN_REWARDS)}), "
        "path/to/file.py:function or module:function, called as TRL calls them: f(prompts=, completions=, "
        "completion_ids=, **columns), one float (or None) per completion.",
        action="append",
    )
    reward_weights: str | None = method_flag(
        None, "A weight per reward function (then per --reward_model), comma-separated (default 1 each)."
    )
    reward_model: str | None = method_flag(
        None,
        "A reward model (a Hub id or local folder of a sequence classifier with one label, such as --method reward "
        "trains) scoring each completion beside --reward's functions: the prompt and the completion as text, "
        "tokenized by its own tokenizer (TRL's reward model among its reward_funcs).",
    )

    def __post_init__(self) -> None:
        if isinstance(self.reward, list):  # repeated, comma-separated or both: one comma-separated value
            self.reward = ",".join(n.strip() for given in self.reward for n in given.split(",") if n.strip()) or None
        super().__post_init__()

    def check(self) -> None:
        super().check()
        if self.num_generations < 2:
            raise ConfigError(
                f"--num_generations {self.num_generations}: must be 2 or more (an advantage compares a "
                "completion with the rest of its group)"
            )
        if not 0 <= self.epsilon < 1 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ConfigError(f"--epsilon {self.epsilon}: must be in [0, 1) (and --epsilon_high 0 or more)")
        if self.num_iterations < 1:
            raise ConfigError(f"--num_iterations {self.num_iterations}: must be 1 or more")
        if self.steps_per_generation is not None and self.steps_per_generation < 1:
            raise ConfigError(f"--steps_per_generation {self.steps_per_generation}: must be 1 or more")
        if self.beta < 0:
            raise ConfigError(f"--beta {self.beta}: must be 0 or more")
        if self.ref_model is not None and not self.uses_reference:
            raise ConfigError(f"--ref_model {self.ref_model}: only with --beta above 0 (the KL term's reference)")

    @property
    def uses_reference(self) -> bool:
        return self.beta > 0

    @property
    def completions_per_prompt(self) -> int:
        return self.num_generations

    @property
    def reward_names(self) -> list[str]:
        return [n for n in (self.reward or "").split(",") if n]

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(frozen=True)
class MethodSpec:
    """What a method is to the layers that must not ask its name: the planner, drift, metrics, the card, evaluate."""

    name: str  # --method
    flags: type[Flags]  # its own flags
    rows: tuple[str, ...]  # the row formats (--data_format) it trains on
    what: str  # the rows, in words ("preference pairs (prompt, chosen, rejected)")
    summary: str  # what a step trains, in a sentence (--method's help)
    sequences_per_row: int  # a row's sequences in a micro-batch: 1, or 2 for a preference pair
    dropout: bool  # whether training keeps the model's dropout (off: the loss compares forwards of one model)
    concat: bool  # whether --packing concat suits (rows joined into one document each)
    answers_only: bool  # the loss reads the answers' tokens only (--train_on all does not suit)
    needs: tuple[str, ...] = ()  # what setup builds for it besides the model (REFERENCE_PASS, GENERATOR, ...)
    fields: tuple[str, ...] = ()  # metrics.jsonl fields beyond the common ones (tracking/metrics METRICS_FIELDS)
    phases: tuple[str, ...] = ()  # what the planner adds to its step
    unit: str = "row"  # what a step's loss is a mean over, in words (the plan's lines)
    shown: tuple[str, ...] = ()  # metrics fields the progress bar shows beside the loss
    rows_hint: str = ""  # what to give when the rows are of another format
    no_dropout: str = "the policy is compared with its reference on the same forward"  # why it trains without
    head: str = CAUSAL_LM  # the model's head: the next-token layer, or a score per sequence

    @property
    def generates(self) -> bool:
        """A step samples completions from the model before its forward."""
        return GENERATOR in self.needs

    @property
    def teacher(self) -> bool:
        return TEACHER in self.needs

    @property
    def group(self) -> bool:
        """A prompt's completions form a group scored against each other."""
        return REWARDS in self.needs

    def own_flags(self) -> dict[str, Any]:
        """Its flags (fields of its flags class) by name."""
        return {f.name: f for f in fields(self.flags)}


# metrics.jsonl fields of a method that samples completions (GRPO, RLOO, distillation)
SAMPLED_FIELDS = (
    "completions",  # completions sampled in the step, all ranks
    "completion_length",  # mean tokens of a completion (its end included)
    "completion_length_max",
    "truncated",  # share of completions that reached --max_completion_length without an end
    "generation_share",  # the step's time spent sampling (0 in a step that trains a generation sampled before)
    "generated_tokens_per_second",  # completion tokens generated per second of its generation's sampling, all ranks
)
# and of a method that scores groups of them (GRPO, RLOO), with `reward_<function>` for each reward function (its mean
# over the step's completions); its `loss` is the step's loss, `tokens` the completions' tokens that carry it
GROUP_FIELDS = (
    *SAMPLED_FIELDS,
    "reward",  # mean reward (the weighted sum of the functions'), completions with a reward
    "reward_std",  # its std over the step (Bessel's correction)
    "zero_std_groups",  # share of completions whose group's rewards are all the same (no advantage)
    "kl",  # the method's KL estimate per completion token (None without a reference)
    "iteration",  # the pass over the step's generation it trains (1 .. --num_iterations)
    # the clip's share of the step's completion tokens (of its completions where the ratio is per completion)
    "clip_ratio/low_mean",  # clipped below: ratio < 1 - eps where A < 0
    "clip_ratio/high_mean",  # clipped above: ratio > 1 + eps_high, A > 0
    "clip_ratio/region_mean",  # either
)


# What every method that samples completions of prompt rows declares alike (GRPO, RLOO, distillation)
ON_PROMPTS = dict(
    rows=("prompt",),
    sequences_per_row=1,
    dropout=False,
    concat=False,
    answers_only=True,
    rows_hint="name the prompt's column with --prompt_column (--data_format prompt)",
)
# and every method that scores groups of them (GRPO, RLOO)
IN_GROUPS = dict(
    **ON_PROMPTS,
    what="prompt rows (a prompt column; the other columns go to the rewards)",
    needs=(GENERATOR, REWARDS, REFERENCE_BESIDE),
    fields=GROUP_FIELDS,
    phases=(GENERATION,),
    shown=("reward",),
    no_dropout="completions are sampled and scored on the same forward the loss takes",
)
