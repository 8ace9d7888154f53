"""Flags of the training method (--method and each method's settings), and the methods' registry as the layers below
the run read it: each method's spec (`MethodSpec`), by method name: what it asks of the data, the model and the plan,
its own flags with what changing one mid-chain breaks, its metrics fields, the phases the planner adds for it.

The run's method objects (train/methods/) are the only other place a method is named: everything else asks a
method's spec or its object, never its name (tests/test_layout.py holds the code to that).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_opt.base import ConfigError
from fsdp_opt.config.flags import flag

LOSS = "another loss trains"  # a method flag's drift class: changed mid-chain, it breaks the chain's exactness
MACHINE = None  # a method flag of how this machine runs the method: not compared (checkpoint/drift.py)
# The phases the planner adds to a step for a method (planner/report.py, plan.py)
REFERENCE_PASS = "reference_pass"  # a reference model scores the slice once, before training (its memory and time)
GENERATION = "generation"  # each step first samples completions from the policy (the model gathered once, decoding)


@dataclass(frozen=True)
class MethodSpec:
    """What a method is to the layers that must not ask its name: the planner, drift, metrics, the card, evaluate."""

    rows: tuple[str, ...]  # the row formats (--data_format) it trains on
    what: str  # the rows, in words ("preference pairs (prompt, chosen, rejected)")
    sequences_per_row: int  # a row's sequences in a micro-batch: 1, or 2 for a preference pair
    reference: str  # a reference model: "never", "always", or "beta" (only when --beta > 0)
    beta: float  # --beta's default for this method
    beta_means: str  # what --beta is
    dropout: bool  # whether training keeps the model's dropout (off: the loss compares forwards of one model)
    concat: bool  # whether --packing concat suits (rows joined into one document each)
    answers_only: bool  # the loss reads the answers' tokens only (--train_on all does not suit)
    generates: bool  # a step samples completions from the policy before its forward
    flags: tuple[tuple[str, str | None], ...] = ()  # its own flags (of MethodConfig) and their drift class
    fields: tuple[str, ...] = ()  # metrics.jsonl fields beyond the common ones (tracking/metrics METRICS_FIELDS)
    phases: tuple[str, ...] = ()  # what the planner adds to its step


# --method dpo's metrics fields (means over the step's pairs, all ranks); its `loss` is the mean pair loss and `tokens`
# the answers' tokens.
DPO_FIELDS = (
    "pairs",  # preference pairs in the step
    "rewards_chosen",  # beta x (policy - reference) summed log-probability of the chosen answer
    "rewards_rejected",  # the same of the rejected answer
    "margin",  # rewards_chosen - rewards_rejected
    "accuracy",  # share of pairs whose chosen reward is the higher (a tie counts half)
)
# --method grpo's, and `reward_<function>` for each reward function (its mean over the step's completions); its `loss`
# is the step's GRPO loss, `tokens` the completions' tokens that carry it.
GRPO_FIELDS = (
    "completions",  # completions sampled in the step, all ranks
    "reward",  # mean reward (the weighted sum of the functions'), completions with a reward
    "reward_std",  # its std over the step (Bessel's correction)
    "completion_length",  # mean tokens of a completion (its end included)
    "completion_length_max",
    "truncated",  # share of completions that reached --max_completion_length without an end
    "zero_std_groups",  # share of completions whose group's rewards are all the same (no advantage)
    "kl",  # mean KL term (k3, times the ratio) per completion token (None when --beta is 0)
    "generation_share",  # the step's time spent sampling (0 in a step that trains a generation sampled before)
    "generated_tokens_per_second",  # completion tokens generated per second of its generation's sampling, all ranks
    "iteration",  # the pass over the step's generation it trains (1 .. --num_iterations)
    # the clip's share of the step's completion tokens (of its completions at --importance_sampling_level sequence)
    "clip_ratio/low_mean",  # clipped below: ratio < 1 - eps where A < 0
    "clip_ratio/high_mean",  # clipped above: ratio > 1 + eps_high, A > 0
    "clip_ratio/region_mean",  # either
)
GRPO_FLAGS = (
    *(
        (f, LOSS)
        for f in (
            "beta",
            "ref_model",
            "num_generations",
            "max_completion_length",
            "temperature",
            "top_p",
            "top_k",
            "epsilon",
            "epsilon_high",
            "loss_type",
            "scale_rewards",
            "mask_truncated_completions",
            "reward",
            "reward_weights",
            "num_iterations",
            "steps_per_generation",
            "delta",
            "importance_sampling_level",
        )
    ),
    ("decoding", MACHINE),  # the same completions, up to the last bits of a float
)

SFT = MethodSpec(
    rows=("text", "prompt_completion", "messages"),
    what="text, prompt/completion or chat rows",
    sequences_per_row=1,
    reference="never",
    beta=0.0,
    beta_means="unused",
    dropout=True,
    concat=True,
    answers_only=False,
    generates=False,
)
DPO = MethodSpec(
    rows=("preference",),
    what="preference rows (prompt, chosen, rejected)",
    sequences_per_row=2,
    reference="always",
    beta=0.1,
    beta_means="the strength of the pull toward the reference (DPO's beta)",
    dropout=False,
    concat=False,
    answers_only=True,
    generates=False,
    flags=(("beta", LOSS), ("ref_model", LOSS)),
    fields=DPO_FIELDS,
    phases=(REFERENCE_PASS,),
)
GRPO = MethodSpec(
    rows=("prompt",),
    what="prompt rows (a prompt column; the other columns go to the rewards)",
    sequences_per_row=1,
    reference="beta",
    beta=0.0,
    beta_means="the weight of the KL term against the reference (0: no reference model, TRL's default)",
    dropout=False,
    concat=False,
    answers_only=True,
    generates=True,
    flags=GRPO_FLAGS,
    fields=GRPO_FIELDS,
    phases=(GENERATION,),
)

# --method: the registry's names, with their specs
METHOD_SPECS: dict[str, MethodSpec] = {"sft": SFT, "dpo": DPO, "grpo": GRPO}
METHODS = tuple(METHOD_SPECS)
DEFAULT_METHOD = METHODS[0]
LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")  # --loss_type: what a GRPO step's loss is divided by
SCALE_REWARDS = ("group", "batch", "none")  # --scale_rewards: the std an advantage is divided by
IMPORTANCE_LEVELS = ("token", "sequence")  # --importance_sampling_level: where the probability ratio is taken
DECODING = ("static", "graphs", "generate")  # --decoding: how completions are decoded (engine/decoding.py)


def spec(method: str) -> MethodSpec:
    return METHOD_SPECS[method]


def method_flags() -> dict[str, str | None]:
    """Every method's own flags and their drift class (a flag two methods share has one class)."""
    return {f: kind for s in METHOD_SPECS.values() for f, kind in s.flags}


@dataclass
class MethodConfig:
    method: str = flag(
        DEFAULT_METHOD,
        "What a step trains. sft: next-token loss on the targets of --train_on. dpo: Direct Preference Optimization on "
        "preference rows: -log sigmoid(beta x the chosen answer's log-probability ratio to the reference model minus "
        "the rejected one's), summed log-probabilities of the answer tokens, averaged over the step's pairs. grpo: "
        "Group Relative Policy Optimization on prompt rows: --num_generations completions of each prompt, sampled from "
        "the policy, scored by --reward, each pushed up or down by its reward against its group's (TRL's loss).",
        choices=METHODS,
    )
    beta: float | None = flag(
        None,
        "--method dpo: the strength of the pull toward the reference model (DPO's beta; default 0.1). --method grpo: "
        "the weight of the KL term against the reference model (default 0: no reference model, as TRL).",
    )
    ref_model: str | None = flag(
        None,
        "--method dpo (or grpo with --beta > 0): the reference model (a Hub id or local folder, as --model). Default: "
        "the model the chain started from, which the chain records (a resumed session never takes it from its "
        "checkpoint); a LoRA run without it uses its base with the adapters switched off.",
    )
    num_generations: int = flag(8, "--method grpo: completions sampled per prompt (G, a group).")
    max_completion_length: int = flag(
        256, "--method grpo: the most tokens a completion has (its end of text included)."
    )
    temperature: float = flag(
        1.0,
        "--method grpo: the sampling temperature; the log-probabilities are of the logits "
        "divided by it, as the completions were drawn.",
    )
    top_p: float = flag(1.0, "--method grpo: nucleus sampling's share of the probability (1.0: off).")
    top_k: int = flag(0, "--method grpo: sample among the k likeliest tokens only (0: off; 1: greedy).")
    epsilon: float = flag(0.2, "--method grpo: the clip range below 1 of the probability ratio.")
    epsilon_high: float | None = flag(None, "--method grpo: the clip range above 1 (default: --epsilon).")
    loss_type: str = flag(
        "dapo",
        "--method grpo: what the step's summed token losses are divided by. dapo: the step's completion tokens, all "
        "ranks; grpo: each completion's own tokens (a mean per completion), then the completions; dr_grpo: completions "
        "x --max_completion_length; bnpo: each micro-batch's completion tokens.",
        choices=LOSS_TYPES,
    )
    scale_rewards: str = flag(
        "group",
        "--method grpo: an advantage is its reward less its group's mean, divided by the std of its group (group), of "
        "the step's rewards (batch), or by nothing (none); plus 1e-4.",
        choices=SCALE_REWARDS,
    )
    mask_truncated_completions: bool = flag(False, "--method grpo: a completion that never ends carries no loss.")
    num_iterations: int = flag(
        1,
        "--method grpo: how many times each generation is trained on (TRL's num_iterations, mu). Above 1 the "
        "log-probabilities the completions were sampled with are kept, the probability ratio moves off 1 and "
        "--epsilon clips it.",
    )
    steps_per_generation: int | None = flag(
        None,
        "--method grpo: the micro-steps one generation feeds (TRL's); default --accum_steps, so that one generation "
        "feeds one optimizer step; twice that, two (the generation's prompts sampled at once, then trained a step's "
        "worth at a time). A multiple of --accum_steps.",
    )
    delta: float | None = flag(
        None,
        "--method grpo: the two-sided clip's upper bound on the probability ratio (TRL's delta, INTELLECT-2; off by "
        "default); above 1 + --epsilon_high.",
    )
    importance_sampling_level: str = flag(
        "token",
        "--method grpo: the probability ratio per token (token), or per completion (sequence: the exp of the mean of "
        "its tokens' log-ratios, GSPO).",
        choices=IMPORTANCE_LEVELS,
    )
    decoding: str = flag(
        "static",
        "--method grpo: how completions are decoded. static: all of a rank's completions as one batch with a KV cache "
        "sized once; graphs: the same, each decoding step captured once as a CUDA graph and replayed per token (CUDA "
        "only; off by default: no GPU has measured it yet, docs/grpo.md); generate: transformers' generate.",
        choices=DECODING,
    )
    reward: str | None = flag(
        None,
        "--method grpo: the reward functions, comma-separated (or the flag repeated): a built-in (accuracy, format, "
        "length), path/to/file.py:function or module:function, called as TRL calls them: f(prompts=, completions=, "
        "completion_ids=, **columns), one float (or None) per completion.",
        action="append",
    )
    reward_weights: str | None = flag(
        None, "--method grpo: a weight per reward function, comma-separated (default 1 each)."
    )

    def __post_init__(self) -> None:
        t = spec(self.method)
        if isinstance(self.reward, list):  # repeated, comma-separated or both: one comma-separated value
            self.reward = ",".join(n.strip() for given in self.reward for n in given.split(",") if n.strip()) or None
        if self.beta is None:
            self.beta = t.beta  # the flag's default is this method's
        if self.method == "dpo" and not self.beta > 0:
            raise ConfigError(f"--beta {self.beta}: must be greater than 0")
        if self.beta < 0:
            raise ConfigError(f"--beta {self.beta}: must be 0 or more")
        if self.ref_model is not None and not self.uses_reference:
            raise ConfigError(f"--ref_model {self.ref_model}: only with --method dpo, or grpo with --beta above 0")
        if not t.generates:
            given = [
                f for f in ("reward", "reward_weights", "steps_per_generation", "delta") if getattr(self, f) is not None
            ]
            given += [
                f
                for f, default in (
                    ("num_iterations", 1),
                    ("importance_sampling_level", "token"),
                    ("decoding", "static"),
                )
                if getattr(self, f) != default
            ]
            if given:
                raise ConfigError(f"--{given[0]}: only with --method grpo")
            return
        if self.num_generations < 2:
            raise ConfigError(
                f"--num_generations {self.num_generations}: must be 2 or more (an advantage compares a "
                "completion with the rest of its group)"
            )
        if self.max_completion_length < 1:
            raise ConfigError(f"--max_completion_length {self.max_completion_length}: must be 1 or more")
        if not self.temperature > 0:
            raise ConfigError(f"--temperature {self.temperature}: must be greater than 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top_p {self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"--top_k {self.top_k}: must be 0 (off) or more")
        if not 0 <= self.epsilon < 1 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ConfigError(f"--epsilon {self.epsilon}: must be in [0, 1) (and --epsilon_high 0 or more)")
        if self.num_iterations < 1:
            raise ConfigError(f"--num_iterations {self.num_iterations}: must be 1 or more")
        if self.steps_per_generation is not None and self.steps_per_generation < 1:
            raise ConfigError(f"--steps_per_generation {self.steps_per_generation}: must be 1 or more")
        if self.delta is not None and not self.delta > 1 + self.clip_high:
            raise ConfigError(
                f"--delta {self.delta}: must be above 1 + --epsilon_high ({1 + self.clip_high:g}): it "
                "bounds the ratio from above where the clip does not"
            )
        if not self.reward:
            raise ConfigError(
                "--reward: --method grpo needs at least one reward function (a built-in: accuracy, "
                "format, length; or path/to/file.py:function)"
            )

    @property
    def spec(self) -> MethodSpec:
        return spec(self.method)

    @property
    def uses_reference(self) -> bool:
        """Whether the run scores against a reference model (DPO always; GRPO with a KL term)."""
        r = self.spec.reference
        return r == "always" or (r == "beta" and bool(self.beta and self.beta > 0))

    @property
    def reward_names(self) -> list[str]:
        return [n for n in (self.reward or "").split(",") if n]

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
