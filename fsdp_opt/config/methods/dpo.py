"""--method dpo: Direct Preference Optimization on preference rows, against a reference model (TRL 1.16's
DPOTrainer, sigmoid loss)."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_opt.config.methods.base import REFERENCE_PASS, MethodSpec, ReferenceFlags, method_flag, positive


@dataclass
class DpoFlags(ReferenceFlags):
    beta: float = method_flag(0.1, "The strength of the pull toward the reference model (DPO's beta).")

    def check(self) -> None:
        positive("beta", self.beta)

    @property
    def uses_reference(self) -> bool:
        return True

    def describe(self) -> str:
        return f"beta {self.beta:g}"


# metrics.jsonl fields (means over the step's pairs, all ranks); its `loss` is the mean pair loss, `tokens` the answers'
DPO_FIELDS = (
    "pairs",  # preference pairs in the step
    "rewards_chosen",  # beta x (policy - reference) summed log-probability of the chosen answer
    "rewards_rejected",  # the same of the rejected answer
    "margin",  # rewards_chosen - rewards_rejected
    "accuracy",  # share of pairs whose chosen reward is the higher (a tie counts half)
)

DPO = MethodSpec(
    name="dpo",
    flags=DpoFlags,
    rows=("preference",),
    what="preference rows (prompt, chosen, rejected)",
    summary="dpo: Direct Preference Optimization on preference rows: -log sigmoid(beta x the chosen answer's "
    "log-probability ratio to the reference model minus the rejected one's), summed log-probabilities of the answer "
    "tokens, averaged over the step's pairs.",
    sequences_per_row=2,
    dropout=False,
    concat=False,
    answers_only=True,
    needs=(REFERENCE_PASS,),
    fields=DPO_FIELDS,
    phases=(REFERENCE_PASS,),
    unit="pair",
    shown=("margin", "accuracy"),
    rows_hint="name the answers' columns with --chosen_column and --rejected_column",
)
