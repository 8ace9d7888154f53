"""--method reward: a reward model, a sequence classifier scoring each answer of a preference pair (TRL 1.16's
RewardTrainer)."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_opt.config.methods.base import SEQUENCE_SCORE, Flags, MethodSpec, method_flag


@dataclass
class RewardFlags(Flags):
    center_rewards_coefficient: float | None = method_flag(
        None,
        "Adds this times the mean of (r_chosen + r_rejected)^2 to the loss, drawing the scores toward a mean of 0 "
        "(TRL's; 0.01 is the usual value).",
    )

    def describe(self) -> str:
        coefficient = self.center_rewards_coefficient
        return "pairwise loss" + (f", centred with coefficient {coefficient:g}" if coefficient else "")


# metrics.jsonl fields (TRL's names; over the step's pairs, all ranks); its `loss` is the mean pair loss
REWARD_FIELDS = (
    "pairs",  # preference pairs in the step
    "accuracy",  # share of pairs whose chosen answer scores above its rejected one
    "margin",  # mean of r_chosen - r_rejected
    "min_reward",  # the lowest score of an answer in the step
    "mean_reward",
    "max_reward",
)

REWARD = MethodSpec(
    name="reward",
    flags=RewardFlags,
    rows=("preference",),
    what="preference rows (prompt, chosen, rejected; an optional margin column)",
    summary="reward: a reward model on preference rows: a new score layer on the model (a sequence classifier of one "
    "label) trained with -log sigmoid(r_chosen - r_rejected - margin), averaged over the step's pairs (TRL's "
    "RewardTrainer).",
    sequences_per_row=2,
    dropout=False,
    concat=False,
    answers_only=False,
    fields=REWARD_FIELDS,
    unit="pair",
    head=SEQUENCE_SCORE,
    shown=("accuracy", "margin"),
    rows_hint="name the answers' columns with --chosen_column and --rejected_column",
    no_dropout="the two answers of a pair are scored by the same model, as TRL's RewardTrainer trains it",
)
