"""The methods as the layers below the run read them: each method's spec (`MethodSpec`), by method name: what it asks
of the data, the model and the plan, its own flags with what changing one mid-chain breaks, its metrics fields, the
phases the planner adds for it. The flags themselves are config/method.py's.

The run's method objects (train/methods/) are the only other place a method is named: everything else asks a
method's spec or its object, never its name (tests/test_layout.py holds the code to that).
"""

from __future__ import annotations

from dataclasses import dataclass

LOSS = "another loss trains"  # a method flag's drift class: changed mid-chain, it breaks the chain's exactness
MACHINE = None  # a method flag of how this machine runs the method: not compared (checkpoint/drift.py)
# The phases the planner adds to a step for a method (planner/report.py, plan.py)
REFERENCE_PASS = "reference_pass"  # a reference model scores the slice once, before training (its memory and time)
GENERATION = "generation"  # each step first samples completions from the policy (the model gathered once, decoding)
SECOND_FORWARD = "second_forward"  # each micro-batch has a forward without gradients beside its own (KTO's KL term)
TEACHER = "teacher"  # a teacher model kept beside the trained one, sharded and frozen, its forward on each micro-batch


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
    loss_types: tuple[str, ...] = ()  # --loss_type's choices for it, its default first
    unit: str = "row"  # what a step's loss is a mean over, in words (the plan's lines)
    teacher: bool = False  # a teacher model (--teacher_model) is kept beside the trained one
    group: bool = False  # a prompt's completions form a group (--num_generations of them; else one completion each)


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
# --method kto's (means over the step's rows, all ranks); its `loss` is the mean row loss, `tokens` the completions'
KTO_FIELDS = (
    "desirable",  # rows labelled desirable (true) in the step, all ranks
    "undesirable",  # rows labelled undesirable (false)
    "rewards_chosen",  # beta x (policy - reference) summed log-probability of a desirable completion, their mean
    "rewards_rejected",  # the same of the undesirable ones
    "margin",  # rewards_chosen - rewards_rejected
    "kl",  # the KL estimate the loss compares against: the mean over the step's micro-batches (0 with apo_zero_unpaired)
)
# --method distill's; its `loss` is the step's mean divergence per completion token, `tokens` the completions'
DISTILL_FIELDS = (
    "completions",  # completions sampled in the step, all ranks
    "completion_length",  # mean tokens of a completion (its end included)
    "completion_length_max",
    "truncated",  # share of completions that reached --max_completion_length without an end
    "entropy",  # the student's mean entropy per completion token (nats, at --temperature)
    "generation_share",  # the step's time spent sampling
    "generated_tokens_per_second",  # completion tokens generated per second of its sampling, all ranks
)
SAMPLING_FLAGS = ("max_completion_length", "temperature", "top_p", "top_k")
GRPO_FLAGS = (
    *(
        (f, LOSS)
        for f in (
            "beta",
            "ref_model",
            "num_generations",
            *SAMPLING_FLAGS,
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
    unit="pair",
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
    loss_types=("dapo", "grpo", "dr_grpo", "bnpo"),
    group=True,
)
KTO = MethodSpec(
    rows=("unpaired", "preference"),
    what="unpaired rows (prompt, completion, a true/false label column) or preference rows, unpaired",
    sequences_per_row=1,
    reference="always",
    beta=0.1,
    beta_means="the strength of the pull toward the reference (KTO's beta)",
    dropout=False,
    concat=False,
    answers_only=True,
    generates=False,
    flags=tuple((f, LOSS) for f in ("beta", "ref_model", "loss_type", "desirable_weight", "undesirable_weight")),
    fields=KTO_FIELDS,
    phases=(REFERENCE_PASS, SECOND_FORWARD),
    loss_types=("kto", "apo_zero_unpaired"),
    unit="item",
)

DISTILL = MethodSpec(
    rows=("prompt",),
    what="prompt rows (a prompt column; the model completes each, the teacher scores every token)",
    sequences_per_row=1,
    reference="never",
    beta=1.0,
    beta_means="which divergence to the teacher: 0 the forward KL, 1 the reverse KL, between them the generalized JSD",
    dropout=False,
    concat=False,
    answers_only=True,
    generates=True,
    flags=(*((f, LOSS) for f in ("beta", "teacher_model", "teacher_bits", *SAMPLING_FLAGS)), ("decoding", MACHINE)),
    fields=DISTILL_FIELDS,
    phases=(GENERATION, TEACHER),
    unit="completion token",
    teacher=True,
)

# --method: the registry's names, with their specs
METHOD_SPECS: dict[str, MethodSpec] = {"sft": SFT, "dpo": DPO, "grpo": GRPO, "kto": KTO, "distill": DISTILL}
METHODS = tuple(METHOD_SPECS)
DEFAULT_METHOD = METHODS[0]
# --loss_type: every method's choices (GRPO: what its step's loss is divided by; KTO: its loss)
LOSS_TYPES = tuple(dict.fromkeys(t for s in METHOD_SPECS.values() for t in s.loss_types))


def spec(method: str) -> MethodSpec:
    return METHOD_SPECS[method]


def method_flags() -> dict[str, str | None]:
    """Every method's own flags and their drift class (a flag two methods share has one class)."""
    return {f: kind for s in METHOD_SPECS.values() for f, kind in s.flags}
