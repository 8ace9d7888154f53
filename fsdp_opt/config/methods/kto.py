"""--method kto: Kahneman-Tversky Optimization on rows labelled desirable or not, against a reference model and a
KL estimate (TRL 1.16's KTOTrainer)."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_opt.base import ConfigError
from fsdp_opt.config.methods.base import (
    REFERENCE_PASS,
    SECOND_FORWARD,
    MethodSpec,
    ReferenceFlags,
    method_flag,
    positive,
)

KTO_LOSSES = ("kto", "apo_zero_unpaired")


@dataclass
class KtoFlags(ReferenceFlags):
    beta: float = method_flag(0.1, "The strength of the pull toward the reference model (KTO's beta).")
    loss_type: str = method_flag(
        "kto",
        "kto: 1 - sigmoid(beta x (ratio - KL)) of a desirable completion, 1 - sigmoid(beta x (KL - ratio)) of an "
        "undesirable one; apo_zero_unpaired: the same without the KL estimate (1 - sigmoid(beta x ratio), "
        "sigmoid(beta x ratio)).",
        choices=KTO_LOSSES,
    )
    desirable_weight: float = method_flag(
        1.0, "The weight of a desirable row's loss (raise it when desirable rows are the fewer)."
    )
    undesirable_weight: float = method_flag(1.0, "The weight of an undesirable row's loss.")

    def check(self) -> None:
        positive("beta", self.beta)
        if self.loss_type not in KTO_LOSSES:
            raise ConfigError(f"--loss_type {self.loss_type}: not for --method kto (one of {', '.join(KTO_LOSSES)})")
        positive("desirable_weight", self.desirable_weight)
        positive("undesirable_weight", self.undesirable_weight)

    @property
    def uses_reference(self) -> bool:
        return True

    @property
    def weights(self) -> tuple[float, float]:
        return self.desirable_weight, self.undesirable_weight

    def describe(self) -> str:
        weights = f", weights {self.desirable_weight:g}/{self.undesirable_weight:g}" if self.weights != (1, 1) else ""
        return f"loss {self.loss_type}, beta {self.beta:g}{weights}"


# metrics.jsonl fields (means over the step's rows, all ranks); its `loss` is the mean row loss, `tokens` the
# completions'
KTO_FIELDS = (
    "desirable",  # rows labelled desirable (true) in the step, all ranks
    "undesirable",  # rows labelled undesirable (false)
    "rewards_chosen",  # beta x (policy - reference) summed log-probability of a desirable completion, their mean
    "rewards_rejected",  # the same of the undesirable ones
    "margin",  # rewards_chosen - rewards_rejected
    "kl",  # the KL estimate the loss compares against: the mean over the step's micro-batches (0 with apo_zero_unpaired)
)

KTO = MethodSpec(
    name="kto",
    flags=KtoFlags,
    rows=("unpaired", "preference"),
    what="unpaired rows (prompt, completion, a true/false label column) or preference rows, unpaired",
    summary="kto: Kahneman-Tversky Optimization on rows each labelled desirable or not (a label column of true/false; "
    "preference rows give their chosen answer as desirable and their rejected one as not): each completion's "
    "log-probability ratio to the reference model, against a KL estimate, through a sigmoid (TRL's loss).",
    sequences_per_row=1,
    dropout=False,
    concat=False,
    answers_only=True,
    needs=(REFERENCE_PASS,),
    fields=KTO_FIELDS,
    phases=(REFERENCE_PASS, SECOND_FORWARD),
    unit="item",
    shown=("margin", "kl"),
    rows_hint="give a prompt, a completion and a label column of true/false (--data_format unpaired), or preference rows",
)
