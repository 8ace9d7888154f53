"""Flags of the training method: what a step computes (--method), and DPO's settings."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_opt.base import ConfigError
from fsdp_opt.config.choices import METHODS
from fsdp_opt.config.flags import flag


@dataclass
class MethodConfig:
    method: str = flag(
        "sft",
        "What a step trains. sft: next-token loss on the targets of --train_on. dpo: Direct Preference Optimization on "
        "preference rows: -log sigmoid(beta x the chosen answer's log-probability ratio to the reference model minus "
        "the rejected one's), summed log-probabilities of the answer tokens, averaged over the step's pairs.",
        choices=METHODS,
    )
    beta: float = flag(0.1, "--method dpo: the strength of the pull toward the reference model (beta of DPO's loss).")
    ref_model: str | None = flag(
        None,
        "--method dpo: the reference model (a Hub id or local folder, as --model). Default: the model the chain "
        "started from, which the chain records (a resumed session never takes it from its checkpoint); a LoRA run "
        "without it uses its base with the adapters switched off.",
    )

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ConfigError(f"--beta {self.beta}: must be greater than 0")
        if self.method != "dpo" and self.ref_model is not None:
            raise ConfigError(f"--ref_model {self.ref_model}: only with --method dpo")

    @property
    def dpo(self) -> bool:
        return self.method == "dpo"
